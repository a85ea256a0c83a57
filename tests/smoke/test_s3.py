"""The local S3 server checks signatures, and a rejected secret never shows in the error."""

from __future__ import annotations

import boto3
import botocore.exceptions
import pytest

from tests.support.s3 import S3Bucket

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
