"""serialize -> verify -> load every rank back -> fetch-config -> delete, against real S3."""

from __future__ import annotations

from pathlib import Path

import pytest

from preshard.contract import reasons
from preshard.dataplane.checksums import CRC64NVME, digest_of_bytes
from preshard_devenv import cpuengine
from preshard_devenv.s3server import S3Bucket, S3Server
from preshard_devenv.tinymodel import TinyModel
from tests.dataplane.conftest import Cli, read_manifest, serialize_args
from tests.support.models import assert_shards_match, download_prefix

pytestmark = pytest.mark.s3


@pytest.mark.parametrize(("tp", "dtype"), [(1, "auto"), (2, "bfloat16"), (4, "float16")])
def test_round_trip(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    s3_server: S3Server,
    tiny_model: TinyModel,
    model_uri: str,
    prefix: str,
    tmp_path: Path,
    tp: int,
    dtype: str,
) -> None:
    key = f"tp{tp}"
    uri = f"s3://{s3_bucket.name}/{prefix}/{key}/"

    made = run_cli(
        *serialize_args(model_uri, s3_bucket, prefix, key, tmp_path / "scratch", tp=tp, dtype=dtype)
    )

    assert made.code == 0, made.stderr
    assert made.outcome.reason == reasons.SERIALIZED
    assert made.outcome.tensor_parallel_size == tp
    assert made.outcome.vllm_version == cpuengine.VLLM_VERSION
    assert made.outcome.encrypted is False
    assert "upload:" in made.stderr
    assert s3_server.credentials.secret_access_key not in made.stdout + made.stderr

    checked = run_cli(
        "verify", uri, "--tensor-parallel-size", str(tp), "--artifact-key", key, "--deep"
    )
    assert checked.code == 0, checked.stderr
    assert checked.outcome.reason == reasons.VERIFIED
    assert checked.outcome.total_bytes == made.outcome.total_bytes
    assert checked.outcome.files == tp + len(tiny_model.config_files)
    assert checked.outcome.manifest_format == 2

    manifest = read_manifest(s3_bucket, f"{prefix}/{key}")
    assert manifest["tensorParallelSize"] == tp
    assert manifest["dtype"] == dtype
    assert manifest["model"] == model_uri
    assert manifest["encrypted"] is False
    files = {f["name"]: f for f in manifest["files"]}  # type: ignore[attr-defined]
    ranks = [f"model-rank-{r:03d}.tensors" for r in range(tp)]
    assert sorted(n for n, f in files.items() if f["kind"] == "shard") == ranks
    assert sorted(n for n, f in files.items() if f["kind"] == "config") == sorted(
        tiny_model.config_files
    )

    stored = download_prefix(s3_bucket.client, s3_bucket.name, f"{prefix}/{key}", tmp_path / "got")
    assert sorted(stored) == sorted([*files, "manifest.json"])
    for name, entry in files.items():
        data = stored[name].read_bytes()
        assert len(data) == entry["size"]
        assert "sha256" not in entry
        assert digest_of_bytes(data, CRC64NVME) == entry["crc64nvme"]
    for name in tiny_model.config_files:
        assert stored[name].read_bytes() == (tiny_model.path / name).read_bytes()
    assert_shards_match(tiny_model, [stored[r] for r in ranks], dtype=dtype)


def test_fetch_config_copies_only_the_config_files(
    run_cli: Cli, s3_bucket: S3Bucket, tiny_model: TinyModel, stored_set: str, tmp_path: Path
) -> None:
    target = tmp_path / "model-dir"

    fetched = run_cli("fetch-config", f"s3://{s3_bucket.name}/{stored_set}/", str(target))

    assert fetched.code == 0, fetched.stderr
    assert fetched.outcome.reason == reasons.CONFIG_FETCHED
    assert fetched.outcome.files == len(tiny_model.config_files)
    assert sorted(p.name for p in target.iterdir()) == sorted(tiny_model.config_files)
    for name in tiny_model.config_files:
        assert (target / name).read_bytes() == (tiny_model.path / name).read_bytes()


def test_serialize_again_finishes_at_once(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, stored_set: str, tmp_path: Path
) -> None:
    before = {
        o["Key"]: o["LastModified"]
        for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name, Prefix=stored_set + "/")[
            "Contents"
        ]
    }
    folder, key = stored_set.split("/")
    scratch = tmp_path / "scratch"

    again = run_cli(*serialize_args(model_uri, s3_bucket, folder, key, scratch, tp=2))

    assert again.code == 0, again.stderr
    assert again.outcome.reason == reasons.SERIALIZED
    assert "already complete" in again.outcome.message
    assert not scratch.exists()
    after = {
        o["Key"]: o["LastModified"]
        for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name, Prefix=stored_set + "/")[
            "Contents"
        ]
    }
    assert after == before


def test_lost_manifest_is_rewritten_without_uploading_again(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, prefix: str, tmp_path: Path
) -> None:
    args = serialize_args(model_uri, s3_bucket, prefix, "resume", tmp_path / "scratch", tp=2)
    assert run_cli(*args).code == 0
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=f"{prefix}/resume/manifest.json")
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=f"{prefix}/resume/stale.bin", Body=b"x")
    missing = run_cli(
        "verify", f"s3://{s3_bucket.name}/{prefix}/resume/", "--tensor-parallel-size", "2"
    )
    assert missing.outcome.reason == reasons.MANIFEST_MISSING

    again = run_cli(*args)

    assert again.code == 0, again.stderr
    assert "rank files in" in again.stderr
    assert again.stderr.count("skipping") == 2 + 4
    assert "0 B uploaded" in again.outcome.message
    assert s3_bucket.keys(f"{prefix}/resume/stale") == []
    checked = run_cli(
        "verify", f"s3://{s3_bucket.name}/{prefix}/resume/", "--tensor-parallel-size", "2", "--deep"
    )
    assert checked.code == 0, checked.stderr


def test_delete_removes_exactly_one_set(
    run_cli: Cli, s3_bucket: S3Bucket, stored_set: str, prefix: str
) -> None:
    from tests.dataplane.conftest import copy_set  # noqa: PLC0415

    copy_set(s3_bucket, stored_set, f"{prefix}/key")
    copy_set(s3_bucket, stored_set, f"{prefix}/key2")
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=f"{prefix}/key.txt", Body=b"neighbour")
    count = len(s3_bucket.keys(f"{prefix}/key/"))

    deleted = run_cli("delete", f"s3://{s3_bucket.name}/{prefix}/key")

    assert deleted.code == 0, deleted.stderr
    assert deleted.outcome.reason == reasons.DELETED
    assert deleted.outcome.files == count
    assert s3_bucket.keys(f"{prefix}/key/") == []
    assert len(s3_bucket.keys(f"{prefix}/key2/")) == count
    assert s3_bucket.keys(f"{prefix}/key.txt") == [f"{prefix}/key.txt"]

    again = run_cli("delete", f"s3://{s3_bucket.name}/{prefix}/key/")
    assert again.code == 0
    assert again.outcome.files == 0
