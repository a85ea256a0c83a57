"""The GPU load benchmark on its CPU path (the same code with `--device cpu`), so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import gpu_load

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_load.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_the_cpu_path_times_every_load(tmp_path: Path) -> None:
    files, output = tmp_path / "files", tmp_path / "gpu_load.json"
    done = _run(
        "--device", "cpu", "--size-gb", "0.02", "--repeats", "1",
        "--dir", str(files), "--output", str(output),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "ratio to ceiling" in done.stdout

    results = json.loads(output.read_text())["results"]
    assert results["device"]["name"] == "cpu"
    assert 0.015e9 < results["tensor_bytes"] <= 0.02e9
    assert results["files"]["tensorizer"]["bytes"] > results["tensor_bytes"]
    loads = {row["load"]: row for row in results["loads"]}
    assert set(loads) == {
        "CPU copy (ceiling)",
        "page-cache read, 1 thread",
        *(f"tensorizer num_readers={k}" for k in (1, 2, 4, 8, 16)),
        "safetensors load_file",
    }
    assert loads["CPU copy (ceiling)"]["ratio_to_ceiling"] == 1.0
    assert all(row["gb_per_s"] > 0 for row in loads.values())
    assert list(files.iterdir()) == []


@pytest.mark.slow
def test_without_a_gpu_it_says_so_and_succeeds(tmp_path: Path) -> None:
    output = tmp_path / "gpu_load.json"
    done = _run(
        "--size-gb", "0.02", "--repeats", "1", "--dir", str(tmp_path), "--output", str(output)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    if "skipped: no CUDA device" in done.stdout:
        assert not output.exists()
    else:
        assert json.loads(output.read_text())["results"]["device"]["device"] == "cuda"


def test_the_tensors_fill_the_size_with_whole_layers() -> None:
    size = 16 * 10**9
    shapes = gpu_load.plan_tensors(size)
    layer = gpu_load.nbytes(gpu_load.RANK_OF_70B.layer(0))
    assert size - layer < gpu_load.nbytes(shapes) <= size
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (1024, 8192)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (8192, 3584)
    layers = {name.split(".")[2] for name in shapes if name.startswith("model.layers.")}
    assert len(layers) == 72


def test_small_sizes_get_a_narrower_model_of_the_same_shape() -> None:
    shapes = gpu_load.plan_tensors(20 * 10**6)
    assert 15 * 10**6 < gpu_load.nbytes(shapes) <= 20 * 10**6
    assert "model.layers.1.self_attn.k_proj.weight" in shapes
    assert "lm_head.weight" in shapes
