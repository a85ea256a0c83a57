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

import itertools
import sys
from pathlib import Path
from typing import Final

import pytest
import torch

from preshard.builders.vllm_args import TensorizerLoad, rewrite_vllm_command
from preshard.contract.layout import tensorizer_uri
from preshard.dataplane.checksums import CRC64NVME, digest_of_file
from preshard_devenv import engine, procs
from preshard_devenv.s3server import S3Bucket, S3Server
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from tests.support.commands import pod_env, run_preshard
from tests.support.models import StoredSet, load_rank_files, upload_model
from tests.support.vllm_sets import OMP_BIND, reshard_set, serialize_with_vllm

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(1800)]

TP_SIZES: Final = (1, 2, 4)
VOCAB: Final = 500


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
    return {
        tp: serialize_with_vllm(s3_server, s3_bucket, source, tp, f"vllm-tp{tp}", work)
        for tp in TP_SIZES
    }


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
    return {
        (source, target): reshard_set(
            s3_server, s3_bucket, vllm_sets[source], target, f"from{source}-to{target}", work
        )
        for source, target in itertools.permutations(TP_SIZES, 2)
    }


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
    assert made.checksums() == own.checksums()
    for path in made.rank_files:
        assert digest_of_file(path, CRC64NVME) == own.checksums()[path.name]


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


SERVED: Final = "org/reshard"
PROMPTS: Final = ((5, 17, 33, 100), (300, 4, 77))


def test_vllm_serves_a_set_resharded_to_tp_4_as_the_original_model(
    model: TinyModel,
    resharded: dict[tuple[int, int], StoredSet],
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    """The TP 2 set resharded to TP 4 (KV heads replicated), fetched as the init container
    does and served with the command line preshard writes, answers as the original model."""
    made = resharded[2, 4]
    tools_env = {**pod_env(s3_server, tmp_path / "tools-home"), **engine.tools_env()}
    model_dir, tensorizer_dir = tmp_path / "model", tmp_path / "tensorizer"
    run_preshard(
        Path(sys.executable).with_name("preshard"),
        [
            "fetch-config",
            made.location.uri,
            str(model_dir),
            "--tensorizer-dir",
            str(tensorizer_dir),
        ],
        tools_env,
        tmp_path / "fetch-config.log",
        timeout=120,
    )
    original = engine.VllmServer.start(
        str(model.path), tmp_path / "baseline", served_model_name=SERVED
    )
    try:
        expected = {p: engine.complete(original.url(""), SERVED, p) for p in PROMPTS}
    finally:
        original.stop()
    port = procs.free_port()
    load = TensorizerLoad(
        model_dir=str(model_dir),
        tensor_parallel_size=4,
        tensorizer_uri=tensorizer_uri(made.location, 4),
        num_readers=8,
    )
    rewritten = rewrite_vllm_command(
        ["vllm", "serve"], [SERVED, "--port", str(port), *engine.VLLM_CPU_ARGS], load
    )
    env = {
        **pod_env(s3_server, tmp_path / "home"),
        **engine.VLLM_CPU_ENV,
        "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND[4],
        "PYTHONPATH": str(tensorizer_dir),
    }
    server = engine.VllmServer.launch(
        engine.engine_bin() / "vllm",
        rewritten.args or [],
        tmp_path,
        env=env,
        name="vllm-resharded-tp4",
        port=port,
    )
    try:
        for prompt, answer in expected.items():
            assert engine.complete(server.url(""), SERVED, prompt) == answer
    finally:
        server.stop()
