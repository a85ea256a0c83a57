"""The GPU engine check's script runs here too: without a GPU it says so and succeeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_engine.py"


@pytest.mark.slow
def test_without_a_gpu_it_says_so_and_succeeds(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    if "no CUDA device" in done.stdout:
        assert list(tmp_path.iterdir()) == []
    else:
        assert '"identical": true' in done.stdout
