"""The S3 client of the data plane, and the few calls every command shares.

Credentials come only from boto3's default chain (environment, web identity, config files);
the endpoint from `--endpoint` or boto3's own `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`.
Plain `http://` endpoints work: boto3 does not force TLS on an endpoint it is given. A store
behind a private CA is trusted through `--ca-bundle` (or boto3's own `AWS_CA_BUNDLE`); an
endpoint whose certificate is not trusted fails at once with its own message, not retried.
"""

from __future__ import annotations

import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, TypeVar
from urllib.parse import urlsplit

from preshard import __version__
from preshard.contract import reasons
from preshard.contract.layout import S3Location
from preshard.dataplane.errors import DataplaneError, classify_s3_error, is_transient, s3_error_code
from preshard.dataplane.logs import logger

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

T = TypeVar("T")

CONNECT_TIMEOUT_S: Final = 10
READ_TIMEOUT_S: Final = 120
AddressingStyle = Literal["auto", "path", "virtual"]
ADDRESSING_STYLES: Final[tuple[AddressingStyle, ...]] = ("auto", "path", "virtual")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently one request is retried."""

    attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delay(self, attempt: int) -> float:
        """The pause before retry number `attempt` (1-based): exponential, with jitter."""
        ceiling = min(self.max_delay_s, self.base_delay_s * 2.0 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # noqa: S311 - jitter, not crypto


def make_client(
    *,
    endpoint: str | None,
    region: str | None,
    max_connections: int = 10,
    botocore_attempts: int = 4,
    sign_payloads: bool = True,
    ca_bundle: str | None = None,
    addressing_style: AddressingStyle = "auto",
) -> S3Client:
    """An S3 client for one command: pooled connections, bounded timeouts, no credentials
    passed in (boto3 finds them). `botocore_attempts=1` leaves retries to the caller.

    `ca_bundle`: a PEM file of the CAs that sign the endpoint's certificate (a private CA of
    MinIO or Ceph); without it, boto3's default (`AWS_CA_BUNDLE`, else its public CAs).
    `addressing_style`: `path`, `virtual` or boto3's own choice (`auto`).

    `sign_payloads=False` is for the uploader's client, whose objects and parts each carry a
    CRC64/NVME header the server checks: botocore would otherwise also hash every body with SHA-256
    for the signature (over https too: it does not count a checksum passed as a parameter), and
    the server would hash it again. Measured against the test server, that hash is about a
    fifth of the uploader's own CPU time (`docs/performance.md`).
    """
    import boto3  # noqa: PLC0415 - the operator image does not carry boto3
    from botocore.config import Config  # noqa: PLC0415

    config = Config(
        user_agent_extra=f"preshard/{__version__}",
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        max_pool_connections=max_connections,
        retries={"mode": "standard", "total_max_attempts": botocore_attempts},
        # Part checksums are computed by the uploader and sent as headers; botocore's own
        # streaming trailer checksums cost the server a chunked decode for nothing more.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": sign_payloads, "addressing_style": addressing_style},
    )
    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=endpoint or None,
        region_name=region or None,
        config=config,
        verify=ca_bundle or None,
    )


def untrusted_certificate(exc: BaseException, what: str) -> DataplaneError | None:
    """A clear `Unreachable` for an endpoint whose TLS certificate is not trusted, or None.

    Retrying cannot help until the trust changes, and the library's message (a URL and an
    OpenSSL line) does not say what to do; only the verification's own words are quoted.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            endpoint = _origin(getattr(exc, "kwargs", {}).get("endpoint_url"))
            detail = cause.verify_message or cause.reason or "certificate verify failed"
            return DataplaneError(
                reasons.UNREACHABLE,
                f"the TLS certificate of {endpoint} is not trusted ({detail}) while {what}: "
                "give the CA that signs it in storage.caBundle (--ca-bundle)",
            )
        cause = cause.__cause__ or cause.__context__ or _wrapped(cause)
    return None


def classify_transport_error(exc: BaseException, what: str) -> DataplaneError:
    """`classify_s3_error`, with an untrusted TLS certificate named as such."""
    return untrusted_certificate(exc, what) or classify_s3_error(exc, what)


def _origin(url: object) -> str:
    """`scheme://host:port` of a request URL (not its bucket and key), for a message."""
    parts = urlsplit(url) if isinstance(url, str) else None
    return f"{parts.scheme}://{parts.netloc}" if parts and parts.netloc else "the S3 endpoint"


def _wrapped(exc: BaseException) -> BaseException | None:
    # urllib3 and botocore keep the original error as an argument, not always as the cause.
    for attr in ("reason", "error"):
        inner = getattr(exc, attr, None)
        if isinstance(inner, BaseException):
            return inner
    inner_kwargs = getattr(exc, "kwargs", None)
    if isinstance(inner_kwargs, dict) and isinstance(inner_kwargs.get("error"), BaseException):
        found: BaseException = inner_kwargs["error"]
        return found
    return None


def call_with_retries(
    call: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    stop: threading.Event | None = None,
) -> T:
    """Run one S3 request, retrying transient failures with backoff; map the final failure.

    `stop` ends the waiting early when another part of the same transfer has already failed.
    """
    attempt = 1
    while True:
        try:
            return call()
        except DataplaneError:
            raise
        except Exception as exc:
            untrusted = untrusted_certificate(exc, what)
            if untrusted is not None:
                raise untrusted from exc
            if not is_transient(exc) or attempt >= policy.attempts or (stop and stop.is_set()):
                raise classify_s3_error(exc, what) from exc
            delay = policy.delay(attempt)
            code, _ = s3_error_code(exc)
            logger().warning(
                "retrying %s in %.1fs (attempt %d of %d failed: %s)",
                what,
                delay,
                attempt,
                policy.attempts,
                code or type(exc).__name__,
            )
            if stop is not None:
                if stop.wait(delay):
                    raise classify_s3_error(exc, what) from exc
            else:
                time.sleep(delay)
            attempt += 1


def list_sizes(client: S3Client, location: S3Location) -> dict[str, int]:
    """Every object strictly under the prefix (`prefix/`), by name relative to it, with its size.

    One paginated LIST. The trailing slash keeps `p/key` from matching `p/key2/...`.
    """
    base = f"{location.prefix}/" if location.prefix else ""
    sizes: dict[str, int] = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=base
        ):
            for obj in page.get("Contents", []):
                sizes[obj["Key"][len(base) :]] = int(obj["Size"])
    except Exception as exc:
        raise classify_transport_error(exc, f"listing {location.uri}") from exc
    return sizes


def get_small_object(client: S3Client, location: S3Location, name: str) -> bytes | None:
    """The body of a small object (a manifest), or None when it does not exist."""
    key = location.key(name)
    try:
        response = client.get_object(Bucket=location.bucket, Key=key)
        return response["Body"].read()
    except Exception as exc:
        code, status = s3_error_code(exc)
        if code in ("NoSuchKey", "404") or (status == 404 and code != "NoSuchBucket"):
            return None
        raise classify_transport_error(exc, f"reading s3://{location.bucket}/{key}") from exc


def require_prefix(location: S3Location, what: str) -> None:
    """Refuse a bucket-root location where a shard-set prefix is expected."""
    if not location.prefix:
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS,
            f"{location.uri} is a bucket root; {what} needs s3://bucket/prefix/<key>",
        )
