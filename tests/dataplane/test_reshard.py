"""`preshard reshard` against vLLM itself: what it writes is what vLLM writes at the target TP.

vLLM's CPU build (the engine environment, `make engine-env`) serializes one tiny Llama at TP 1,
2 and 4 with `preshard serialize` and the real `VllmEngine`; `preshard reshard`, run as the
serializer image runs it, then turns each of those sets into each other TP size, and every
resharded rank file must hold vLLM's own tensors at that TP size: the same names in the same
order, shapes, dtypes and bytes (`torch.equal`), and in fact the same file, byte for byte.

The model's vocabulary is 500, not a multiple of 64, so vLLM pads it (to 512: 256 rows a rank
at TP 2, 128 at TP 4, zero rows at the end of the last rank); with 4 heads and 2 KV heads,
TP 4 replicates each KV head on two ranks. TP 4 on this machine's two cores binds two
workers to each core (`VLLM_CPU_OMP_THREADS_BIND=0|1|0|1`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
import torch

from preshard.devenv import engine
from preshard.devenv.s3server import S3Server
from preshard.layout import S3Location
from preshard.outcome import Outcome
from tests.support.commands import pod_env, run_preshard
from tests.support.models import TinyModel, load_rank_files, make_tiny_model, upload_model
from tests.support.s3 import S3Bucket

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(1800)]

TP_SIZES: Final = (1, 2, 4)
VOCAB: Final = 500
OMP_BIND: Final = {1: "0|1", 2: "0|1", 4: "0|1|0|1"}


@dataclass(frozen=True)
class StoredSet:
    """A shard set in S3, as its manifest describes it, and its rank files fetched here."""

    location: S3Location
    outcome: Outcome
    manifest: dict[str, object]
    rank_files: list[Path]

    def sha256(self) -> dict[str, str]:
        """Each rank file's sha256 as the manifest records it."""
        files = self.manifest["files"]
        assert isinstance(files, list)
        return {f["name"]: f["sha256"] for f in files if f["kind"] == "shard"}


def fetch(bucket: S3Bucket, location: S3Location, outcome: Outcome, directory: Path) -> StoredSet:
    """The manifest and rank files of a stored set."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(
        bucket.client.get_object(Bucket=bucket.name, Key=location.key("manifest.json"))[
            "Body"
        ].read()
    )
    paths = []
    for rank in range(int(manifest["tensorParallelSize"])):
        name = f"model-rank-{rank:03d}.tensors"
        bucket.client.download_file(bucket.name, location.key(name), str(directory / name))
        paths.append(directory / name)
    return StoredSet(location, outcome, manifest, paths)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    directory = Path(tmp_path_factory.mktemp("reshard-vllm")) / "model"
    return make_tiny_model(directory, **engine.TINY_LLAMA, vocab=VOCAB)


@pytest.fixture(scope="module")
def vllm_sets(
    s3_server: S3Server,
    s3_bucket: S3Bucket,
    model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[int, StoredSet]:
    """The tiny model serialized by vLLM at each TP size, as `preshard serialize` stores it."""
    work = tmp_path_factory.mktemp("vllm-sets")
    source = upload_model(model, s3_bucket.client, s3_bucket.name, "models/reshard")
    sets = {}
    for tp in TP_SIZES:
        key = f"vllm-tp{tp}"
        location = S3Location.parse(f"s3://{s3_bucket.name}/reshard/{key}/")
        env = {
            **pod_env(s3_server, work / f"home-{tp}"),
            **engine.serializer_image().env,
            "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND[tp],
        }
        outcome = run_preshard(
            engine.engine_bin() / "preshard",
            [
                "serialize",
                "--model",
                source,
                "--tensor-parallel-size",
                str(tp),
                "--dtype",
                "float32",
                "--max-model-len",
                "256",
                "--dest",
                location.uri,
                "--artifact-key",
                key,
                "--scratch-dir",
                str(work / f"scratch-{tp}"),
            ],
            env,
            work / f"serialize-{tp}.log",
            timeout=900,
        )
        assert outcome.vllm_version == "0.32.0"
        sets[tp] = fetch(s3_bucket, location, outcome, work / f"vllm-{tp}")
    return sets


@pytest.fixture(scope="module")
def resharded(
    s3_server: S3Server,
    s3_bucket: S3Bucket,
    vllm_sets: dict[int, StoredSet],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[int, int], StoredSet]:
    """Every vLLM set resharded to every other TP size, by `preshard reshard` in the serializer
    image's environment, then verified (`--deep`) by the tools image's."""
    work = tmp_path_factory.mktemp("resharded")
    tools = Path(sys.executable).with_name("preshard")
    made = {}
    for source_tp, target_tp in itertools.permutations(TP_SIZES, 2):
        name = f"from{source_tp}-to{target_tp}"
        location = S3Location.parse(f"s3://{s3_bucket.name}/reshard/{name}/")
        env = {**pod_env(s3_server, work / f"home-{name}"), **engine.serializer_image().env}
        outcome = run_preshard(
            engine.engine_bin() / "preshard",
            [
                "reshard",
                vllm_sets[source_tp].location.uri,
                "--to-tensor-parallel-size",
                str(target_tp),
                "--dest",
                location.uri,
                "--scratch-dir",
                str(work / f"scratch-{name}"),
            ],
            env,
            work / f"reshard-{name}.log",
            timeout=300,
        )
        run_preshard(
            tools,
            ["verify", location.uri, "--tensor-parallel-size", str(target_tp), "--deep"],
            {**pod_env(s3_server, work / "tools-home"), **engine.tools_env()},
            work / f"verify-{name}.log",
            timeout=120,
        )
        made[source_tp, target_tp] = fetch(s3_bucket, location, outcome, work / name)
    return made


PAIRS: Final = list(itertools.permutations(TP_SIZES, 2))


@pytest.mark.parametrize(("source_tp", "target_tp"), PAIRS)
def test_resharded_rank_files_hold_vllms_own_tensors(
    vllm_sets: dict[int, StoredSet],
    resharded: dict[tuple[int, int], StoredSet],
    source_tp: int,
    target_tp: int,
) -> None:
    mine = load_rank_files(resharded[source_tp, target_tp].rank_files)
    theirs = load_rank_files(vllm_sets[target_tp].rank_files)
    assert len(mine) == len(theirs) == target_tp
    for rank, (got, expected) in enumerate(zip(mine, theirs, strict=True)):
        assert list(got) == list(expected), f"rank {rank}: other tensor names or order"
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype, (rank, name)
            assert got[name].shape == tensor.shape, (rank, name)
            assert torch.equal(got[name], tensor), (rank, name)


@pytest.mark.parametrize(("source_tp", "target_tp"), PAIRS)
def test_resharded_rank_files_are_vllms_files_byte_for_byte(
    vllm_sets: dict[int, StoredSet],
    resharded: dict[tuple[int, int], StoredSet],
    source_tp: int,
    target_tp: int,
) -> None:
    made, own = resharded[source_tp, target_tp], vllm_sets[target_tp]
    assert made.sha256() == own.sha256()
    for path in made.rank_files:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == own.sha256()[path.name]


def test_vllms_layout_is_what_the_test_claims(vllm_sets: dict[int, StoredSet]) -> None:
    """The cases the test is meant to cover are really in vLLM's files."""
    tp2 = load_rank_files(vllm_sets[2].rank_files)
    tp4 = load_rank_files(vllm_sets[4].rank_files)
    embed = "model.embed_tokens.weight"
    assert tp2[1][embed].shape == (256, 128)
    assert not tp2[1][embed][VOCAB - 256 :].any(), "the padding rows are zero"
    assert tp2[1][embed][VOCAB - 256 - 1].any()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    # TP 4: one query head, one key head, one value head of 32 rows; ranks 0 and 1 share KV
    # head 0, ranks 2 and 3 KV head 1.
    assert tp4[0][qkv].shape == (96, 128)
    assert torch.equal(tp4[0][qkv][32:], tp4[1][qkv][32:])
    assert not torch.equal(tp4[0][qkv][32:], tp4[2][qkv][32:])
    assert ".vllm_tensorized_marker" in tp4[0]


def test_the_manifest_records_the_set_it_was_made_from(
    vllm_sets: dict[int, StoredSet], resharded: dict[tuple[int, int], StoredSet]
) -> None:
    made = resharded[1, 2]
    assert made.outcome.reason == "Resharded"
    assert made.manifest["reshardedFrom"] == {
        "uri": vllm_sets[1].location.uri,
        "artifactKey": "vllm-tp1",
        "tensorParallelSize": 1,
    }
    for field in ("model", "dtype", "vllmVersion", "encrypted"):
        assert made.manifest[field] == vllm_sets[2].manifest[field], field
    assert "reshardedFrom" not in vllm_sets[2].manifest
