"""Ask vLLM and tensorizer what they make of merged `--model-loader-extra-config` JSON.

Run as `python -m tests.vllm.loader_config_probe` with `VLLM_TARGET_DEVICE=cpu`, the questions
as JSON on stdin: `{"parse": [{"id", "entrypoint", "argv"}]}`. Each command line is parsed by
vLLM's own `serve` parser into a `LoadConfig` (as `vllm_cli_probe` does), then taken as far as
the tensorizer loader takes it before it reads a byte: `TensorizerLoader`'s check and
`TensorizerConfig` from the nested config, `TensorizerArgs`, and the keyword arguments vLLM
passes to tensorizer's `open_stream` and `TensorDeserializer`, bound to their signatures. The
answer also holds the init fields of `TensorizerConfig`: the keys the loader accepts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from tensorizer import TensorDeserializer
from tensorizer.stream_io import open_stream
from vllm.model_executor.model_loader.tensorizer import TensorizerConfig
from vllm.model_executor.model_loader.tensorizer_loader import validate_config

from tests.vllm.vllm_cli_probe import load_settings


def loader_answer(extra: dict[str, Any]) -> dict[str, Any]:
    """Whether the tensorizer loader accepts the config vLLM built, and why not."""
    try:
        validate_config(extra)
        config = TensorizerConfig(**extra["tensorizer_config"])
        arguments = config._construct_tensorizer_args()
        inspect.signature(open_stream).bind(
            config.tensorizer_uri, mode="rb", **arguments.stream_kwargs
        )
        inspect.signature(TensorDeserializer).bind(
            b"", dtype=None, device="cpu", **arguments.deserialization_kwargs
        )
    except Exception as error:  # noqa: BLE001 - any rejection is the answer
        return {"loader_ok": False, "loader_error": f"{type(error).__name__}: {error}"}
    return {
        "loader_ok": True,
        "stream_kwargs": {k: v for k, v in arguments.stream_kwargs.items() if v is not None},
        "deserialization_kwargs": {
            k: v for k, v in arguments.deserialization_kwargs.items() if v is not None
        },
    }


def main() -> None:
    """Answer the questions on stdin."""
    questions = json.load(sys.stdin)
    parsed: dict[str, Any] = {}
    for item in questions["parse"]:
        answer = load_settings(item["entrypoint"], item["argv"])
        if answer["ok"]:
            answer.update(loader_answer(answer["model_loader_extra_config"]))
        parsed[item["id"]] = answer
    fields = [f.name for f in dataclasses.fields(TensorizerConfig) if f.init]
    json.dump({"parsed": parsed, "fields": fields}, sys.stdout)


if __name__ == "__main__":
    main()
