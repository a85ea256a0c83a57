"""Helpers for tests that talk to the local S3 server directly."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import boto3
import botocore.exceptions

from preshard_devenv.s3server import S3Server

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on the test S3 server, with an admin client for assertions."""

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


def admin_client(server: S3Server) -> S3Client:
    """A boto3 client with the server's own credentials."""
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name=server.region,
        aws_access_key_id=server.credentials.access_key_id,
        aws_secret_access_key=server.credentials.secret_access_key,
    )


def create_bucket(server: S3Server, name: str) -> S3Bucket:
    """Create a bucket, retrying while the server finishes starting its filer."""
    client = admin_client(server)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket=name)
            return S3Bucket(name=name, server=server, client=client)
        except (botocore.exceptions.ClientError, botocore.exceptions.EndpointConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
