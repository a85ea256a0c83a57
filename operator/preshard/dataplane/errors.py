"""Failures the data plane reports, and how library errors map onto preshard's reasons.

Messages are written here, never copied from a library exception wholesale: an S3 error body
can echo request details, so only the error code, the HTTP status and our own words reach the
log and the termination message.
"""

from __future__ import annotations

from preshard.contract import reasons

# S3 error codes that mean the credentials are missing, wrong or not allowed to do this.
_ACCESS_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "Forbidden",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "UnauthorizedAccess",
        "401",
        "403",
    }
)
# S3 error codes worth another attempt: throttling, server faults, a part that arrived damaged.
_TRANSIENT_CODES = frozenset(
    {
        "BadDigest",
        "InternalError",
        "OperationAborted",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "XAmzContentSHA256Mismatch",
    }
)


class DataplaneError(Exception):
    """A failure with one of preshard's reasons and a one-line message for a person."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def s3_error_code(exc: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of a botocore `ClientError` ("" and None otherwise)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", None
    error = response.get("Error") or {}
    code = str(error.get("Code") or "")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code, status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same S3 request may succeed."""
    import botocore.exceptions  # noqa: PLC0415 - the operator image does not carry botocore

    if isinstance(
        exc,
        botocore.exceptions.HTTPClientError
        | botocore.exceptions.ConnectionError
        | botocore.exceptions.IncompleteReadError
        | botocore.exceptions.ChecksumError,
    ):
        return True
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = s3_error_code(exc)
        if code == "NotImplemented" or status == 501:
            return False
        return code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429))
    return False


def classify_s3_error(exc: BaseException, what: str) -> DataplaneError:
    """Map a boto3/botocore error met while doing `what` to a reason and a clear message."""
    import botocore.exceptions  # noqa: PLC0415 - the operator image does not carry botocore

    if isinstance(exc, DataplaneError):
        return exc
    if isinstance(
        exc,
        botocore.exceptions.NoCredentialsError
        | botocore.exceptions.PartialCredentialsError
        | botocore.exceptions.CredentialRetrievalError
        | botocore.exceptions.TokenRetrievalError,
    ):
        return DataplaneError(
            reasons.ACCESS_DENIED,
            f"no usable S3 credentials while {what} ({type(exc).__name__}): set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or use a web identity",
        )
    if isinstance(
        exc,
        botocore.exceptions.HTTPClientError
        | botocore.exceptions.ConnectionError
        | botocore.exceptions.IncompleteReadError,
    ):
        endpoint = getattr(exc, "kwargs", {}).get("endpoint_url") or "the S3 endpoint"
        return DataplaneError(
            reasons.UNREACHABLE,
            f"cannot reach {endpoint} while {what} ({type(exc).__name__})",
        )
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = s3_error_code(exc)
        label = f"{code or 'error'}, HTTP {status}" if status else code or "error"
        if code in _ACCESS_DENIED_CODES or status in (401, 403):
            return DataplaneError(
                reasons.ACCESS_DENIED,
                f"access denied while {what} ({label}): check the credentials and their "
                "permissions on the bucket",
            )
        if code == "NoSuchBucket":
            return DataplaneError(reasons.BUCKET_NOT_FOUND, f"the bucket does not exist ({what})")
        if is_transient(exc):
            return DataplaneError(
                reasons.UNREACHABLE, f"the S3 server kept failing while {what} ({label})"
            )
        return DataplaneError(
            reasons.INTERNAL_ERROR, f"S3 rejected a request while {what} ({label})"
        )
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return DataplaneError(
            reasons.INTERNAL_ERROR, f"S3 client error while {what} ({type(exc).__name__})"
        )
    return DataplaneError(reasons.INTERNAL_ERROR, f"{type(exc).__name__} while {what}: {exc}")


def classify_hub_error(exc: BaseException, model: str) -> DataplaneError:
    """Map a Hugging Face Hub error for `model` to a reason and a clear message."""
    from huggingface_hub import errors as hub_errors  # noqa: PLC0415 - lazy: data-plane only

    if isinstance(exc, DataplaneError):
        return exc
    if isinstance(exc, hub_errors.GatedRepoError):
        return DataplaneError(
            reasons.ACCESS_DENIED,
            f"{model} is gated on the Hugging Face Hub: accept its terms and set HF_TOKEN",
        )
    if isinstance(exc, hub_errors.RepositoryNotFoundError):
        return DataplaneError(
            reasons.MODEL_NOT_FOUND,
            f"{model} was not found on the Hugging Face Hub (or it is private and HF_TOKEN "
            "does not grant access)",
        )
    if isinstance(exc, hub_errors.RevisionNotFoundError):
        return DataplaneError(reasons.MODEL_NOT_FOUND, f"the revision of {model} was not found")
    if isinstance(exc, hub_errors.EntryNotFoundError):
        return DataplaneError(reasons.MODEL_NOT_FOUND, f"a file of {model} was not found")
    if isinstance(exc, hub_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return DataplaneError(
                reasons.ACCESS_DENIED,
                f"the Hugging Face Hub denied access to {model}: check HF_TOKEN",
            )
        return DataplaneError(
            reasons.UNREACHABLE, f"the Hugging Face Hub failed for {model} (HTTP {status})"
        )
    if isinstance(exc, hub_errors.OfflineModeIsEnabled):
        return DataplaneError(
            reasons.UNREACHABLE, f"cannot download {model}: HF_HUB_OFFLINE is set"
        )
    if isinstance(exc, OSError | TimeoutError) or _is_http_transport_error(exc):
        return DataplaneError(
            reasons.UNREACHABLE,
            f"cannot reach the Hugging Face Hub for {model} ({type(exc).__name__})",
        )
    return DataplaneError(
        reasons.INTERNAL_ERROR, f"{type(exc).__name__} while downloading {model}: {exc}"
    )


def _is_http_transport_error(exc: BaseException) -> bool:
    # The Hub client's HTTP library changed between releases (requests, httpx, httpx2): match
    # the transport-error base classes of whichever is installed.
    import importlib  # noqa: PLC0415

    for module_name in ("httpx2", "httpx", "requests"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for class_name in ("TransportError", "TimeoutException", "ConnectionError", "Timeout"):
            base = getattr(module, class_name, None)
            if isinstance(base, type) and isinstance(exc, base):
                return True
    return False
