"""The merged `--model-loader-extra-config` JSON still works with vLLM's own code.

The user's tensorizer keys are merged into preshard's JSON (`builders/vllm_args.py`). Here vLLM
0.34 parses each merged command line with its `serve` parser, builds its tensorizer config from
it, and the keyword arguments it passes on bind to tensorizer's own functions; and the keys
preshard accepts are exactly the init fields of vLLM's `TensorizerConfig`.

vLLM is imported once, in one subprocess (`loader_config_probe`), for all questions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from preshard.builders.vllm_args import (
    TENSORIZER_CONFIG_KEYS,
    TensorizerLoad,
    rewrite_vllm_command,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = "/var/run/preshard/model"
LOAD = TensorizerLoad(
    model_dir=MODEL_DIR,
    tensor_parallel_size=2,
    tensorizer_uri="s3://models/shards/k/model-rank-%03d.tensors",
    num_readers=8,
    s3_endpoint="https://s3.eu-central-1.example.com",
)
# The user's settings, as written in a Deployment, and what the merged JSON must hold of them.
CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "plain-json": (
        [
            "--model-loader-extra-config",
            json.dumps(
                {
                    "num_readers": 2,
                    "vllm_tensorized": True,
                    "deserialization_kwargs": {"lazy_load": True, "verify_hash": True},
                    "stream_kwargs": {"force_http": False, "s3_endpoint": "https://other"},
                }
            ),
        ],
        {
            "vllm_tensorized": True,
            "deserialization_kwargs": {"lazy_load": True},
            "stream_kwargs": {"force_http": False},
        },
    ),
    "dotted-keys": (
        [
            "--model-loader-extra-config.deserialization_kwargs.plaid_mode",
            "false",
            "--model_loader_extra_config.serialization_kwargs={}",
        ],
        {"deserialization_kwargs": {"plaid_mode": False}, "serialization_kwargs": {}},
    ),
}


def argv(case: str) -> list[str]:
    """The rewritten command line's arguments after `vllm serve`."""
    written, _ = CASES[case]
    rewritten = rewrite_vllm_command(["vllm", "serve", "org/model", *written], None, LOAD)
    assert rewritten.command is not None
    return rewritten.command[2:]


@pytest.fixture(scope="module")
def answers() -> dict[str, Any]:
    """vLLM's answers to every question of this module, from one subprocess."""
    questions = {
        "parse": [{"id": case, "entrypoint": "serve", "argv": argv(case)} for case in CASES]
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.vllm.loader_config_probe"],
        input=json.dumps(questions),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"the vLLM probe failed:\n{result.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def test_the_keys_preshard_merges_are_the_ones_vllms_tensorizer_config_takes(
    answers: dict[str, Any],
) -> None:
    assert sorted(answers["fields"]) == sorted(TENSORIZER_CONFIG_KEYS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_merged_json_parses_and_reaches_tensorizer(answers: dict[str, Any], case: str) -> None:
    parsed = answers["parsed"][case]
    assert parsed["ok"], parsed["error"]
    assert parsed["load_format"] == "tensorizer"
    assert parsed["tensor_parallel_size"] == 2
    _, kept = CASES[case]
    flat = {
        "num_readers": 8,
        "s3_endpoint": "https://s3.eu-central-1.example.com",
        "tensorizer_uri": "s3://models/shards/k/model-rank-%03d.tensors",
        **kept,
    }
    assert parsed["model_loader_extra_config"] == {
        **flat,
        "tensorizer_config": {"tensorizer_dir": MODEL_DIR, **flat},
    }
    assert parsed["loader_ok"], parsed["loader_error"]
    # preshard's settings reach tensorizer, not the user's that the merge replaced.
    assert parsed["stream_kwargs"]["s3_endpoint"] == "https://s3.eu-central-1.example.com"
    assert parsed["deserialization_kwargs"]["num_readers"] == 8
    assert "verify_hash" not in parsed["deserialization_kwargs"]
