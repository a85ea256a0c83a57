"""The reshard benchmark at smoke size against the session's S3 server, so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preshard_devenv.s3server import S3Bucket, S3Server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.s3
def test_a_smoke_run_of_resharding_times_every_method(
    s3_server: S3Server, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    output = tmp_path / "reshard.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.reshard", "--size-gb", "0.02",
            "--pairs", "1:2,2:1", "--endpoint", s3_server.endpoint, "--bucket", s3_bucket.name,
            "--scratch", str(tmp_path / "scratch"), "--output", str(output),
        ],
        cwd=ROOT,
        env={**os.environ, **s3_server.env()},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert s3_server.credentials.secret_access_key not in done.stdout + done.stderr
    assert "reshard vs serialize" in done.stdout

    document = json.loads(output.read_text())
    assert document["benchmark"] == "reshard"
    runs = document["results"]["runs"]
    assert [(r["method"], r["source_tp"], r["target_tp"]) for r in runs] == [
        ("reshard", 1, 2),
        ("local", 1, 2),
        ("serialize", None, 2),
        ("reshard", 2, 1),
        ("local", 2, 1),
        ("serialize", None, 1),
    ]
    for run in runs:
        assert run["total_s"] > 0
        assert run["peak_rss_bytes"] > 0
        assert (run["reshard_s"] is not None) == (run["method"] != "serialize")
    assert document["results"]["baseline_peak_rss_bytes"] > 0
