"""Changing the TP size: `preshard reshard` against a full serialization, time and memory.

A synthetic Llama-shaped model (`--size-gb` of float32, the shapes of `benchmarks.serialize`)
is written as vLLM lays it out (`preshard_devenv.vllm_layout`) at every TP size the pairs name,
and stored under an S3 prefix with its config files and manifest, as `preshard serialize`
stores a set. For each pair N:M of `--pairs`, `--repeats` rounds run, each with:

- **reshard**: `preshard reshard` of the TP N set to TP M, as a separate process (the
  serializer image's command) with a fresh scratch directory: download with checksum checks,
  the reshard itself (the *reshard* phase, from its log), upload and manifest;
- **local**: the reshard alone (`reshard_rank_files`) on the TP N rank files on local disk, in
  a process of its own, which reports its `VmHWM` after its imports and after the reshard:
  the memory the reshard itself adds, without the transfer buffers of download and upload;
- **serialize**: `preshard serialize` of the model's safetensors at TP M with the CPU test
  engine, as a separate process: download, cut, upload. This is the data-plane part of a
  full serialization; a real one also starts vLLM on M GPUs and loads the model there, which
  the CPU engine does not (it reads the whole checkpoint into memory instead).

Each process's peak resident memory is its `VmHWM` (the kernel's high-water mark of the
program's own memory, imports included), read every 50 ms while it runs; **baseline** is a
process that only imports what reshard imports.

    python -m benchmarks.reshard [--size-gb 2] [--pairs 1:2,2:4,4:1] [--repeats 1]
        [--endpoint URL --bucket NAME] [--scratch DIR] [--output FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks import common
from benchmarks.serialize import make_model, plan_model, upload_directory
from preshard.contract.layout import MANIFEST_NAME
from preshard.contract.outcome import Outcome
from preshard.dataplane.checksums import CRC64NVME, digest_of_file
from preshard.dataplane.manifest import Manifest, ManifestFile
from preshard_devenv.cpuengine import SPEC as CPU_ENGINE
from preshard_devenv.cpuengine import load_checkpoint
from preshard_devenv.vllm_layout import write_vllm_set

NAME: Final = "reshard"
SCRATCH: Final = common.ROOT / "benchmarks" / "scratch" / NAME
PRESHARD: Final = Path(sys.executable).with_name("preshard")
_RESHARD_LINE: Final = re.compile(r"resharded \d+ tensors from TP \d+ to TP \d+ .* in ([\d.]+)s")


@dataclass(frozen=True)
class Run:
    """One timed process."""

    seconds: float
    peak_rss_bytes: int
    outcome: Outcome | None
    log: str


def run_process(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Run:
    """Run a process to its end; wall time, and the last `VmHWM` read before it ended.

    Not `wait4`'s maxrss: that keeps the high-water mark of the forked copy of this process
    from before the exec, which holds the benchmark's model.
    """
    termination = log.with_suffix(".outcome")
    termination.unlink(missing_ok=True)
    with log.open("wb") as output:
        started = time.monotonic()
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "PRESHARD_TERMINATION_LOG": str(termination)},
        )
        peak = 0
        while process.poll() is None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                peak = max(peak, common.process_usage(process.pid).peak_rss_bytes)
            time.sleep(0.05)
        seconds = time.monotonic() - started
    text = log.read_text()
    outcome = Outcome.from_message(termination.read_text()) if termination.exists() else None
    if process.returncode != 0:
        raise common.BenchmarkError(f"{argv[:2]} failed ({process.returncode}): {text[-2000:]}")
    return Run(seconds, peak, outcome, text)


def store_set(store: common.S3Store, prefix: str, model_dir: Path, rank_files: list[Path]) -> str:
    """Upload rank files, the config files and a manifest, as `preshard serialize` does."""
    client = store.client()
    entries = []
    config_names = [
        p.name for p in model_dir.iterdir() if p.is_file() and not p.name.endswith(".safetensors")
    ]
    config_names = [n for n in config_names if n != "model.safetensors.index.json"]
    files = [(p, "shard") for p in rank_files] + [(model_dir / n, "config") for n in config_names]
    for path, kind in files:
        client.upload_file(str(path), store.bucket, f"{prefix}/{path.name}")
        entries.append(
            ManifestFile(
                name=path.name,
                size=path.stat().st_size,
                crc64nvme=digest_of_file(path, CRC64NVME),
                kind="shard" if kind == "shard" else "config",
            )
        )
    manifest = Manifest(
        artifact_key=prefix.rsplit("/", 1)[-1],
        model="bench/synthetic",
        tensor_parallel_size=len(rank_files),
        dtype="float32",
        vllm_version="0.34.0",
        tensorizer_version="2.10.1",
        encrypted=False,
        created=common.utc_now(),
        files=tuple(entries),
    )
    client.put_object(
        Bucket=store.bucket, Key=f"{prefix}/{MANIFEST_NAME}", Body=manifest.to_json().encode()
    )
    return f"s3://{store.bucket}/{prefix}/"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """`1:2,2:4` -> [(1, 2), (2, 4)]."""
    pairs = []
    for item in text.split(","):
        source, _, target = item.partition(":")
        pairs.append((int(source), int(target)))
    return pairs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="model size (default 2)")
    parser.add_argument(
        "--pairs", type=parse_pairs, default=parse_pairs("1:2,2:4,4:1"), help="N:M,... "
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds per pair (default 1)")
    parser.add_argument(
        "--endpoint", help="an S3 endpoint to use (credentials from the environment)"
    )
    parser.add_argument("--bucket", help="an existing bucket on --endpoint")
    parser.add_argument("--scratch", type=Path, default=SCRATCH, help="local scratch directory")
    parser.add_argument(
        "--output", type=Path, default=common.RESULTS_DIR / f"{NAME}.json", help="result file"
    )
    parser.add_argument(
        "--local-reshard",
        nargs=3,
        metavar=("SOURCE_DIR", "TARGET_DIR", "M"),
        help=argparse.SUPPRESS,  # the child process of the local method
    )
    args = parser.parse_args(argv)
    if args.endpoint and not args.bucket:
        parser.error("--endpoint needs --bucket")
    return args


def local_reshard(source_dir: Path, target_dir: Path, target_tp: int) -> int:
    """The local method's child: reshard the rank files in `source_dir`, print what it used."""
    from preshard.dataplane.reshard_tensors import reshard_rank_files  # noqa: PLC0415
    from preshard.dataplane.tp_layout import model_shape  # noqa: PLC0415

    before = common.process_usage(os.getpid()).peak_rss_bytes
    shape = model_shape(json.loads((source_dir / "config.json").read_text()))
    sources = sorted(source_dir.glob("model-rank-*.tensors"))
    targets = [target_dir / f"model-rank-{r:03d}.tensors" for r in range(target_tp)]
    started = time.monotonic()
    reshard_rank_files(sources, targets, shape)
    seconds = time.monotonic() - started
    after = common.process_usage(os.getpid()).peak_rss_bytes
    print(json.dumps({"seconds": seconds, "peak_before": before, "peak_after": after}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Write the sets, time every pair, print the table and write the result file."""
    args = parse_args(argv)
    if args.local_reshard:
        source_dir, target_dir, target_tp = args.local_reshard
        return local_reshard(Path(source_dir), Path(target_dir), int(target_tp))
    started = common.utc_now()
    scratch: Path = args.scratch
    shutil.rmtree(scratch, ignore_errors=True)
    shape = plan_model(int(args.size_gb * common.GB))
    common.say(f"writing a {shape.total_bytes() / common.GB:.2f} GB model ({shape})")
    model = make_model(scratch / "model", shape)
    config = json.loads((model.path / "config.json").read_text())
    sizes = sorted({tp for pair in args.pairs for tp in pair})
    sets: dict[int, list[Path]] = {}
    checkpoint = load_checkpoint(model.path)
    for tp in sizes:
        common.say(f"writing the TP {tp} set in vLLM's layout")
        sets[tp] = write_vllm_set(checkpoint, config, scratch / f"tp{tp}", tp=tp)
        shutil.copy(model.path / "config.json", scratch / f"tp{tp}" / "config.json")
    del checkpoint
    set_bytes = {tp: sum(p.stat().st_size for p in files) for tp, files in sets.items()}
    rows: list[dict[str, Any]] = []
    with common.s3_store(args.endpoint, args.bucket) as store:
        prefix = f"bench-reshard/{secrets.token_hex(4)}"
        try:
            model_uri = upload_directory(store.client(), model.path, store.bucket, f"{prefix}/src")
            uris = {
                tp: store_set(store, f"{prefix}/tp{tp}", model.path, files)
                for tp, files in sets.items()
            }
            baseline = run_process(
                [
                    sys.executable,
                    "-c",
                    "import torch, tensorizer, boto3, preshard.dataplane.reshard, "
                    "preshard.dataplane.reshard_tensors",
                ],
                scratch / "baseline.log",
            )
            common.say(
                f"baseline (imports only): peak RSS {baseline.peak_rss_bytes / common.MIB:.0f} MiB"
            )
            for number in range(1, args.repeats + 1):
                for source_tp, target_tp in args.pairs:
                    rows.append(
                        reshard_round(store, scratch, prefix, uris, source_tp, target_tp, number)
                    )
                    rows.append(local_round(scratch, source_tp, target_tp, number))
                    rows.append(serialize_round(scratch, prefix, model_uri, target_tp, number))
                    store.reclaim_space()
        finally:
            store.delete_prefix(prefix)
            shutil.rmtree(scratch, ignore_errors=True)
    print_report(rows, baseline.peak_rss_bytes)
    path = common.write_result(
        NAME,
        {
            "options": {
                "size_gb": args.size_gb,
                "pairs": args.pairs,
                "repeats": args.repeats,
                "own_server": args.endpoint is None,
            },
            "model": {
                "bytes": shape.total_bytes(),
                "set_bytes": set_bytes,
                "shape": {
                    "hidden_size": shape.hidden_size,
                    "intermediate_size": shape.intermediate_size,
                    "layers": shape.layers,
                    "heads": shape.heads,
                    "kv_heads": shape.kv_heads,
                    "vocab": shape.vocab,
                },
                "largest_tensor_bytes": shape.vocab * shape.hidden_size * 4,
                "dtype": "float32",
            },
            "baseline_peak_rss_bytes": baseline.peak_rss_bytes,
            "runs": rows,
        },
        path=args.output,
        started=started,
    )
    common.say(f"wrote {path}")
    return 0


def reshard_round(
    store: common.S3Store,
    scratch: Path,
    prefix: str,
    uris: dict[int, str],
    source_tp: int,
    target_tp: int,
    number: int,
) -> dict[str, Any]:
    """One `preshard reshard` of the TP N set to TP M."""
    name = f"r{number}-{source_tp}to{target_tp}"
    work = scratch / name
    common.say(f"reshard TP {source_tp} -> {target_tp} (round {number})")
    run = run_process(
        [
            str(PRESHARD),
            "reshard",
            uris[source_tp],
            "--to-tensor-parallel-size",
            str(target_tp),
            "--dest",
            f"s3://{store.bucket}/{prefix}/{name}/",
            "--scratch-dir",
            str(work / "scratch"),
        ],
        scratch / f"{name}.log",
    )
    shutil.rmtree(work, ignore_errors=True)
    phase = _RESHARD_LINE.search(run.log)
    row = {
        "method": "reshard",
        "round": number,
        "source_tp": source_tp,
        "target_tp": target_tp,
        "total_s": round(run.seconds, 2),
        "reshard_s": float(phase.group(1)) if phase else None,
        "peak_rss_bytes": run.peak_rss_bytes,
        "total_bytes": run.outcome.total_bytes if run.outcome else None,
    }
    common.say(f"  {row}")
    return row


def local_round(scratch: Path, source_tp: int, target_tp: int, number: int) -> dict[str, Any]:
    """The reshard alone, on local files, in a process of its own."""
    name = f"l{number}-{source_tp}to{target_tp}"
    common.say(f"local reshard TP {source_tp} -> {target_tp} (round {number})")
    run = run_process(
        [
            sys.executable,
            "-m",
            "benchmarks.reshard",
            "--local-reshard",
            str(scratch / f"tp{source_tp}"),
            str(scratch / name),
            str(target_tp),
        ],
        scratch / f"{name}.log",
        env={"PYTHONPATH": str(common.ROOT)},
    )
    shutil.rmtree(scratch / name, ignore_errors=True)
    report = json.loads(run.log.strip().splitlines()[-1])
    row = {
        "method": "local",
        "round": number,
        "source_tp": source_tp,
        "target_tp": target_tp,
        "total_s": round(run.seconds, 2),
        "reshard_s": round(report["seconds"], 2),
        "peak_rss_bytes": report["peak_after"],
        "peak_rss_after_imports_bytes": report["peak_before"],
        "total_bytes": None,
    }
    common.say(f"  {row}")
    return row


def serialize_round(
    scratch: Path, prefix: str, model_uri: str, target_tp: int, number: int
) -> dict[str, Any]:
    """One `preshard serialize` at TP M with the CPU test engine."""
    name = f"s{number}-tp{target_tp}"
    work = scratch / name
    common.say(f"serialize TP {target_tp} (round {number})")
    bucket = model_uri.split("/")[2]
    run = run_process(
        [
            str(PRESHARD),
            "serialize",
            "--model",
            model_uri,
            "--tensor-parallel-size",
            str(target_tp),
            "--dtype",
            "auto",
            "--dest",
            f"s3://{bucket}/{prefix}/{name}/",
            "--artifact-key",
            name,
            "--scratch-dir",
            str(work / "scratch"),
        ],
        scratch / f"{name}.log",
        env={"PRESHARD_ENGINE": CPU_ENGINE, "PYTHONPATH": str(common.ROOT)},
    )
    shutil.rmtree(work, ignore_errors=True)
    row = {
        "method": "serialize",
        "round": number,
        "source_tp": None,
        "target_tp": target_tp,
        "total_s": round(run.seconds, 2),
        "reshard_s": None,
        "peak_rss_bytes": run.peak_rss_bytes,
        "total_bytes": run.outcome.total_bytes if run.outcome else None,
    }
    common.say(f"  {row}")
    return row


def print_report(rows: Sequence[dict[str, Any]], baseline: int) -> None:
    """The table of every run."""
    common.print_table(
        f"reshard vs serialize (baseline process, imports only: {baseline / common.MIB:.0f} MiB)",
        ["method", "TP", "round", "total s", "reshard s", "peak RSS MiB", "after imports MiB"],
        [
            [
                r["method"],
                f"{r['source_tp']} -> {r['target_tp']}" if r["source_tp"] else str(r["target_tp"]),
                r["round"],
                r["total_s"],
                r["reshard_s"],
                round(r["peak_rss_bytes"] / common.MIB),
                round(r["peak_rss_after_imports_bytes"] / common.MIB)
                if "peak_rss_after_imports_bytes" in r
                else None,
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
