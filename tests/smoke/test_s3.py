"""The local S3 server checks signatures, hides rejected secrets, and survives a port race."""

from __future__ import annotations

import socket
from pathlib import Path

import boto3
import botocore.exceptions
import pytest

from preshard_devenv import procs
from preshard_devenv.s3server import S3Bucket, create_bucket, start_s3_server

pytestmark = pytest.mark.s3


def test_a_wrong_secret_is_rejected_without_showing_it(s3_bucket: S3Bucket) -> None:
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="smoke/object", Body=b"payload")
    server = s3_bucket.server
    wrong_secret = "wrong-" + server.credentials.secret_access_key[::-1]
    intruder = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name=server.region,
        aws_access_key_id=server.credentials.access_key_id,
        aws_secret_access_key=wrong_secret,
    )
    with pytest.raises(botocore.exceptions.ClientError) as denied:
        intruder.get_object(Bucket=s3_bucket.name, Key="smoke/object")
    error = denied.value.response
    assert error["Error"]["Code"] == "SignatureDoesNotMatch"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 403
    for secret in (wrong_secret, server.credentials.secret_access_key):
        assert secret not in str(denied.value)
        assert secret not in repr(denied.value.response)
    body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="smoke/object")["Body"]
    assert body.read() == b"payload"


def test_distinct_ports_are_distinct() -> None:
    ports = procs.free_ports(64)
    assert len(set(ports)) == 64


def test_a_port_taken_before_the_server_binds_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = int(squatter.getsockname()[1])
        choices = iter([[taken, *procs.free_ports(7)]])
        real_free_ports = procs.free_ports
        monkeypatch.setattr(
            procs, "free_ports", lambda count: next(choices, None) or real_free_ports(count)
        )
        server = start_s3_server(tmp_path / "s3")
        try:
            assert server.endpoint != f"http://127.0.0.1:{taken}"
            assert "address already in use" in (tmp_path / "s3/logs/seaweedfs.log").read_text()
            bucket = create_bucket(server, "after-the-race")
            bucket.client.put_object(Bucket=bucket.name, Key="object", Body=b"stored")
            assert bucket.keys() == ["object"]
        finally:
            server.stop()
