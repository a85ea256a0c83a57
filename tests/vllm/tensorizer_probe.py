"""Asks the installed vLLM what `preshard serialize` relies on; prints the answers as JSON.

Run as `python -m tests.vllm.tensorizer_probe WORKDIR` with `VLLM_TARGET_DEVICE=cpu`: vLLM's
configuration code works without a GPU, and importing it once in its own process keeps its
import time and global settings out of the test process.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from preshard.contract.engine_args import RESERVED_ENGINE_ARGS
from preshard.dataplane.engine import EngineRequest
from preshard.dataplane.errors import DataplaneError
from preshard.dataplane.vllm_engine import VllmEngine, build_engine_kwargs, build_tensorizer_kwargs
from preshard.dataplane.vllm_worker import SkipExtraArtifacts
from preshard_devenv.tinymodel import make_tiny_model

TP_SIZES = (1, 2, 4)


def _tree(function: Callable[..., Any]) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def key_generation_only_when_asked(function: Callable[..., Any]) -> bool:
    """Whether every `EncryptionParams.random()` in the function sits under an `if` on
    `generate_keyfile`."""
    tree = _tree(function)

    def randoms(node: ast.AST) -> int:
        return sum(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "random"
            for n in ast.walk(node)
        )

    guarded = sum(
        randoms(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "generate_keyfile" in _names(node.test)
    )
    return guarded > 0 and guarded == randoms(tree)


def builds_encryption_from_key_file(function: Callable[..., Any]) -> bool:
    """Whether the function opens `encryption_keyfile` and calls `EncryptionParams(key=...)`."""
    tree = _tree(function)
    reads_keyfile = any(
        isinstance(n, ast.Attribute) and n.attr == "encryption_keyfile" for n in ast.walk(tree)
    )
    keyed = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "EncryptionParams"
        and any(k.arg == "key" for k in n.keywords)
        for n in ast.walk(tree)
    )
    return reads_keyfile and keyed


def probe(workdir: Path) -> dict[str, Any]:
    """Every fact the contract test checks."""
    import tensorizer  # noqa: PLC0415
    import vllm  # noqa: PLC0415
    from tensorizer import DecryptionParams  # noqa: PLC0415
    from vllm.config import ParallelConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.model_executor.model_loader import tensorizer as vt  # noqa: PLC0415
    from vllm.v1.worker.gpu_worker import Worker  # noqa: PLC0415
    from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: PLC0415

    model = make_tiny_model(workdir / "model")
    key = os.urandom(32)
    keyfile = workdir / "key"
    keyfile.write_bytes(key)
    facts: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "tensorizer_version": tensorizer.__version__,
        "engine_versions": list(vars(VllmEngine().versions()).values()),
        "engine_arg_fields": sorted(f.name for f in dataclasses.fields(EngineArgs)),
        "reserved": sorted(RESERVED_ENGINE_ARGS),
    }
    for tp in TP_SIZES:
        request = EngineRequest(
            model=str(model.path),
            revision=None,
            tensor_parallel_size=tp,
            dtype="bfloat16",
            max_model_len=256,
            output_dir=workdir / "shards",
            extra_engine_args={"seed": 7, "gpu_memory_utilization": 0.85},
            encryption_keyfile=keyfile,
        )
        engine_args = EngineArgs(**build_engine_kwargs(request))
        model_config = engine_args.create_model_config()
        load_config = engine_args.create_load_config()
        config = vt.TensorizerConfig(**build_tensorizer_kwargs(request))
        config.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=tp))
        decryption = config._construct_tensorizer_args().deserialization_kwargs["encryption"]
        facts[f"tp{tp}"] = {
            "tensor_parallel_size": engine_args.tensor_parallel_size,
            "pipeline_parallel_size": engine_args.pipeline_parallel_size,
            "data_parallel_size": engine_args.data_parallel_size,
            "worker_extension_cls": engine_args.worker_extension_cls,
            "enforce_eager": engine_args.enforce_eager,
            "seed": engine_args.seed,
            "dtype": str(model_config.dtype),
            "max_model_len": model_config.max_model_len,
            "architecture": model_config.architectures[0],
            "load_format": str(load_config.load_format),
            "is_sharded": config._is_sharded,
            "tensorizer_dir": config.tensorizer_dir,
            "last_rank_uri": (config.tensorizer_uri or "") % (tp - 1),
            "decryption_from_key_file": isinstance(decryption, DecryptionParams)
            and decryption.key == key,
            "round_trips": vt.TensorizerConfig(**config.to_serializable()).tensorizer_uri
            == config.tensorizer_uri,
        }
    plain = vt.TensorizerConfig(tensorizer_uri=str(workdir / "model.tensors"))
    try:
        plain.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=2))
        facts["untemplated_uri_refused_for_tp2"] = False
    except ValueError:
        facts["untemplated_uri_refused_for_tp2"] = True
    facts["percent_d_is_sharded"] = vt.TensorizerConfig(
        tensorizer_uri=str(workdir / "model-rank-%d.tensors")
    )._is_sharded
    signature = inspect.signature(vt.tensorize_vllm_model)
    facts["signature"] = {
        name: (None if p.default is inspect.Parameter.empty else p.default)
        for name, p in signature.parameters.items()
    }
    facts["key_generated_only_when_asked"] = key_generation_only_when_asked(vt.tensorize_vllm_model)
    facts["ranks_read_the_key_file"] = builds_encryption_from_key_file(vt.serialize_vllm_model)
    facts["extra_artifacts_looked_up_as_module_global"] = (
        "serialize_extra_artifacts" in vt.serialize_vllm_model.__code__.co_names
        and vt.serialize_vllm_model.__globals__ is vars(vt)
    )
    facts["extension_conflicts"] = [
        name
        for name in dir(SkipExtraArtifacts)
        if not name.startswith("__") and hasattr(Worker, name)
    ]
    facts["hook_called_by_init_device"] = "init_worker_extension" in inspect.getsource(
        WorkerWrapperBase.init_device
    )
    original = vt.serialize_extra_artifacts
    SkipExtraArtifacts().init_worker_extension()
    replaced = vt.serialize_extra_artifacts
    facts["hook_replaces_extra_artifacts"] = (
        replaced is not original and cast(Callable[..., object], replaced)(None, "x") is None
    )
    vt.serialize_extra_artifacts = original
    try:
        VllmEngine().serialize(
            EngineRequest(
                model=str(model.path),
                revision=None,
                tensor_parallel_size=1,
                dtype="auto",
                max_model_len=None,
                output_dir=workdir / "shards",
                extra_engine_args={"no_such_field": 1},
            )
        )
        facts["unknown_engine_arg"] = None
    except DataplaneError as exc:
        facts["unknown_engine_arg"] = exc.reason
    return facts


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]))))
