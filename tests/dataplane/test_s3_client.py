"""The uploader's S3 client: unsigned payloads, yet every body is checked by the server."""

from __future__ import annotations

from typing import Any

import botocore.exceptions
import pytest

from preshard.dataplane.checksums import crc64nvme, s3_header
from preshard.dataplane.s3 import make_client
from preshard_devenv.s3server import S3Bucket

pytestmark = pytest.mark.s3


def _sent_content_hashes(client: Any) -> list[str]:
    seen: list[str] = []

    def record(request: Any, **_: Any) -> None:
        seen.append(request.headers["x-amz-content-sha256"].decode())

    client.meta.events.register("before-send.s3.PutObject", record)
    return seen


@pytest.mark.usefixtures("s3_env")
@pytest.mark.parametrize("signed", [True, False])
def test_payload_signing_is_a_choice_and_the_body_arrives_intact(
    s3_bucket: S3Bucket, signed: bool
) -> None:
    client = make_client(endpoint=None, region=None, sign_payloads=signed)
    seen = _sent_content_hashes(client)
    body = b"rank file bytes " * 1000
    key = f"client/{'signed' if signed else 'unsigned'}"
    client.put_object(
        Bucket=s3_bucket.name, Key=key, Body=body, ChecksumCRC64NVME=s3_header(crc64nvme(body))
    )
    assert len(seen) == 1
    assert (seen[0] == "UNSIGNED-PAYLOAD") is not signed
    assert s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read() == body


@pytest.mark.usefixtures("s3_env")
def test_an_unsigned_body_that_does_not_match_its_checksum_is_refused(s3_bucket: S3Bucket) -> None:
    client = make_client(endpoint=None, region=None, sign_payloads=False)
    with pytest.raises(botocore.exceptions.ClientError):
        client.put_object(
            Bucket=s3_bucket.name,
            Key="client/corrupt",
            Body=b"what arrived",
            ChecksumCRC64NVME=s3_header(crc64nvme(b"what was read")),
        )
    assert s3_bucket.keys("client/corrupt") == []
