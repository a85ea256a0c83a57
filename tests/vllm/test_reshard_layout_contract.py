"""vLLM's own layers cut tensors the way `preshard reshard` says they do.

`tests.vllm.layout_probe` builds vLLM's parallel linear and embedding layers rank by rank for
several attention and vocabulary shapes at every TP size from 1 to 8, loads numbered weights
through their own weight loaders, and checks `preshard.dataplane.tp_layout` against the
result: the TP sizes vLLM accepts, the split dimensions (`output_dim`, `input_dim`), the
per-rank shapes, replication, and every copy plan between two accepted TP sizes. It runs
against the vLLM of the serializer image (0.34.0, configuration code only) and, where the
engine environment is built, against its CPU build (0.32.0). The engine tier
(`tests/dataplane/test_reshard.py`) compares whole rank files with vLLM's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preshard_devenv.engine import ENGINE_VENV

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("python", "version"),
    [
        pytest.param(
            Path(sys.executable),
            "0.34.0",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(
                    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
                ),
            ],
            id="serializer-image-vllm",
        ),
        pytest.param(
            ENGINE_PYTHON,
            "0.32.0",
            marks=[
                pytest.mark.engine,
                pytest.mark.skipif(
                    not ENGINE_PYTHON.exists(), reason="the engine environment is not built"
                ),
            ],
            id="engine-cpu-vllm",
        ),
    ],
)
def test_vllms_layers_cut_tensors_as_the_layout_says(python: Path, version: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "tests.vllm.layout_probe"],
        cwd=ROOT,
        env=dict(os.environ) | {"VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["vllm"] == version
    assert answer["problems"] == []
    counts = answer["counts"]
    assert counts["tp_sizes"] == 48
    assert 0 < counts["refused"] < 48
    assert counts["plans"] > 0
    assert counts["tensors"] > 1000
