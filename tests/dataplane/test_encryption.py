"""Encrypted shard sets: every rank uses the user's key; without it the tensors stay unreadable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tensorizer.serialization import CryptographyError

from preshard.contract import reasons
from preshard_devenv.s3server import S3Bucket
from preshard_devenv.tinymodel import TinyModel
from tests.dataplane.conftest import Cli, read_manifest, serialize_args
from tests.support.models import assert_shards_match, download_prefix, load_rank_files

pytestmark = pytest.mark.s3


def test_encrypted_round_trip(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    tiny_model: TinyModel,
    model_uri: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    key = os.urandom(32)
    keyfile = tmp_path / "key"
    keyfile.write_bytes(key)
    args = serialize_args(
        model_uri,
        s3_bucket,
        prefix,
        "enc",
        tmp_path / "scratch",
        tp=2,
        extra=["--encryption-keyfile", str(keyfile)],
    )

    made = run_cli(*args)

    assert made.code == 0, made.stderr
    assert made.outcome.encrypted is True
    assert keyfile.read_bytes() == key
    assert read_manifest(s3_bucket, f"{prefix}/enc")["encrypted"] is True
    stored = download_prefix(s3_bucket.client, s3_bucket.name, f"{prefix}/enc", tmp_path / "got")
    ranks = [stored["model-rank-000.tensors"], stored["model-rank-001.tensors"]]
    assert_shards_match(tiny_model, ranks, key=key)
    with pytest.raises(CryptographyError):
        load_rank_files(ranks)
    with pytest.raises(CryptographyError):
        load_rank_files(ranks, key=os.urandom(32))
    verified = run_cli(
        "verify", f"s3://{s3_bucket.name}/{prefix}/enc/", "--tensor-parallel-size", "2"
    )
    assert verified.outcome.encrypted is True


@pytest.mark.parametrize("content", [b"", b"short key", os.urandom(64)])
def test_a_key_file_of_the_wrong_length_is_refused(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, prefix: str, tmp_path: Path, content: bytes
) -> None:
    keyfile = tmp_path / "key"
    keyfile.write_bytes(content)
    args = serialize_args(
        model_uri,
        s3_bucket,
        prefix,
        "enc",
        tmp_path / "scratch",
        tp=1,
        extra=["--encryption-keyfile", str(keyfile)],
    )

    result = run_cli(*args)

    assert (result.code, result.outcome.reason) == (33, reasons.ENCRYPTION_KEY_INVALID)
    assert f"holds {len(content)} bytes" in result.outcome.message
    assert s3_bucket.keys(prefix + "/") == []


def test_a_missing_key_file_is_refused(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, prefix: str, tmp_path: Path
) -> None:
    args = serialize_args(
        model_uri,
        s3_bucket,
        prefix,
        "enc",
        tmp_path / "scratch",
        tp=1,
        extra=["--encryption-keyfile", str(tmp_path / "absent")],
    )

    result = run_cli(*args)

    assert (result.code, result.outcome.reason) == (33, reasons.ENCRYPTION_KEY_INVALID)
