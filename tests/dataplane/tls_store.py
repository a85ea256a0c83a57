"""A SeaweedFS S3 server that serves HTTPS with a certificate of a private CA.

The server `preshard_devenv.s3server` starts (its command line and identities), with its S3
gateway also listening for TLS on a port of its own, with a serving certificate for 127.0.0.1
and `localhost` made by `preshard_devenv.pki` (as the test control plane makes its own). The CA
certificate is written beside it, the way a user would put it into a ConfigMap.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from preshard_devenv import pki, procs, s3server
from preshard_devenv.s3server import S3Server, admin_client, make_bucket


@dataclass(frozen=True)
class TlsStore:
    """A running TLS S3 server: its `https://` endpoint and the CA that signs its certificate."""

    server: S3Server
    endpoint: str
    ca_file: Path

    def env(self) -> dict[str, str]:
        """Credentials, region and the HTTPS endpoint (no CA: each test says how it trusts)."""
        return self.server.env() | {"AWS_ENDPOINT_URL_S3": self.endpoint}

    def create_bucket(self, name: str) -> None:
        """Create a bucket over HTTPS, retrying while the filer finishes starting."""
        client = admin_client(self.server, endpoint_url=self.endpoint, verify=str(self.ca_file))
        make_bucket(client, name)


@contextmanager
def tls_s3_server(directory: Path) -> Iterator[TlsStore]:
    """Start SeaweedFS with TLS on loopback for the duration of the block."""
    authority = pki.CertificateAuthority.create("preshard-test-store-ca")
    serving = authority.issue_serving("s3", ["127.0.0.1", "localhost"])
    tls = directory / "tls"
    tls.mkdir(parents=True, exist_ok=True)
    ca_file = tls / "ca.crt"
    ca_file.write_bytes(authority.cert_pem)
    (tls / "tls.crt").write_bytes(serving.cert_pem)
    pki.write_private(tls / "tls.key", serving.key_pem)
    data_dir = directory / "s3"
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    credentials = s3server.S3Credentials.random()
    identities = s3server.write_identities(data_dir, credentials)
    argv, endpoint = s3server._server_argv(data_dir, identities)
    (https_port,) = procs.free_ports(1)
    argv += [
        f"-s3.cert.file={tls / 'tls.crt'}",
        f"-s3.key.file={tls / 'tls.key'}",
        f"-s3.port.https={https_port}",
    ]
    process = s3server._launch(data_dir, argv)
    server = S3Server(
        endpoint=endpoint,
        region="us-east-1",
        credentials=credentials,
        process=process,
        data_dir=data_dir,
    )
    try:
        s3server._wait_ready(endpoint, process)
        yield TlsStore(server, f"https://127.0.0.1:{https_port}", ca_file)
    finally:
        process.stop()
