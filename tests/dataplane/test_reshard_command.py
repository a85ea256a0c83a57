"""`preshard reshard` against real S3: a stored TP N set in vLLM's layout, the TP M set out.

The source sets are written as vLLM's (`preshard_devenv.vllm_layout`) with their manifest, the
way `serialize` stores them; `test_reshard.py` (engine tier) starts from sets vLLM wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import pytest
import tensorizer
import torch
from tensorizer.serialization import CryptographyError

from preshard.contract import reasons
from preshard.contract.layout import MANIFEST_NAME
from preshard.contract.outcome import exit_code
from preshard.dataplane.checksums import CRC64NVME, digest_of_bytes
from preshard.dataplane.manifest import Manifest, ManifestFile
from preshard.dataplane.upload import FileKind
from preshard_devenv.cpuengine import load_checkpoint
from preshard_devenv.s3server import S3Bucket
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from preshard_devenv.vllm_layout import Entry, rank_entries, write_rank_file, write_vllm_set
from tests.dataplane.conftest import Cli, read_manifest
from tests.support.models import download_prefix, load_rank_files

pytestmark = pytest.mark.s3

SHAPE = {"layers": 2, "heads": 4, "kv_heads": 2, "vocab": 500}
VLLM_VERSION = "0.34.0"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("reshard-source"), **SHAPE)


def store_set(
    bucket: S3Bucket,
    prefix: str,
    model: TinyModel,
    rank_files: list[Path],
    *,
    config: dict[str, Any] | None = None,
    encrypted: bool = False,
    format_version: Literal[1, 2] = 2,
) -> str:
    """Upload rank files, the model's config files and a manifest, as `serialize` does; format
    1 is a set written before manifests recorded CRC64/NVME (a sha256 per file)."""
    files: dict[str, tuple[bytes, FileKind]] = {
        p.name: (p.read_bytes(), "shard") for p in rank_files
    }
    for name in model.config_files:
        files[name] = ((model.path / name).read_bytes(), "config")
    if config is not None:
        files["config.json"] = (json.dumps(config).encode(), "config")
    for name, (body, _) in files.items():
        bucket.client.put_object(Bucket=bucket.name, Key=f"{prefix}/{name}", Body=body)
    manifest = Manifest(
        artifact_key=prefix.rsplit("/", 1)[-1],
        model="org/tiny",
        revision="abc123",
        tensor_parallel_size=len(rank_files),
        dtype="float32",
        vllm_version=VLLM_VERSION,
        tensorizer_version="2.10.1",
        encrypted=encrypted,
        created="2026-01-01T00:00:00Z",
        format_version=format_version,
        files=tuple(
            ManifestFile(name=name, size=len(body), kind=kind, **checksum(body, format_version))
            for name, (body, kind) in files.items()
        ),
    )
    bucket.client.put_object(
        Bucket=bucket.name, Key=f"{prefix}/{MANIFEST_NAME}", Body=manifest.to_json().encode()
    )
    return f"s3://{bucket.name}/{prefix}/"


def checksum(body: bytes, format_version: int) -> dict[str, str]:
    """A manifest entry's checksum field, as each format records it."""
    if format_version == 1:
        return {"sha256": hashlib.sha256(body).hexdigest()}
    return {"crc64nvme": digest_of_bytes(body, CRC64NVME)}


def reshard_args(source: str, dest: str, tp: int, scratch: Path, *extra: str) -> list[str]:
    return [
        "reshard",
        source,
        "--to-tensor-parallel-size",
        str(tp),
        "--dest",
        dest,
        "--scratch-dir",
        str(scratch),
        *extra,
    ]


# The last source is a format 1 set (a sha256 per file), as earlier versions wrote.
@pytest.mark.parametrize(
    ("source_tp", "target_tp", "source_format"), [(2, 4, 2), (2, 1, 2), (1, 2, 1)]
)
def test_reshard_stores_the_set_vllms_layout_gives_with_its_provenance(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    model: TinyModel,
    prefix: str,
    tmp_path: Path,
    source_tp: int,
    target_tp: int,
    source_format: Literal[1, 2],
) -> None:
    checkpoint, cfg = (
        load_checkpoint(model.path),
        json.loads((model.path / "config.json").read_text()),
    )
    source = store_set(
        s3_bucket,
        f"{prefix}/src{source_tp}",
        model,
        write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=source_tp),
        format_version=source_format,
    )
    expected = write_vllm_set(checkpoint, cfg, tmp_path / "expected", tp=target_tp)
    dest = f"s3://{s3_bucket.name}/{prefix}/tp{target_tp}/"

    made = run_cli(*reshard_args(source, dest, target_tp, tmp_path / "scratch"))

    assert made.code == 0, made.stderr
    assert made.outcome.command == "reshard"
    assert made.outcome.reason == reasons.RESHARDED
    assert made.outcome.artifact_key == f"tp{target_tp}"
    assert made.outcome.tensor_parallel_size == target_tp
    assert made.outcome.vllm_version == VLLM_VERSION
    assert made.outcome.encrypted is False
    assert f"from TP {source_tp} to TP {target_tp}" in made.outcome.message
    assert "peak RSS" in made.outcome.message
    assert made.outcome.files == target_tp + len(model.config_files)

    manifest = read_manifest(s3_bucket, f"{prefix}/tp{target_tp}")
    assert manifest["formatVersion"] == 2  # whatever the source's format
    assert manifest["reshardedFrom"] == {
        "uri": source,
        "artifactKey": f"src{source_tp}",
        "tensorParallelSize": source_tp,
    }
    assert (manifest["model"], manifest["revision"], manifest["dtype"]) == (
        "org/tiny",
        "abc123",
        "float32",
    )
    assert manifest["tensorizerVersion"] == tensorizer.__version__
    stored = download_prefix(
        s3_bucket.client, s3_bucket.name, f"{prefix}/tp{target_tp}", tmp_path / "got"
    )
    for path in expected:
        assert stored[path.name].read_bytes() == path.read_bytes(), path.name
    for name in model.config_files:
        assert stored[name].read_bytes() == (model.path / name).read_bytes()

    checked = run_cli("verify", dest, "--tensor-parallel-size", str(target_tp), "--deep")
    assert checked.code == 0, checked.stderr
    again = run_cli(*reshard_args(source, dest, target_tp, tmp_path / "scratch2"))
    assert again.code == 0
    assert "already complete" in again.outcome.message


def test_an_encrypted_set_is_resharded_with_its_key_and_stays_encrypted(
    run_cli: Cli, s3_bucket: S3Bucket, model: TinyModel, prefix: str, tmp_path: Path
) -> None:
    checkpoint, cfg = (
        load_checkpoint(model.path),
        json.loads((model.path / "config.json").read_text()),
    )
    key = os.urandom(32)
    keyfile = tmp_path / "key"
    keyfile.write_bytes(key)
    source = store_set(
        s3_bucket,
        f"{prefix}/enc2",
        model,
        write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=2, key=key),
        encrypted=True,
    )
    dest = f"s3://{s3_bucket.name}/{prefix}/enc4/"

    without = run_cli(*reshard_args(source, dest, 4, tmp_path / "s1"))
    wrong = tmp_path / "wrong"
    wrong.write_bytes(os.urandom(32))
    with_wrong = run_cli(
        *reshard_args(source, dest, 4, tmp_path / "s2", "--encryption-keyfile", str(wrong))
    )
    made = run_cli(
        *reshard_args(source, dest, 4, tmp_path / "s3", "--encryption-keyfile", str(keyfile))
    )

    assert without.outcome.reason == reasons.ENCRYPTION_KEY_INVALID
    assert "is encrypted; reshard needs its key" in without.outcome.message
    assert with_wrong.outcome.reason == reasons.ENCRYPTION_KEY_INVALID
    assert with_wrong.code == exit_code(reasons.ENCRYPTION_KEY_INVALID)
    assert made.code == 0, made.stderr
    assert made.outcome.encrypted is True
    assert read_manifest(s3_bucket, f"{prefix}/enc4")["encrypted"] is True
    stored = download_prefix(s3_bucket.client, s3_bucket.name, f"{prefix}/enc4", tmp_path / "got")
    ranks = [stored[f"model-rank-{r:03d}.tensors"] for r in range(4)]
    expected = load_rank_files(write_vllm_set(checkpoint, cfg, tmp_path / "plain", tp=4))
    got = load_rank_files(ranks, key=key)
    for mine, theirs in zip(got, expected, strict=True):
        assert list(mine) == list(theirs)
        assert all(mine[n].equal(t) for n, t in theirs.items())
    with pytest.raises(CryptographyError):
        load_rank_files(ranks)


def unknown_tensor_files(model: TinyModel, directory: Path) -> list[Path]:
    checkpoint, cfg = (
        load_checkpoint(model.path),
        json.loads((model.path / "config.json").read_text()),
    )
    extra = Entry(5, 0, "model.layers.0.self_attn.qkv_proj.weight_scale", torch.ones(1))
    return [
        write_rank_file(
            directory / f"model-rank-{r:03d}.tensors",
            [*rank_entries(checkpoint, cfg, rank=r, tp=2), extra],
        )
        for r in range(2)
    ]


@pytest.mark.parametrize(
    ("case", "tp", "reason", "words"),
    [
        ("moe", 4, reasons.RESHARD_UNSUPPORTED, "Qwen2MoeForCausalLM is not one preshard reshards"),
        ("quantized", 4, reasons.RESHARD_UNSUPPORTED, "the model is quantized"),
        ("tp3", 3, reasons.RESHARD_UNSUPPORTED, "cannot reshard to TP 3: the 4 query heads"),
        ("unknown tensor", 4, reasons.RESHARD_UNSUPPORTED, "not ones preshard knows"),
        ("no config", 4, reasons.RESHARD_UNSUPPORTED, "has no config.json"),
        ("same tp", 2, reasons.INVALID_ARGUMENTS, "already made for TP 2"),
        ("corrupt rank", 4, reasons.HASH_MISMATCH, "model-rank-001.tensors"),
        ("corrupt rank, format 1", 4, reasons.HASH_MISMATCH, "model-rank-001.tensors"),
        ("no manifest", 4, reasons.MANIFEST_MISSING, "there is no manifest.json"),
    ],
)
def test_what_cannot_be_resharded_is_refused_and_nothing_is_stored(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    model: TinyModel,
    prefix: str,
    tmp_path: Path,
    case: str,
    tp: int,
    reason: str,
    words: str,
) -> None:
    checkpoint, cfg = (
        load_checkpoint(model.path),
        json.loads((model.path / "config.json").read_text()),
    )
    ranks = write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=2)
    config: dict[str, Any] | None = None
    if case == "moe":
        config = cfg | {"architectures": ["Qwen2MoeForCausalLM"]}
    elif case == "quantized":
        config = cfg | {"quantization_config": {"quant_method": "fp8"}}
    elif case == "unknown tensor":
        ranks = unknown_tensor_files(model, tmp_path / "unknown")
    format_version: Literal[1, 2] = 1 if case.endswith("format 1") else 2
    source = store_set(
        s3_bucket, f"{prefix}/src", model, ranks, config=config, format_version=format_version
    )
    if case == "no config":
        body = json.loads(
            s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"{prefix}/src/{MANIFEST_NAME}")[
                "Body"
            ].read()
        )
        body["files"] = [f for f in body["files"] if f["name"] != "config.json"]
        s3_bucket.client.put_object(
            Bucket=s3_bucket.name,
            Key=f"{prefix}/src/{MANIFEST_NAME}",
            Body=json.dumps(body).encode(),
        )
    elif case.startswith("corrupt rank"):
        data = bytearray(ranks[1].read_bytes())
        data[-5] ^= 0xFF
        s3_bucket.client.put_object(
            Bucket=s3_bucket.name, Key=f"{prefix}/src/{ranks[1].name}", Body=bytes(data)
        )
    elif case == "no manifest":
        s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=f"{prefix}/src/{MANIFEST_NAME}")
    dest = f"s3://{s3_bucket.name}/{prefix}/out/"

    refused = run_cli(*reshard_args(source, dest, tp, tmp_path / "scratch"))

    assert refused.outcome.reason == reason, refused.outcome.message
    assert refused.code == exit_code(reason)
    assert words in refused.outcome.message
    assert s3_bucket.keys(f"{prefix}/out/") == []


@pytest.mark.parametrize(
    ("dest", "extra", "words"),
    [
        ("src", (), "overlap"),
        ("src/inner", (), "overlap"),
        ("out", ("--artifact-key", "other"), "must end with the artifact key other"),
        ("out", ("--artifact-key", "a/b"), "must be one path segment"),
    ],
)
def test_bad_destinations_are_refused(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    prefix: str,
    tmp_path: Path,
    dest: str,
    extra: tuple[str, ...],
    words: str,
) -> None:
    source = f"s3://{s3_bucket.name}/{prefix}/src/"

    refused = run_cli(
        *reshard_args(source, f"s3://{s3_bucket.name}/{prefix}/{dest}/", 2, tmp_path, *extra)
    )

    assert refused.outcome.reason == reasons.INVALID_ARGUMENTS
    assert words in refused.outcome.message


def test_reshard_needs_its_flags(run_cli: Cli, tmp_path: Path) -> None:
    missing = run_cli("reshard", "s3://bucket/a/b/", "--dest", "s3://bucket/a/c/")
    assert missing.outcome.reason == reasons.INVALID_ARGUMENTS
    assert "--to-tensor-parallel-size is required" in missing.outcome.message
    assert missing.outcome.command == "reshard"
