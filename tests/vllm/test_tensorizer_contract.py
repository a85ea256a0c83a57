"""vLLM 0.34.0 accepts what the engine seam builds, and behaves the way `serialize` relies on.

The engine kwargs and tensorizer kwargs of `preshard.dataplane.vllm_engine` go into vLLM's own
`EngineArgs` and `TensorizerConfig`; the probe also checks how `tensorize_vllm_model` treats
`generate_keyfile`, how ranks read the key file, and that the worker extension can switch off
vLLM's per-rank upload of extra artifacts. vLLM is imported once, in one subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from preshard.dataplane.vllm_worker import EXTENSION_QUALNAME

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
TP_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The probe's answers (one vLLM import for the whole module)."""
    env = dict(os.environ) | {"VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.vllm.tensorizer_probe",
            str(tmp_path_factory.mktemp("probe")),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answers: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def test_pinned_versions(facts: dict[str, Any]) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (
        f"vllm[tensorizer]=={facts['vllm_version']}"
        in pyproject["project"]["optional-dependencies"]["vllm"]
    )
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(
        rf"^FROM vllm/vllm-openai:v{re.escape(facts['vllm_version'])}\b", dockerfile, re.M
    )
    assert facts["engine_versions"] == [facts["vllm_version"], facts["tensorizer_version"]]


def test_reserved_engine_args_are_real_fields(facts: dict[str, Any]) -> None:
    assert set(facts["reserved"]) <= set(facts["engine_arg_fields"])
    assert facts["unknown_engine_arg"] == "InvalidArguments"


@pytest.mark.parametrize("tp", TP_SIZES)
def test_engine_and_tensorizer_kwargs_are_accepted(facts: dict[str, Any], tp: int) -> None:
    answers = facts[f"tp{tp}"]

    assert answers["tensor_parallel_size"] == tp
    assert answers["pipeline_parallel_size"] == answers["data_parallel_size"] == 1
    assert answers["worker_extension_cls"] == EXTENSION_QUALNAME
    assert answers["enforce_eager"] is True
    assert answers["seed"] == 7
    assert answers["dtype"] == "torch.bfloat16"
    assert answers["max_model_len"] == 256
    assert answers["architecture"] == "LlamaForCausalLM"
    assert answers["load_format"] == "auto"
    assert answers["is_sharded"] is True
    assert answers["tensorizer_dir"].endswith("/shards")
    assert answers["last_rank_uri"].endswith(f"/shards/model-rank-{tp - 1:03d}.tensors")
    assert answers["decryption_from_key_file"] is True
    assert answers["round_trips"] is True


def test_sharding_needs_a_zero_padded_template(facts: dict[str, Any]) -> None:
    assert facts["untemplated_uri_refused_for_tp2"] is True
    assert facts["percent_d_is_sharded"] is False


def test_tensorize_vllm_model_keeps_the_users_key(facts: dict[str, Any]) -> None:
    assert facts["signature"] == {
        "engine_args": None,
        "tensorizer_config": None,
        "generate_keyfile": True,
    }
    assert facts["key_generated_only_when_asked"] is True
    assert facts["ranks_read_the_key_file"] is True


def test_the_worker_extension_switches_off_extra_artifacts(facts: dict[str, Any]) -> None:
    assert facts["extra_artifacts_looked_up_as_module_global"] is True
    assert facts["extension_conflicts"] == []
    assert facts["hook_called_by_init_device"] is True
    assert facts["hook_replaces_extra_artifacts"] is True
