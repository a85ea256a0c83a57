"""The data-plane benchmarks at smoke size against the session's S3 server, so they cannot rot."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchmarks import load, serialize

from preshard_devenv.s3server import S3Bucket, S3Server

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, server: S3Server, bucket: S3Bucket, *args: str) -> str:
    done = subprocess.run(
        [
            sys.executable, "-m", module, "--size-gb", "0.02", "--repeats", "1",
            "--endpoint", server.endpoint, "--bucket", bucket.name, *args,
        ],
        cwd=ROOT,
        env={**os.environ, **server.env()},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert server.credentials.secret_access_key not in done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.s3
def test_a_smoke_run_of_making_shards_times_every_method(
    s3_server: S3Server, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    output, prefix = tmp_path / "serialize.json", f"bench-{secrets.token_hex(3)}"
    stdout = _run(
        "benchmarks.serialize", s3_server, s3_bucket,
        "--tp", "1,2", "--limit-settings", "2x8,4x16", "--prefix", prefix,
        "--scratch", str(tmp_path / "scratch"), "--output", str(output),
    )  # fmt: skip
    assert "Targets" in stdout

    document = json.loads(output.read_text())
    assert document["benchmark"] == "serialize"
    results = document["results"]
    assert results["model"]["bytes"] > 0.015e9
    runs = results["runs"]
    assert {(r["tensor_parallel_size"], r["method"], r["setting"]) for r in runs} == {
        (tp, method, setting)
        for tp in (1, 2)
        for method, setting in [
            ("preshard", None),
            ("boto3", None),
            ("crt", None),
            ("tensorizer", None),
            ("limit", "2x8MiB"),
            ("limit", "4x16MiB"),
        ]
    }
    for run in runs:
        assert run["upload_s"] > 0
        assert run["bytes"] > 0.015e9
        assert run["client_cpu_s"] is not None
        assert run["server_cpu_s"] is None  # not the benchmark's own server
        assert (run["engine_s"] > 0) == (run["method"] in ("preshard", "tensorizer"))
    methods = {(m["tensor_parallel_size"], m["method"]): m for m in results["methods"]}
    assert len(methods) == 10
    assert all(m["upload_s"]["min"] <= m["upload_s"]["median"] for m in methods.values())
    assert [r["tensor_parallel_size"] for r in results["ratios"]] == [1, 2]
    assert results["ratios"][0]["preshard_upload_over_limit"]["median"] > 0
    assert set(results["targets"]) == {
        "preshard_upload_within_limit",
        "preshard_upload_faster_than_boto3",
        "preshard_faster_than_tensorizer",
    }
    # Everything the benchmark wrote is gone: objects and scratch.
    assert s3_bucket.keys(f"{prefix}/") == []
    assert not (tmp_path / "scratch").exists()


@pytest.mark.slow
@pytest.mark.s3
def test_a_smoke_run_of_loading_shards_times_every_reader_count(
    s3_server: S3Server, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    output, prefix = tmp_path / "load.json", f"bench-{secrets.token_hex(3)}"
    stdout = _run(
        "benchmarks.load", s3_server, s3_bucket,
        "--readers", "1,2", "--prefix", prefix, "--prefetch-readers", "2",
        "--prefetch-dir", str(tmp_path / "memory"),
        "--scratch", str(tmp_path / "scratch"), "--output", str(output),
    )  # fmt: skip
    assert "speed / raw download" in stdout

    results = json.loads(output.read_text())["results"]
    assert 0.015e9 < results["shard"]["tensor_bytes"] <= 0.02e9
    assert results["shard"]["object_bytes"] > results["shard"]["tensor_bytes"]
    loads = {entry["load"]: entry for entry in results["loads"]}
    assert list(loads) == [
        "raw download",
        "tensorizer, num_readers=1",
        "curl, 2 ranges",
        "tensorizer, num_readers=2",
        "preshard download to memory",
        "boto3 download_file to memory",
        "CRT download to memory",
        "prefetch, then tensorizer from the file, num_readers=2",
        "tensorizer from a file in memory, num_readers=2",
        "safetensors, local disk",
        "safetensors, page cache",
    ]
    assert loads["raw download"]["speed_over_raw"]["median"] == 1.0
    assert loads["tensorizer, num_readers=1"]["speed_over_curl_same_streams"] is not None
    assert all(entry["gb_per_s"] > 0 for entry in loads.values())
    # The server was started elsewhere: this process's and curl's CPU only.
    cpu = loads["tensorizer, num_readers=2"]["cpu_s_per_gb"]
    assert cpu["here"] > 0
    assert cpu["children"] > 0
    assert cpu["server"] is None
    assert cpu["total"] is None
    assert loads["preshard download to memory"]["cpu_s_per_gb"]["children"] == 0
    assert results["recommended_num_readers"] in (1, 2)
    assert s3_bucket.keys(f"{prefix}/") == []
    assert not (tmp_path / "scratch").exists()
    assert list((tmp_path / "memory").iterdir()) == []


def _rounds(seconds: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    return [
        {"round": number, "load": name, "num_readers": None, "streams": None, "seconds": value}
        for name, by_round in seconds.items()
        for number, value in by_round.items()
    ]


def test_the_model_fills_the_size_with_whole_layers_and_splits_four_ways() -> None:
    shape = serialize.plan_model(2 * 10**9)
    assert (shape.hidden_size, shape.layers) == (2048, 8)
    assert 1.9e9 < shape.total_bytes() <= 2e9
    small = serialize.plan_model(20 * 10**6)
    assert 15e6 < small.total_bytes() <= 20e6
    assert small.layers >= 2
    for split in (small.hidden_size, small.intermediate_size, small.vocab):
        assert split % 4 == 0
    assert (small.kv_heads * small.head_dim) % 4 == 0


def test_limit_settings_parse_and_refuse_parts_under_five_mib() -> None:
    assert serialize.parse_limit_settings("4x64, 16x8") == [(4, 64), (16, 8)]
    with pytest.raises(argparse.ArgumentTypeError, match="THREADSxPART_MIB"):
        serialize.parse_limit_settings("4x4")


def test_the_limit_is_the_setting_with_the_fastest_median_and_ratios_are_paired() -> None:
    def row(method: str, number: int, upload: float, setting: str | None = None) -> dict[str, Any]:
        return {
            "tensor_parallel_size": 1,
            "round": number,
            "method": method,
            "setting": setting,
            "prepare_s": 0.0,
            "engine_s": 1.0 if method in ("preshard", "tensorizer") else 0.0,
            "upload_s": upload,
            "total_s": upload + (1.0 if method in ("preshard", "tensorizer") else 0.0),
            "client_cpu_s": 1.0,
            "server_cpu_s": None,
            "bytes": 10**9,
        }

    rows = [
        row("preshard", 1, 11.0), row("preshard", 2, 22.0),
        row("boto3", 1, 12.0), row("boto3", 2, 24.0),
        row("crt", 1, 11.0), row("crt", 2, 20.0),
        row("tensorizer", 1, 15.0), row("tensorizer", 2, 30.0),
        # 8x32 has the single fastest round; 4x64 the fastest median.
        row("limit", 1, 10.0, "4x64MiB"), row("limit", 2, 20.0, "4x64MiB"),
        row("limit", 1, 8.0, "8x32MiB"), row("limit", 2, 40.0, "8x32MiB"),
    ]  # fmt: skip
    summary = serialize.summarize(rows)
    assert [s["setting"] for s in summary["limit_settings"] if s["limit"]] == ["4x64MiB"]
    (ratios,) = summary["ratios"]
    assert ratios["preshard_upload_over_limit"] == {"median": 1.1, "min": 1.1, "max": 1.1}
    assert ratios["preshard_over_tensorizer"]["median"] == pytest.approx((12 / 16 + 23 / 31) / 2)
    assert ratios["preshard_upload_over_crt"] == {"median": 1.05, "min": 1.0, "max": 1.1}
    targets = summary["targets"]
    assert targets["preshard_upload_within_limit"]["by_tensor_parallel_size"] == {1: 1.1}
    assert not targets["preshard_upload_within_limit"]["met"]  # 1.1 > 1.05
    assert targets["preshard_upload_faster_than_boto3"]["met"]
    assert targets["preshard_faster_than_tensorizer"]["met"]
    limit = next(m for m in summary["methods"] if m["method"] == "limit")
    assert limit["setting"] == "4x64MiB"
    assert limit["client_cpu_s_per_gb"] == 1.0


def test_load_ratios_are_speeds_paired_within_rounds() -> None:
    rows = _rounds(
        {
            "raw download": {1: 2.0, 2: 4.0},
            "tensorizer, num_readers=1": {1: 4.0, 2: 4.0},
            "curl, 2 ranges": {1: 1.0, 2: 2.0},
            "tensorizer, num_readers=2": {1: 2.0, 2: 2.0},
        }
    )
    for row in rows:
        if row["load"].startswith("tensorizer"):
            row["num_readers"] = int(row["load"][-1])
    summary = {entry["load"]: entry for entry in load.summarize(rows, 2 * 10**9)}
    assert summary["raw download"]["gb_per_s"] == pytest.approx(2 / 3, abs=1e-3)
    one, two = summary["tensorizer, num_readers=1"], summary["tensorizer, num_readers=2"]
    assert one["speed_over_raw"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert one["speed_over_curl_same_streams"] == one["speed_over_raw"]
    assert two["speed_over_curl_same_streams"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert summary["curl, 2 ranges"]["speed_over_curl_same_streams"] is None
    assert load.recommend_readers(list(summary.values())) == 2
