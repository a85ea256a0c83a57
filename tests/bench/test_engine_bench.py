"""The engine benchmark at smoke size: real vLLM serializes the tiny Llama, then the stock and the
patched server each start once and must answer alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_a_smoke_run_times_both_starts_to_the_first_completion(tmp_path: Path) -> None:
    output = tmp_path / "engine.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.engine", "--layers", "2", "--hidden-size", "128",
            "--vocab", "512", "--repeats", "1", "--work", str(tmp_path / "work"),
            "--output", str(output),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "to the first completion: patched / stock, S3 download" in done.stdout
    assert "AWS_SECRET_ACCESS_KEY" not in done.stdout + done.stderr

    results = json.loads(output.read_text())["results"]
    assert results["versions"]["vllm"]
    starts = ("stock, local disk", "stock, S3 download", "patched")
    assert {row["start"] for row in results["runs"]} == {*starts, "raw download"}
    # vLLM's own report of its weight load was found in every server's log (this small a model
    # may load in under 5 ms, which vLLM logs as 0.00 seconds).
    loads = [row["weights_s"] for row in results["runs"] if row["start"] in starts]
    assert all(seconds is not None and seconds >= 0 for seconds in loads), loads
    for kind in starts:
        start = results["starts"][kind]
        assert 0 < start["health_s"]["median"] <= start["first_completion_s"]["median"]
        # Only the pods with an init container have its time.
        assert ("init_s" in start) == (kind != "stock, local disk")
    for ratio in ("local_disk", "s3_download"):
        assert results[f"patched_pod_over_{ratio}"]["median"] > 0
    assert results["patched_load_speed_over_raw_download"]["median"] > 0
    assert not (tmp_path / "work").exists()
