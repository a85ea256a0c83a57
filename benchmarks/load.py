"""Loading shards: tensorizer streaming one rank file from S3, as a patched Deployment does.

One rank-sized tensorizer file (`--size-gb`, 2 by default: bf16 tensors shaped like
Llama-3-70B's as rank 0 of 8 holds them, made by `benchmarks/gpu_load.py`'s planner) is uploaded
to an S3 server. Then, in each of `--repeats` rounds, one after another:

- **raw download**: `curl -s -o /dev/null` of a presigned GET URL of the object: one
  connection, nothing parsed, nothing kept. Every ratio is taken against it.
- **curl, k ranges**: for each k > 1 of `--readers`, k curl processes each fetching one k-th of
  the object by byte range at the same time: what k connections give without tensorizer.
- **tensorizer, num_readers=k**: what vLLM's tensorizer loader runs in the patched container
  (`vllm/model_executor/model_loader/tensorizer.py`, `deserialize_tensorizer_model`):
  `open_stream(uri, mode="rb", s3_access_key_id=None, s3_secret_access_key=None,
  s3_endpoint=None)` (the flat extra-config JSON carries no keys, and no `s3_endpoint` for an
  http endpoint, so tensorizer takes the endpoint from `AWS_ENDPOINT_URL_S3` and boto3 the
  credentials from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, as in the pod), then
  `TensorDeserializer(stream, dtype=<model dtype>, device=..., verify_hash=None,
  encryption=None, num_readers=k)`, every tensor loaded (no lazy loading, vLLM's way); no
  buffer size is passed (tensorizer's default). Here the device is the CPU; on a node it is
  the rank's GPU.
- **downloads to memory**: the object into a file on a memory-backed directory
  (`--prefetch-dir`, `/dev/shm` by default, what an `emptyDir` with `medium: Memory` is), by
  preshard's own ranged GETs (`preshard.dataplane.download`, 16 connections of 32 MiB
  ranges), boto3's `download_file` (its defaults), and the AWS CRT's transfer client
  (`boto3[crt]`).
- **prefetch, then tensorizer from the file**: what an init container that prefetches the rank
  file would give: preshard's download into memory, then `TensorDeserializer` on the local
  file (`num_readers` of `--prefetch-readers`); the sum of both is the load's time.
- **tensorizer from a file in memory**: the second half of that alone (the download before it
  is not timed): what tensorizer costs with no network in the way.
- **safetensors, local disk**: the same tensors as a `.safetensors` file,
  `safetensors.torch.load_file` and one copy of every tensor (`load_file` maps the file; the
  copy makes it read the bytes, as a move to a GPU would): once from the disk (the file's
  pages evicted with `posix_fadvise(DONTNEED)` first) and once from the page cache.

Around every load the CPU time is read three ways: this process's (tensorizer, the downloads,
safetensors), its finished child processes' (the curl processes, curl's own and tensorizer's)
and, when the benchmark started the S3 server, the server's. On a machine with few cores, the
sum over the cores bounds how fast a load can be.

    python -m benchmarks.load [--size-gb 2] [--readers 1,2,4,8,16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import itertools
import os
import resource
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file
from tensorizer import TensorDeserializer
from tensorizer.stream_io import open_stream

from benchmarks import common, gpu_load
from preshard.contract.layout import S3Location
from preshard.dataplane.download import download_files
from preshard.dataplane.s3 import make_client

NAME: Final = "load"
SCRATCH: Final = common.ROOT / "benchmarks" / "scratch" / NAME
DEFAULT_READERS: Final = (1, 2, 4, 8, 16)
PRESIGN_SECONDS: Final = 3600
# A reader count counts as good as the best when its median time is within this much of it.
GOOD_ENOUGH: Final = 1.05
DOWNLOAD_CONNECTIONS: Final = 16
DEFAULT_PREFETCH_READERS: Final = 8

RAW: Final = "raw download"


@dataclass(frozen=True)
class Shard:
    """The rank file in S3 and the same tensors on local disk."""

    uri: str
    url: str
    """A presigned GET URL of the object."""
    object_bytes: int
    tensor_bytes: int
    tensors: int
    safetensors: Path

    @property
    def location(self) -> S3Location:
        """The prefix the rank file lies under."""
        return S3Location.parse(self.uri.rsplit("/", 1)[0])

    @property
    def name(self) -> str:
        """The rank file's name under its prefix."""
        return self.uri.rsplit("/", 1)[1]


def curl_ranges(url: str, size: int, streams: int) -> float:
    """Seconds to fetch the whole object with `streams` curl processes at once, each one byte
    range; fails unless every byte arrived."""
    bounds = [size * i // streams for i in range(streams + 1)]
    watch = common.Stopwatch()
    processes = []
    for begin, end in itertools.pairwise(bounds):
        byte_range = ["-r", f"{begin}-{end - 1}"] if streams > 1 else []
        argv = ["curl", "-s", "-f", "-o", os.devnull, "-w", "%{size_download}", *byte_range, url]
        processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
    received = 0
    failed = []
    for process in processes:
        output, _ = process.communicate()
        if process.returncode != 0:
            failed.append(process.returncode)
        else:
            received += int(float(output or 0))
    seconds = watch.elapsed
    if failed or received != size:
        raise common.BenchmarkError(
            f"curl fetched {received} of {size} bytes (exit codes of failures: {failed})"
        )
    return seconds


def tensorizer_load(uri: str, readers: int, tensor_bytes: int) -> float:
    """Seconds to stream every tensor from S3 to the CPU as vLLM's loader does."""
    watch = common.Stopwatch()
    with (
        open_stream(
            uri, mode="rb", s3_access_key_id=None, s3_secret_access_key=None, s3_endpoint=None
        ) as stream,
        TensorDeserializer(
            stream,
            dtype=gpu_load.DTYPE,
            device="cpu",
            verify_hash=None,
            encryption=None,
            num_readers=readers,
        ) as deserializer,
    ):
        loaded = int(deserializer.total_tensor_bytes)
    seconds = watch.elapsed
    if loaded != tensor_bytes:
        raise common.BenchmarkError(f"tensorizer loaded {loaded} of {tensor_bytes} tensor bytes")
    return seconds


def tensorizer_local(path: Path, readers: int, tensor_bytes: int) -> float:
    """Seconds to load every tensor of a local tensorizer file to the CPU."""
    watch = common.Stopwatch()
    with TensorDeserializer(
        str(path),
        dtype=gpu_load.DTYPE,
        device="cpu",
        verify_hash=None,
        encryption=None,
        num_readers=readers,
    ) as deserializer:
        loaded = int(deserializer.total_tensor_bytes)
    seconds = watch.elapsed
    if loaded != tensor_bytes:
        raise common.BenchmarkError(f"tensorizer loaded {loaded} of {tensor_bytes} tensor bytes")
    return seconds


class Downloads:
    """The object into a memory-backed directory, three ways; each removes what it wrote
    unless asked to keep it."""

    def __init__(self, shard: Shard, store: common.S3Store, directory: Path) -> None:
        self.shard = shard
        self.store = store
        self.directory = directory
        self.target = directory / shard.name

    def _timed(self, fetch: Callable[[], object], *, keep: bool = False) -> float:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.target.unlink(missing_ok=True)
        watch = common.Stopwatch()
        fetch()
        seconds = watch.elapsed
        size = self.target.stat().st_size
        if not keep:
            self.target.unlink()
        if size != self.shard.object_bytes:
            raise common.BenchmarkError(f"downloaded {size} of {self.shard.object_bytes} bytes")
        return seconds

    def preshard(self, *, keep: bool = False) -> float:
        """preshard's parallel ranged GETs."""
        client = make_client(
            endpoint=self.store.endpoint, region=None, max_connections=DOWNLOAD_CONNECTIONS
        )
        return self._timed(
            lambda: download_files(
                client,
                self.shard.location,
                {self.shard.name: self.shard.object_bytes},
                self.directory,
                concurrency=DOWNLOAD_CONNECTIONS,
            ),
            keep=keep,
        )

    def boto3(self) -> float:
        """boto3's `download_file` with its defaults."""
        location = self.shard.location
        client = self.store.client()
        return self._timed(
            lambda: client.download_file(
                location.bucket, location.key(self.shard.name), str(self.target)
            )
        )

    def crt(self) -> float:
        """The AWS CRT's transfer client."""
        location = self.shard.location

        def fetch() -> None:
            with common.crt_transfer_manager(self.store.endpoint) as manager:
                key = location.key(self.shard.name)
                manager.download(location.bucket, key, str(self.target)).result()

        return self._timed(fetch)

    def prefetch_then_load(self, readers: int) -> float:
        """An init container's prefetch, then tensorizer from the local file."""
        return self.preshard(keep=True) + self.load_prefetched(readers)

    def prefetch(self) -> None:
        """The object into memory, untimed, for `load_prefetched`."""
        self.preshard(keep=True)

    def load_prefetched(self, readers: int) -> float:
        """tensorizer from the file `prefetch` left in memory, which it then removes."""
        try:
            return tensorizer_local(self.target, readers, self.shard.tensor_bytes)
        finally:
            self.target.unlink(missing_ok=True)


def evict(path: Path) -> None:
    """Drop one file's pages from the page cache, so the next read comes from the disk."""
    with path.open("rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def safetensors_load(path: Path, tensor_bytes: int, *, cold: bool) -> float:
    """Seconds for `load_file` plus one copy of every tensor (from the disk when `cold`)."""
    if cold:
        evict(path)
    watch = common.Stopwatch()
    copies = {name: tensor.clone() for name, tensor in load_file(str(path), device="cpu").items()}
    seconds = watch.elapsed
    loaded = sum(t.numel() * t.element_size() for t in copies.values())
    if loaded != tensor_bytes:
        raise common.BenchmarkError(f"safetensors loaded {loaded} of {tensor_bytes} tensor bytes")
    return seconds


def make_shard(store: common.S3Store, directory: Path, size: int, prefix: str) -> Shard:
    """Write the rank file and its safetensors twin, upload the rank file, presign its URL."""
    shapes = gpu_load.plan_tensors(size)
    tensors = gpu_load.make_tensors(shapes, "cpu")
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    written = gpu_load.write_files(tensors, directory)
    del tensors
    tensorized: Path = written["tensorizer"]["path"]
    key = f"{prefix}/model-rank-000.tensors"
    client = store.client()
    client.upload_file(str(tensorized), store.bucket, key)
    object_bytes = tensorized.stat().st_size
    tensorized.unlink()
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": store.bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS
    )
    return Shard(
        uri=f"s3://{store.bucket}/{key}",
        url=url,
        object_bytes=object_bytes,
        tensor_bytes=tensor_bytes,
        tensors=len(shapes),
        safetensors=written["safetensors"]["path"],
    )


# The rounds -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One kind of load, timed once per round."""

    name: str
    readers: int | None
    streams: int | None
    run: Callable[[], float]
    prepare: Callable[[], object] | None = None
    """Run before the load, outside its time and CPU."""


def loads(
    shard: Shard, readers: Sequence[int], downloads: Downloads, prefetch_readers: int
) -> list[Load]:
    """Every load of a round, in the order they run."""
    plan = [Load(RAW, None, 1, lambda: curl_ranges(shard.url, shard.object_bytes, 1))]
    for k in readers:
        if k > 1:
            plan.append(
                Load(
                    f"curl, {k} ranges",
                    None,
                    k,
                    functools.partial(curl_ranges, shard.url, shard.object_bytes, k),
                )
            )
        plan.append(
            Load(
                f"tensorizer, num_readers={k}",
                k,
                None,
                functools.partial(tensorizer_load, shard.uri, k, shard.tensor_bytes),
            )
        )
    plan += [
        Load("preshard download to memory", None, DOWNLOAD_CONNECTIONS, downloads.preshard),
        Load("boto3 download_file to memory", None, None, downloads.boto3),
        Load("CRT download to memory", None, None, downloads.crt),
        Load(
            f"prefetch, then tensorizer from the file, num_readers={prefetch_readers}",
            None,
            DOWNLOAD_CONNECTIONS,
            functools.partial(downloads.prefetch_then_load, prefetch_readers),
        ),
        Load(
            f"tensorizer from a file in memory, num_readers={prefetch_readers}",
            None,
            None,
            functools.partial(downloads.load_prefetched, prefetch_readers),
            prepare=downloads.prefetch,
        ),
    ]
    plan.append(
        Load(
            "safetensors, local disk",
            None,
            None,
            lambda: safetensors_load(shard.safetensors, shard.tensor_bytes, cold=True),
        )
    )
    plan.append(
        Load(
            "safetensors, page cache",
            None,
            None,
            lambda: safetensors_load(shard.safetensors, shard.tensor_bytes, cold=False),
        )
    )
    return plan


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds so far: this process, its finished children, the S3 server (if known)."""

    here: float
    children: float
    server: float | None

    @classmethod
    def read(cls, store: common.S3Store) -> CpuClock:
        """The clocks now."""
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return cls(
            here=time.process_time(),
            children=children.ru_utime + children.ru_stime,
            server=store.server_cpu_seconds(),
        )

    def since(self, start: CpuClock) -> dict[str, float | None]:
        """CPU seconds spent since `start`, by whom."""
        server = None
        if self.server is not None and start.server is not None:
            server = round(self.server - start.server, 3)
        return {
            "here": round(self.here - start.here, 3),
            "children": round(self.children - start.children, 3),
            "server": server,
        }


def run_rounds(
    plan: Sequence[Load], repeats: int, tensor_bytes: int, store: common.S3Store
) -> list[dict[str, Any]]:
    """Every load once per round; one row per load and round."""
    rows = []
    for number in range(1, repeats + 1):
        for load in plan:
            if load.prepare is not None:
                load.prepare()
            cpu = CpuClock.read(store)
            seconds = load.run()
            # A curl process tensorizer let go of is reaped when its Popen is collected: now,
            # so that its CPU counts for this load, not a later one.
            gc.collect()
            spent = CpuClock.read(store).since(cpu)
            rate = tensor_bytes / seconds / common.GB
            common.say(f"round {number}: {load.name}: {seconds:.2f}s, {rate:.2f} GB/s")
            rows.append(
                {
                    "round": number,
                    "load": load.name,
                    "num_readers": load.readers,
                    "streams": load.streams,
                    "seconds": round(seconds, 4),
                    "cpu_s": spent,
                }
            )
    return rows


def summarize(rows: Sequence[dict[str, Any]], tensor_bytes: int) -> list[dict[str, Any]]:
    """Per load: median and range of the seconds, GB/s at the median, and the ratios of its
    speed to the raw download's (and to curl with as many ranges), paired within rounds."""
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["load"]] = row["seconds"]
    summary = []
    names = list(dict.fromkeys(row["load"] for row in rows))
    for name in names:
        first = next(row for row in rows if row["load"] == name)
        times = [seconds[name] for seconds in by_round.values()]
        spread = common.spread(times)
        same_streams = _same_streams(first)
        entry: dict[str, Any] = {
            "load": name,
            "num_readers": first["num_readers"],
            "streams": first["streams"],
            "seconds": spread,
            "gb_per_s": round(tensor_bytes / spread["median"] / common.GB, 3),
            "speed_over_raw": common.spread([s[RAW] / s[name] for s in by_round.values()]),
            "speed_over_curl_same_streams": (
                common.spread([s[same_streams] / s[name] for s in by_round.values()])
                if same_streams
                else None
            ),
            "cpu_s_per_gb": _cpu_per_gb([row for row in rows if row["load"] == name], tensor_bytes),
        }
        summary.append(entry)
    return summary


def _cpu_per_gb(rows: Sequence[dict[str, Any]], tensor_bytes: int) -> dict[str, float | None]:
    """Median CPU seconds per GB loaded, by whom, and their sum (None without the server's)."""
    gigabytes = tensor_bytes / common.GB
    spent: dict[str, float | None] = {}
    for whom in ("here", "children", "server"):
        values = [row["cpu_s"][whom] for row in rows if row.get("cpu_s")]
        known = [value for value in values if value is not None]
        spent[whom] = (
            round(common.spread(known)["median"] / gigabytes, 3)
            if known and len(known) == len(values)
            else None
        )
    parts = [spent["here"], spent["children"], spent["server"]]
    spent["total"] = None if None in parts else round(sum(p for p in parts if p is not None), 3)
    return spent


def _same_streams(row: dict[str, Any]) -> str | None:
    readers = row["num_readers"]
    if readers is None:
        return None
    return RAW if readers == 1 else f"curl, {readers} ranges"


def recommend_readers(summary: Sequence[dict[str, Any]]) -> int | None:
    """The fewest tensorizer readers whose median time is within 5 % of the fastest."""
    tensorizer = [entry for entry in summary if entry["num_readers"] is not None]
    if not tensorizer:
        return None
    fastest = min(entry["seconds"]["median"] for entry in tensorizer)
    good = [e for e in tensorizer if e["seconds"]["median"] <= fastest * GOOD_ENOUGH]
    return int(min(entry["num_readers"] for entry in good))


def print_report(summary: Sequence[dict[str, Any]], shard: Shard, repeats: int) -> None:
    """The table of every load."""

    def ratio(values: dict[str, float] | None) -> str | None:
        if values is None:
            return None
        return f"{values['median']:.2f} ({values['min']:.2f}-{values['max']:.2f})"

    common.print_table(
        f"Loading one {shard.tensor_bytes / common.GB:.2f} GB rank file ({shard.tensors} "
        f"tensors): median of {repeats} rounds; speed ratios median (smallest-largest); CPU "
        "seconds per GB: this process, its curl processes, the S3 server",
        [
            "load",
            "seconds",
            "GB/s",
            "speed / raw download",
            "speed / curl, same streams",
            "CPU here",
            "CPU curl",
            "CPU server",
            "CPU total",
        ],
        [
            [
                entry["load"],
                entry["seconds"]["median"],
                entry["gb_per_s"],
                ratio(entry["speed_over_raw"]),
                ratio(entry["speed_over_curl_same_streams"]),
                entry["cpu_s_per_gb"]["here"],
                entry["cpu_s_per_gb"]["children"],
                entry["cpu_s_per_gb"]["server"],
                entry["cpu_s_per_gb"]["total"],
            ]
            for entry in summary
        ],
    )


# The command line -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.load",
        description="Stream one rank file from S3 with tensorizer at several num_readers and "
        "compare with a raw download of the same object.",
    )
    parser.add_argument(
        "--size-gb", type=float, default=2.0, help="rank file size in GB (default: %(default)s)"
    )
    parser.add_argument(
        "--readers",
        type=lambda text: [int(part) for part in text.split(",") if part.strip()],
        default=list(DEFAULT_READERS),
        help="tensorizer num_readers values (default: 1,2,4,8,16)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of every load (default: %(default)s)"
    )
    parser.add_argument(
        "--prefetch-dir",
        type=Path,
        default=Path("/dev/shm"),  # noqa: S108 - memory-backed on purpose; a fresh subdirectory
        help="memory-backed directory the downloads write to (default: %(default)s)",
    )
    parser.add_argument(
        "--prefetch-readers",
        type=int,
        default=DEFAULT_PREFETCH_READERS,
        help="num_readers of tensorizer on the prefetched file (default: %(default)s)",
    )
    parser.add_argument(
        "--endpoint",
        help="use this S3 server (credentials from the environment) instead of starting one",
    )
    parser.add_argument("--bucket", help="the bucket (required with --endpoint)")
    parser.add_argument("--prefix", default="bench-load", help="key prefix of the rank file")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=SCRATCH,
        help="local directory for the safetensors file (default: benchmarks/scratch/load)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=common.RESULTS_DIR / f"{NAME}.json",
        help="result file (default: benchmarks/results/load.json)",
    )
    args = parser.parse_args(argv)
    if args.endpoint and not args.bucket:
        parser.error("--endpoint needs --bucket")
    if args.repeats < 1 or not args.readers or min(args.readers) < 1:
        parser.error("--repeats and every --readers value must be at least 1")
    if shutil.which("curl") is None:
        parser.error("curl is needed (tensorizer streams S3 objects with it)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Make and upload the rank file, time every load, print the table, write the result."""
    args = parse_args(argv)
    started = common.utc_now()
    scratch: Path = args.scratch
    with common.s3_store(args.endpoint, args.bucket) as store:
        prefix = f"{args.prefix.strip('/')}/{secrets.token_hex(4)}"
        memory = args.prefetch_dir / f"preshard-bench-load-{secrets.token_hex(4)}"
        try:
            common.say(f"writing and uploading a {args.size_gb:g} GB rank file")
            shard = make_shard(store, scratch, int(args.size_gb * common.GB), prefix)
            downloads = Downloads(shard, store, memory)
            plan = loads(shard, args.readers, downloads, args.prefetch_readers)
            rows = run_rounds(plan, args.repeats, shard.tensor_bytes, store)
        finally:
            store.delete_prefix(prefix)
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(memory, ignore_errors=True)
    summary = summarize(rows, shard.tensor_bytes)
    print_report(summary, shard, args.repeats)
    recommended = recommend_readers(summary)
    print(f"\nfewest num_readers within {GOOD_ENOUGH - 1:.0%} of the fastest: {recommended}")
    path = common.write_result(
        NAME,
        {
            "options": {
                "size_gb": args.size_gb,
                "readers": args.readers,
                "repeats": args.repeats,
                "prefetch_readers": args.prefetch_readers,
                "own_server": args.endpoint is None,
            },
            "shard": {
                "tensors": shard.tensors,
                "tensor_bytes": shard.tensor_bytes,
                "object_bytes": shard.object_bytes,
                "dtype": str(gpu_load.DTYPE).removeprefix("torch."),
            },
            "versions": {
                "torch": torch.__version__,
                "tensorizer": importlib.metadata.version("tensorizer"),
                "safetensors": importlib.metadata.version("safetensors"),
                "curl": _curl_version(),
            },
            "runs": rows,
            "loads": summary,
            "recommended_num_readers": recommended,
        },
        path=args.output,
        started=started,
    )
    print(f"results written to {path}")
    return 0


def _curl_version() -> str | None:
    try:
        done = subprocess.run(
            ["curl", "--version"], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.split("\n", 1)[0].strip() or None


if __name__ == "__main__":
    sys.exit(main())
