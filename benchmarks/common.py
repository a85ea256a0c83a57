"""What every benchmark shares: timing, process usage, tables and result files.

The machines that run these benchmarks are shared and noisy, so each benchmark measures its
baselines in the same run and reports ratios to them; the result file records the machine, its
load before and after, and the commit, so two runs can be compared with care.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import boto3

from preshard_devenv.s3server import S3Server, create_bucket, start_s3_server

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ObjectIdentifierTypeDef
    from s3transfer.crt import CRTTransferManager

ROOT: Final = Path(__file__).resolve().parent.parent
RESULTS_DIR: Final = ROOT / "benchmarks" / "results"
MIB: Final = 1024 * 1024
GB: Final = 1000**3

Cell = str | int | float | None


class BenchmarkError(RuntimeError):
    """A measurement did not do what it was timed for: it read too little, a command failed."""


def say(message: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def utc_now() -> str:
    """The current time in UTC, ISO 8601 with seconds."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class Stopwatch:
    """Seconds on the monotonic clock since it was made or last restarted."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def restart(self) -> None:
        """Count from now."""
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.started


def best_of(repeats: int, action: Callable[[], object]) -> float:
    """The shortest of `repeats` timed calls of `action`, in seconds.

    The best run is the one least disturbed by other work on the machine; `action` must itself
    wait for any asynchronous work it starts (a device copy, a thread pool).
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    times = []
    for _ in range(repeats):
        watch = Stopwatch()
        action()
        times.append(watch.elapsed)
    return min(times)


def spread(values: Sequence[float]) -> dict[str, float]:
    """The median, the smallest and the largest of repeated measurements."""
    if not values:
        raise ValueError("no values")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """`numerator / denominator`, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


@dataclass(frozen=True)
class ProcessUsage:
    """What a process has used so far, read from `/proc` (Linux)."""

    cpu_seconds: float
    """User plus system CPU time of every thread."""
    rss_bytes: int
    """Resident memory now."""
    peak_rss_bytes: int
    """The highest resident memory since the process started (`VmHWM`)."""


def process_usage(pid: int) -> ProcessUsage:
    """CPU time and resident memory of a running process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses; the fields after it do not.
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    memory: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            memory[key] = int(value.split()[0]) * 1024
    return ProcessUsage(
        cpu_seconds=cpu, rss_bytes=memory.get("VmRSS", 0), peak_rss_bytes=memory.get("VmHWM", 0)
    )


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(value, 2) for value in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on, and how busy it was."""
    cpu_model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.partition(":")[2].strip()
                break
    memory_bytes = None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_bytes = int(line.split()[1]) * 1024
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpus": cores(),
        "memory_gib": round(memory_bytes / 1024**3, 1) if memory_bytes else None,
        "load_average": load_average(),
        "git": git_revision(),
    }


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def git_revision() -> dict[str, Any] | None:
    """The commit the benchmark ran from and whether the work tree had changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(changes)}


def write_result(
    name: str, results: Any, *, path: Path | None = None, started: str | None = None
) -> Path:
    """Write `results` with the time and the machine to `benchmarks/results/<name>.json`."""
    target = path or RESULTS_DIR / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": name,
        "started": started,
        "finished": utc_now(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "machine": machine_info(),
        "results": results,
    }
    target.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    return target


def _cell(value: Cell) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    """A plain-text table: text left-aligned, numbers right-aligned, `-` for missing values."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[i], int | float) or row[i] is None for row in rows) and bool(rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> None:
    """Print a titled table to stdout."""
    print(f"\n{title}\n{format_table(headers, rows)}", flush=True)


# The S3 server the data-plane benchmarks write to ---------------------------------------------


@dataclass(frozen=True)
class S3Store:
    """One bucket on an S3 server. The endpoint and credentials are in this process's
    environment (`AWS_ENDPOINT_URL_S3`, `AWS_ACCESS_KEY_ID`, ...), where boto3, tensorizer and
    `preshard` all find them, as they do in a pod."""

    endpoint: str
    bucket: str
    server: S3Server | None
    """The server the benchmark started itself; None for one it was given."""

    def server_cpu_seconds(self) -> float | None:
        """The CPU time the server has used so far; None for a server started elsewhere."""
        if self.server is None:
            return None
        return process_usage(self.server.process.pid).cpu_seconds

    def client(self) -> S3Client:
        """A boto3 client with boto3's defaults."""
        return boto3.client("s3", endpoint_url=self.endpoint)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object and unfinished upload under `prefix/`."""
        client = self.client()
        base = prefix.strip("/") + "/"
        for uploads in client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=base
        ):
            for upload in uploads.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
        for listing in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        ):
            keys: list[ObjectIdentifierTypeDef] = [
                {"Key": obj["Key"]} for obj in listing.get("Contents", [])
            ]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def reclaim_space(self) -> None:
        """Give the disk space of deleted objects back, on a server this benchmark started.

        SeaweedFS only marks deleted objects until its master compacts the volumes (by default
        every 14 minutes, for volumes over 30 % garbage); a benchmark that writes many
        gigabytes would fill the disk before that, so it asks for a compaction itself.
        """
        if self.server is None:
            return
        argv = self.server.process.popen.args
        words = [str(arg) for arg in argv] if isinstance(argv, list | tuple) else []
        port = next(w.partition("=")[2] for w in words if w.startswith("-master.port="))
        url = f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.001"
        with urllib.request.urlopen(url, timeout=1800) as response:
            response.read()


def crt_transfer_manager(endpoint: str | None) -> CRTTransferManager:
    """s3transfer's transfer manager over the AWS CRT's S3 client (`boto3[crt]`), defaults
    otherwise; credentials and region from boto3's usual chain.

    Built here rather than through `TransferConfig(preferred_transfer_client="crt")`: boto3
    makes its CRT client with TLS always on and no endpoint, which cannot reach a plain-http
    server such as the test one.
    """
    import botocore.session  # noqa: PLC0415 - only the CRT baselines need it
    from s3transfer.crt import (  # noqa: PLC0415
        BotocoreCRTCredentialsWrapper,
        BotocoreCRTRequestSerializer,
        CRTTransferManager,
        create_s3_crt_client,
    )

    session = botocore.session.get_session()
    region = session.get_config_variable("region") or "us-east-1"
    credentials = BotocoreCRTCredentialsWrapper(session.get_credentials())
    crt_client = create_s3_crt_client(
        region,
        crt_credentials_provider=credentials.to_crt_credentials_provider(),
        use_ssl=not (endpoint or "").startswith("http://"),
    )
    serializer = BotocoreCRTRequestSerializer(
        session, {"region_name": region, "endpoint_url": endpoint}
    )
    return CRTTransferManager(crt_client, serializer)


@contextlib.contextmanager
def s3_store(endpoint: str | None, bucket: str | None) -> Iterator[S3Store]:
    """The S3 server and bucket a data-plane benchmark writes to.

    With `endpoint`, an existing server whose credentials are already in the environment and
    an existing `bucket`. Without, a fresh SeaweedFS on loopback with a random key pair (put
    into this process's environment) and a new bucket, stopped and removed afterwards.
    """
    if endpoint:
        if not bucket:
            raise ValueError("an S3 endpoint needs the name of an existing bucket")
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
        yield S3Store(endpoint=endpoint, bucket=bucket, server=None)
        return
    with tempfile.TemporaryDirectory(prefix="preshard-bench-s3-") as data:
        server = start_s3_server(Path(data))
        try:
            os.environ.update(server.env())
            created = create_bucket(server, bucket or "preshard-bench")
            yield S3Store(endpoint=server.endpoint, bucket=created.name, server=server)
        finally:
            server.stop()
