"""The small shared modules: identity, conditions, settings, layout, outcome, manifest."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Literal

import pytest

from preshard.api.models import parse_spec
from preshard.api.status import Condition
from preshard.builders.identity import artifact_key
from preshard.contract import reasons
from preshard.contract.layout import InvalidURIError, S3Location, rank_file_names, tensorizer_uri
from preshard.contract.outcome import (
    EXIT_CODES,
    PERMANENT_EXIT_CODES,
    TERMINATION_MESSAGE_LIMIT,
    Outcome,
    exit_code,
    reason_for_exit_code,
)
from preshard.controller import conditions
from preshard.dataplane.manifest import Manifest, ManifestFile
from preshard.dataplane.shardset import set_outcome
from preshard.settings import Settings, SettingsError

CRC_OF_HELLO = "3377857006524257"  # CRC64/NVME of b"hello"

SPEC = {
    "model": {"id": "org/model", "revision": "abc"},
    "storage": {"uri": "s3://bucket/prefix"},
    "tensorParallelSizes": [2, 4],
}


def key(change: Mapping[str, object] | None = None, tp: int = 2, **kwargs: str) -> str:
    spec = parse_spec({**SPEC, **(change or {})})
    return artifact_key(
        spec,
        tp,
        namespace=kwargs.get("namespace", "ns"),
        serializer_image=kwargs.get("image", "img:1"),
    )


def test_artifact_key_is_stable_and_sensitive_to_what_changes_bytes() -> None:
    base = key()
    assert base == key()
    assert len(base) == 20
    assert key(tp=4) != base
    assert key(image="img:2") != base
    assert key({"model": {"id": "org/model", "revision": "def"}}) != base
    assert key({"serialization": {"dtype": "bfloat16"}}) != base
    assert key({"serialization": {"extraEngineArgs": {"quantization": "fp8"}}}) != base
    encrypted = {"encryption": {"secretRef": {"name": "k", "key": "key"}}}
    assert key(encrypted) != base
    assert key(encrypted, namespace="other") != key(encrypted)


def test_artifact_key_ignores_what_does_not_change_bytes() -> None:
    base = key()
    assert key({"serialization": {"maxModelLen": 2048}}) == base
    assert key({"targets": [{"name": "vllm"}]}) == base
    assert key(namespace="other") == base
    assert key({"serialization": {"extraEngineArgs": {"max-num-seqs": "8"}}}) == key(
        {"serialization": {"extraEngineArgs": {"max_num_seqs": "8"}}}
    )


def test_set_condition_keeps_transition_time_unless_status_flips() -> None:
    first = conditions.set_condition([], "Ready", "False", "Probing", "", now="t1", generation=1)
    same = conditions.set_condition(
        first, "Ready", "False", "Serializing", "x", now="t2", generation=2
    )
    assert same[0].last_transition_time == "t1"
    assert (same[0].reason, same[0].observed_generation) == ("Serializing", 2)
    flipped = conditions.set_condition(same, "Ready", "True", "Ready", "", now="t3", generation=2)
    assert flipped[0].last_transition_time == "t3"


def test_conditions_are_kept_in_a_stable_order() -> None:
    result: list[Condition] = []
    for type_ in ("Degraded", "Verified", "Ready", "Custom"):
        result = conditions.set_condition(result, type_, "True", "R", "", now="t", generation=1)
    assert [c.type for c in result] == ["Ready", "Verified", "Degraded", "Custom"]


def test_settings_from_environment() -> None:
    settings = Settings.from_env(
        {
            "PRESHARD_NUM_READERS": "16",
            "PRESHARD_NAMESPACES": "b, a,,a",
            "PRESHARD_GPU_RESOURCE_NAME": "amd.com/gpu",
        }
    )
    assert settings.num_readers == 16
    assert settings.namespaces == ("a", "b")
    assert settings.gpu_resource_name == "amd.com/gpu"
    assert Settings.from_env({}) == Settings()
    with pytest.raises(SettingsError, match="PRESHARD_NUM_READERS"):
        Settings.from_env({"PRESHARD_NUM_READERS": "many"})
    with pytest.raises(SettingsError, match="at least 1"):
        Settings.from_env({"PRESHARD_MAX_GPUS_PER_JOB": "0"})
    with pytest.raises(SettingsError, match="LOG_FORMAT"):
        Settings.from_env({"PRESHARD_LOG_FORMAT": "xml"})


def test_the_default_scratch_size_is_read_as_the_specs() -> None:
    assert Settings.from_env({"PRESHARD_SCRATCH_SIZE": "1e12"}).scratch_size == "1e12"
    assert Settings.from_env({"PRESHARD_SCRATCH_SIZE": ".5Ti"}).scratch_size == ".5Ti"
    for bad in ("200 GB", "1e1.5", "0", "-1Gi"):
        with pytest.raises(SettingsError, match="PRESHARD_SCRATCH_SIZE: "):
            Settings.from_env({"PRESHARD_SCRATCH_SIZE": bad})


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [
        ("s3://bucket", "bucket", ""),
        ("s3://bucket/", "bucket", ""),
        ("s3://bucket/a/b/", "bucket", "a/b"),
        ("s3://my.bucket-1/x.y/..z", "my.bucket-1", "x.y/..z"),
    ],
)
def test_s3_locations_parse(uri: str, bucket: str, prefix: str) -> None:
    location = S3Location.parse(uri)
    assert (location.bucket, location.prefix) == (bucket, prefix)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://b",
        "s3://Bucket/x",
        "s3://bucket/a//b",
        "s3://bucket/../x",
        "s3://bucket/./x",
        "gs://b/x",
        "s3://bucket/a b",
        "s3://bucket/é",
    ],
)
def test_bad_s3_uris_are_refused(uri: str) -> None:
    with pytest.raises(InvalidURIError):
        S3Location.parse(uri)


def test_shard_set_names() -> None:
    location = S3Location.parse("s3://bucket/shards").child("k1")
    assert location.uri == "s3://bucket/shards/k1/"
    assert tensorizer_uri(location, 2) == "s3://bucket/shards/k1/model-rank-%03d.tensors"
    # vLLM substitutes the rank only when TP > 1: a TP 1 server is given the file itself.
    assert tensorizer_uri(location, 1) == "s3://bucket/shards/k1/model-rank-000.tensors"
    assert rank_file_names(3) == [
        "model-rank-000.tensors",
        "model-rank-001.tensors",
        "model-rank-002.tensors",
    ]


def test_outcome_round_trips_and_fits_the_termination_message() -> None:
    outcome = Outcome(command="verify", ok=False, reason=reasons.SHARD_MISSING, message="x" * 10000)
    text = outcome.to_message()
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT
    parsed = Outcome.from_message(text)
    assert parsed is not None
    assert parsed.reason == reasons.SHARD_MISSING
    assert parsed.message.endswith("...")
    assert Outcome.from_message("Error: not json") is None
    assert Outcome.from_message(None) is None


def test_exit_codes_are_distinct_per_failure() -> None:
    failures = {r: c for r, c in EXIT_CODES.items() if c != 0}
    assert len(set(failures.values())) == len(failures)
    for reason, code in failures.items():
        assert reason_for_exit_code(code) == reason
        assert exit_code(reason) == code
    assert exit_code("SomethingNew") == 1
    assert exit_code(reasons.ACCESS_DENIED) in PERMANENT_EXIT_CODES
    assert exit_code(reasons.UNREACHABLE) not in PERMANENT_EXIT_CODES


def _manifest(*files: ManifestFile, format_version: Literal[1, 2] = 2) -> Manifest:
    return Manifest(
        format_version=format_version,
        artifact_key="k",
        model="org/model",
        tensor_parallel_size=2,
        dtype="bfloat16",
        vllm_version="0.34.0",
        tensorizer_version="2.10.1",
        encrypted=False,
        created="2026-12-01T00:00:00Z",
        files=files,
    )


def test_manifest_shape() -> None:
    manifest = _manifest(
        ManifestFile(name="model-rank-001.tensors", size=5, crc64nvme=CRC_OF_HELLO, kind="shard"),
        ManifestFile(name="model-rank-000.tensors", size=5, crc64nvme=CRC_OF_HELLO, kind="shard"),
        ManifestFile(name="config.json", size=2, crc64nvme="0" * 16, kind="config"),
    )
    assert [f.name for f in manifest.shards] == manifest.expected_shard_names()
    assert manifest.total_bytes == 12
    stored = json.loads(manifest.to_json())
    assert stored["formatVersion"] == 2
    assert stored["tensorParallelSize"] == 2
    assert stored["files"][0] == {
        "name": "model-rank-001.tensors",
        "size": 5,
        "crc64nvme": CRC_OF_HELLO,
        "kind": "shard",
    }
    assert Manifest.model_validate_json(manifest.to_json()) == manifest
    assert manifest.shards[0].checksum == ("crc64nvme", CRC_OF_HELLO)
    assert manifest.shards[0].matches_bytes(b"hello")
    assert not manifest.shards[0].matches_bytes(b"hellO")


def test_a_format_1_manifest_is_checked_by_its_sha256() -> None:
    sha = hashlib.sha256(b"hello").hexdigest()
    entry = ManifestFile(name="model-rank-000.tensors", size=5, sha256=sha, kind="shard")
    text = _manifest(entry, format_version=1).to_json()
    assert json.loads(text)["files"][0] == {
        "name": "model-rank-000.tensors",
        "size": 5,
        "sha256": sha,
        "kind": "shard",
    }
    parsed = Manifest.model_validate_json(text)
    assert parsed.format_version == 1
    assert parsed.shards[0].checksum == ("sha256", sha)
    assert parsed.shards[0].matches_bytes(b"hello")
    assert not parsed.shards[0].matches_bytes(b"hellO")


@pytest.mark.parametrize("version", [1, 2])
def test_the_outcome_about_a_set_says_its_manifest_format(version: Literal[1, 2]) -> None:
    """The controller keeps an older tools image only while it reads the set's format."""
    checksum = {"sha256": "0" * 64} if version == 1 else {"crc64nvme": CRC_OF_HELLO}
    entry = ManifestFile(name="model-rank-000.tensors", size=5, kind="shard", **checksum)
    manifest = _manifest(entry, format_version=version)
    outcome = set_outcome("verify", reasons.VERIFIED, "complete", "s3://b/p/k/", manifest)
    assert outcome.manifest_format == version
    assert json.loads(outcome.to_message())["manifestFormat"] == version


def test_a_manifest_file_without_a_checksum_is_refused() -> None:
    with pytest.raises(ValueError, match="neither a crc64nvme nor a sha256"):
        ManifestFile(name="model-rank-000.tensors", size=5, kind="shard")
