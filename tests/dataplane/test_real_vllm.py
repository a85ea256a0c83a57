"""`preshard serialize` with the real `VllmEngine`, then `verify`, `fetch-config` and `vllm serve`
with the command line preshard's rewriter writes, without a cluster.

The model has tied word embeddings (the cluster's engine test serves an untied one), and is
serialized at TP 2 by vLLM's own `tensorize_vllm_model` in the engine environment (vLLM's CPU
build, `make engine-env`). The rank files must be vLLM's layout (fused `qkv_proj` and
`gate_up_proj`, halved by rank, nothing empty), and `vllm serve` of the shard set must answer
as vLLM serving the original safetensors does. The stock vLLM image (no tensorizer) fails to
load the same set unless the tensorizer that `fetch-config` hands over is on its path. No log,
vLLM's or the data plane's, carries the S3 secret key.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
import torch
from tensorizer import TensorDeserializer

from preshard.builders.vllm_args import TensorizerLoad, rewrite_vllm_command
from preshard.contract.layout import S3Location, tensorizer_uri
from preshard.contract.outcome import Outcome
from preshard_devenv import engine, procs
from preshard_devenv.s3server import S3Bucket, S3Server
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from preshard_devenv.vllm_cpu import preshard_vllm_cpu_shims as shims
from tests.support.commands import pod_env, run_preshard
from tests.support.models import upload_model

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.engine]

SERVED: Final = "org/tied"
TP: Final = 2
KEY: Final = "realvllmtied0000000"
PROMPTS: Final = ((5, 17, 33, 100), (300, 4, 77))


@dataclass(frozen=True)
class ShardSet:
    """The set vLLM wrote, where it is, and the config directory `fetch-config` filled."""

    location: S3Location
    serialized: Outcome
    model_dir: Path
    tensorizer_dir: Path
    logs: tuple[Path, ...]
    """What vLLM and the data plane printed while making and checking the set."""


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    directory = Path(tmp_path_factory.mktemp("tied")) / "model"
    return make_tiny_model(directory, **engine.TINY_LLAMA, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def baseline(
    tied_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, ...], engine.Completion]:
    """What vLLM answers serving the original safetensors directory (TP 1)."""
    server = engine.VllmServer.start(
        str(tied_model.path), tmp_path_factory.mktemp("baseline"), served_model_name=SERVED
    )
    try:
        return {prompt: engine.complete(server.url(""), SERVED, prompt) for prompt in PROMPTS}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shard_set(
    s3_server: S3Server,
    s3_bucket: S3Bucket,
    tied_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> ShardSet:
    """Serialized by vLLM at TP 2, verified (`--deep`) and fetched as the init container does."""
    work = tmp_path_factory.mktemp("real-vllm")
    serialize_log, verify_log, fetch_log = (
        work / f"{name}.log" for name in ("serialize", "verify", "fetch-config")
    )
    source = upload_model(tied_model, s3_bucket.client, s3_bucket.name, "models/tied")
    location = S3Location.parse(f"s3://{s3_bucket.name}/real-vllm/{KEY}/")
    serializer_env = {
        **pod_env(s3_server, work / "serializer-home"),
        **engine.serializer_image().env,
    }
    serialized = run_preshard(
        engine.engine_bin() / "preshard",
        [
            "serialize",
            "--model",
            source,
            "--tensor-parallel-size",
            str(TP),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--dest",
            location.uri,
            "--artifact-key",
            KEY,
            "--scratch-dir",
            str(work / "scratch"),
        ],
        serializer_env,
        serialize_log,
        timeout=900,
    )
    preshard = Path(sys.executable).with_name("preshard")  # the tools image: this virtualenv
    tools_env = {**pod_env(s3_server, work / "tools-home"), **engine.tools_env()}
    run_preshard(
        preshard,
        ["verify", location.uri, "--tensor-parallel-size", str(TP), "--deep"],
        tools_env,
        verify_log,
        timeout=120,
    )
    model_dir, tensorizer_dir = work / "model", work / "tensorizer"
    run_preshard(
        preshard,
        ["fetch-config", location.uri, str(model_dir), "--tensorizer-dir", str(tensorizer_dir)],
        tools_env,
        fetch_log,
        timeout=120,
    )
    logs = (serialize_log, verify_log, fetch_log)
    return ShardSet(location, serialized, model_dir, tensorizer_dir, logs)


def patched_args(shard_set: ShardSet, port: int) -> list[str]:
    """`vllm serve`'s args as preshard rewrites a user's `vllm serve org/tied --port N ...`."""
    load = TensorizerLoad(
        model_dir=str(shard_set.model_dir),
        tensor_parallel_size=TP,
        tensorizer_uri=tensorizer_uri(shard_set.location, TP),
        num_readers=8,
    )
    rewritten = rewrite_vllm_command(
        ["vllm", "serve"], [SERVED, "--port", str(port), *engine.VLLM_CPU_ARGS], load
    )
    assert rewritten.command == ["vllm", "serve"]
    return rewritten.args or []


def test_vllm_writes_its_own_layout(
    shard_set: ShardSet, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    assert shard_set.serialized.vllm_version == "0.32.0"
    assert shard_set.serialized.tensorizer_version == "2.10.1"
    ranks = []
    for rank in range(TP):
        local = tmp_path / f"rank-{rank}.tensors"
        s3_bucket.client.download_file(
            s3_bucket.name, shard_set.location.key(f"model-rank-{rank:03d}.tensors"), str(local)
        )
        with TensorDeserializer(str(local), device="cpu") as tensors:
            ranks.append({name: tensor.clone() for name, tensor in tensors.items()})
    names = set(ranks[0])
    assert names == set(ranks[1])
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    # Tied embeddings: vLLM's LM head is the embedding, and the state dict names both.
    for tensors_of_rank in ranks:
        assert torch.equal(
            tensors_of_rank["lm_head.weight"], tensors_of_rank["model.embed_tokens.weight"]
        )
    empty = sorted(n for n, t in ranks[0].items() if t.numel() == 0 and not n.startswith("."))
    assert not empty, f"vLLM wrote empty tensors: {empty}"
    # hidden 128, 4 heads and 2 KV heads of 32: per rank 2 query + 1 key + 1 value heads.
    assert ranks[0]["model.layers.0.self_attn.qkv_proj.weight"].shape == (128, 128)
    assert not torch.equal(
        ranks[0]["model.layers.0.self_attn.qkv_proj.weight"],
        ranks[1]["model.layers.0.self_attn.qkv_proj.weight"],
    )


def test_vllm_serves_the_patched_command_line_as_the_original_model(
    shard_set: ShardSet,
    baseline: dict[tuple[int, ...], engine.Completion],
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    port = procs.free_port()
    env = {
        **pod_env(s3_server, tmp_path / "home"),
        **engine.VLLM_CPU_ENV,
        "PYTHONPATH": str(shard_set.tensorizer_dir),
    }
    server = engine.VllmServer.launch(
        engine.engine_bin() / "vllm",
        patched_args(shard_set, port),
        tmp_path,
        env=env,
        name="vllm-patched",
        port=port,
    )
    try:
        for prompt, expected in baseline.items():
            assert engine.complete(server.url(""), SERVED, prompt) == expected
    finally:
        server.stop()
    # vLLM logs its non-default args, the tensorizer config among them, whose own fields could
    # carry S3 keys: the key reaches tensorizer through the pod's environment only.
    assert s3_server.credentials.secret_access_key not in server.process.log_path.read_text()


def test_no_data_plane_log_carries_the_secret_key(shard_set: ShardSet, s3_server: S3Server) -> None:
    for log in shard_set.logs:
        text = log.read_text(errors="replace")
        assert text, log.name
        assert s3_server.credentials.secret_access_key not in text, log.name


def test_the_stock_image_cannot_load_the_set_without_the_bundled_tensorizer(
    shard_set: ShardSet, s3_server: S3Server, tmp_path: Path
) -> None:
    env = {**pod_env(s3_server, tmp_path / "home"), **engine.VLLM_CPU_ENV}
    argv = [
        str(engine.engine_bin() / "vllm"),
        "serve",
        *patched_args(shard_set, procs.free_port()),
    ]
    process = procs.start("vllm-stock", argv, tmp_path, env=env)
    try:
        process.popen.wait(timeout=engine.HEALTH_TIMEOUT)
    finally:
        process.stop()
    assert process.popen.returncode != 0
    assert "No module named 'tensorizer'" in process.log_path.read_text()


def test_vllm_cpu_writes_empty_weights_without_its_fix(
    shard_set: ShardSet,
    s3_server: S3Server,
    s3_bucket: S3Bucket,
    tied_model: TinyModel,
    tmp_path: Path,
) -> None:
    """Why `keep-linear-weights` exists, and why only loading a set proves it: without it the
    CPU build writes `(0,)`-shaped linear weights, exits 0, and the set verifies."""
    source = f"s3://{s3_bucket.name}/models/tied/"  # uploaded for `shard_set`
    location = S3Location.parse(f"s3://{s3_bucket.name}/real-vllm/unfixed/")
    others = [name for name in shims.NAMES if name != "keep-linear-weights"]
    env = {
        **pod_env(s3_server, tmp_path / "home"),
        **engine.serializer_image().env,
        shims.ENV: ",".join(others),
    }
    run_preshard(
        engine.engine_bin() / "preshard",
        [
            "serialize",
            *("--model", source, "--tensor-parallel-size", "1", "--dtype", "float32"),
            *("--max-model-len", "256", "--dest", location.uri, "--artifact-key", "unfixed"),
            *("--scratch-dir", str(tmp_path / "scratch")),
        ],
        env,
        tmp_path / "serialize.log",
        timeout=900,
    )
    local = tmp_path / "rank-0.tensors"
    s3_bucket.client.download_file(
        s3_bucket.name, location.key("model-rank-000.tensors"), str(local)
    )
    with TensorDeserializer(str(local), device="cpu") as tensors:
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (0,)
    assert shapes["model.layers.0.input_layernorm.weight"] == (128,)


def test_the_manifest_records_what_vllm_wrote(shard_set: ShardSet, s3_bucket: S3Bucket) -> None:
    body = s3_bucket.client.get_object(
        Bucket=s3_bucket.name, Key=shard_set.location.key("manifest.json")
    )["Body"].read()
    manifest = json.loads(body)
    assert manifest["tensorParallelSize"] == TP
    assert manifest["vllmVersion"] == "0.32.0"
