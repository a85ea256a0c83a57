"""Making shards: `preshard serialize` against boto3, tensorizer on its own, and the S3 limit.

A synthetic Llama-shaped model (`--size-gb` of float32 safetensors) lies under an S3 prefix as
the source. For each tensor-parallel size of `--tp`, `--repeats` rounds run one after another
on the same S3 server, each with every method below, so the ratios within a round compare
measurements taken a minute apart on the same machine:

- **preshard**: `preshard serialize` in this process (`preshard.cli.main`) with the CPU test
  engine, which cuts the checkpoint the way tensor parallelism does and writes one tensorizer
  file per rank to the scratch directory. Its phases: *prepare* (the destination check, the
  source's file list, the download of the source, which later rounds find in the scratch
  directory already), *engine* (the rank files) and *upload* (the listing, the uploader,
  the object tags and the manifest).
- **boto3**: the rank files preshard just wrote, uploaded one after another with boto3's
  managed `upload_file` and its default `TransferConfig` (what a script would do).
- **CRT**: the same rank files through the AWS CRT's transfer client (`boto3[crt]`), all
  submitted at once: the C transfer engine boto3 picks on instance types AWS optimises for.
- **tensorizer**: each rank's tensors, cut by the same code as the engine, written by
  `TensorSerializer` straight to `s3://` through `tensorizer.stream_io.open_stream(..., "wb")`:
  tensorizer writes a temporary file and uploads it with boto3's `upload_file` when the stream
  closes. This is what vLLM does when `tensorize_vllm_model` is given an `s3://` URI.
- **limit**: the same rank files uploaded by the fastest uploader at hand: one pool of
  threads sending the parts of every file as parallel multipart uploads, each part read
  straight from the page cache, with no hashing, no checksums and unsigned payloads. Several
  pool sizes and part sizes (`--limit-settings`) run in every round; the fastest is the
  round's limit: what this server takes on this machine at that moment.

The rank files are in the page cache for every upload (they were just written), so no method
reads the disk more than another.

    python -m benchmarks.serialize [--size-gb 2] [--tp 1,2,4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import boto3
from botocore.config import Config

from benchmarks import common
from preshard import cli
from preshard.contract.layout import RANK_FILE_TEMPLATE
from preshard.contract.outcome import Outcome
from preshard.dataplane import s3
from preshard.dataplane.engine import ENGINE_ENV, EngineRequest
from preshard_devenv.cpuengine import CpuTestEngine, cast, load_checkpoint, rank_slice
from preshard_devenv.tinymodel import TinyModel, make_tiny_model

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

NAME: Final = "serialize"
SCRATCH: Final = common.ROOT / "benchmarks" / "scratch" / NAME
ENGINE_SPEC: Final = "benchmarks.serialize:TimedCpuEngine"
ENGINE_TIMES: Final = "engine-times.json"
DTYPE: Final = "auto"
MIB: Final = 1 << 20
# Upload threads x part size (MiB) that the limit tries in every round.
DEFAULT_LIMIT_SETTINGS: Final = ((4, 64), (8, 32), (8, 64), (16, 32))
# The targets this benchmark checks.
UPLOAD_OVER_LIMIT_TARGET: Final = 1.05
OVER_BASELINE_TARGET: Final = 1.0

PRESHARD: Final = "preshard"
PRESHARD_SIGNED: Final = "preshard-signed"
BOTO3: Final = "boto3"
CRT: Final = "crt"
TENSORIZER: Final = "tensorizer"
LIMIT: Final = "limit"
METHODS: Final = (PRESHARD, PRESHARD_SIGNED, BOTO3, CRT, TENSORIZER, LIMIT)
LABELS: Final = {
    PRESHARD: "preshard serialize",
    PRESHARD_SIGNED: "preshard, signed payloads",
    BOTO3: "A: boto3 upload_file",
    CRT: "C: CRT transfer client",
    TENSORIZER: "B: tensorizer to s3://",
    LIMIT: "limit (best setting)",
}


# The model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The `make_tiny_model` arguments of a Llama-shaped decoder."""

    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int = 1

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.hidden_size // self.heads

    def layer_bytes(self) -> int:
        """Float32 bytes of one decoder layer."""
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * kv * self.hidden_size
        mlp = 3 * self.intermediate_size * self.hidden_size
        return 4 * (attention + mlp + 2 * self.hidden_size)

    def outside_bytes(self) -> int:
        """Float32 bytes of the embedding, the final norm and the LM head."""
        return 4 * (2 * self.vocab * self.hidden_size + self.hidden_size)

    def total_bytes(self) -> int:
        """Float32 bytes of the whole model."""
        return self.outside_bytes() + self.layers * self.layer_bytes()

    def halved(self) -> ModelShape:
        """The same architecture at half the width (head width kept)."""
        heads = max(self.heads // 2, 1)
        return ModelShape(
            hidden_size=self.hidden_size // 2,
            intermediate_size=self.intermediate_size // 2,
            heads=heads,
            kv_heads=min(self.kv_heads, heads),
            vocab=self.vocab // 2,
        )


# A 1B-class Llama (TinyLlama's widths): 180 MB per float32 layer, 524 MB outside the layers.
BASE_SHAPE: Final = ModelShape(
    hidden_size=2048, intermediate_size=5632, heads=16, kv_heads=4, vocab=32000
)


def plan_model(size_bytes: int) -> ModelShape:
    """The widest shape of which at least two layers fit `size_bytes`, with as many layers as
    fit. Every split dimension stays divisible by 4 (TP 4)."""
    shape = BASE_SHAPE
    while shape.outside_bytes() + 2 * shape.layer_bytes() > size_bytes and shape.hidden_size > 64:
        shape = shape.halved()
    layers = max(1, (size_bytes - shape.outside_bytes()) // shape.layer_bytes())
    return ModelShape(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        vocab=shape.vocab,
        layers=layers,
    )


def make_model(directory: Path, shape: ModelShape) -> TinyModel:
    """Write the model with its config and tokenizer files, weights in files of about 1 GB."""
    shutil.rmtree(directory, ignore_errors=True)
    return make_tiny_model(
        directory,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        vocab=shape.vocab,
        weight_shards=max(1, math.ceil(shape.total_bytes() / common.GB)),
    )


def upload_directory(client: S3Client, directory: Path, bucket: str, prefix: str) -> str:
    """Put every file of `directory` under `s3://bucket/prefix/`; returns that URI."""
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(directory).as_posix()}")
    return f"s3://{bucket}/{prefix}/"


# The methods ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """The phases of one run: seconds, and CPU seconds of this process and of the server."""

    upload_s: float
    engine_s: float = 0.0
    prepare_s: float = 0.0
    client_cpu_s: float | None = None
    """CPU seconds this process spent in the upload phase."""
    server_cpu_s: float | None = None
    """CPU seconds the S3 server spent during the whole run (None for a server not ours)."""

    @property
    def total_s(self) -> float:
        """Engine and upload: the part every method that makes shards does."""
        return self.engine_s + self.upload_s


class TimedCpuEngine(CpuTestEngine):
    """The CPU test engine, noting when it started and finished (wall clock and this
    process's CPU time) beside its output directory; `preshard serialize` selects it through
    `PRESHARD_ENGINE`."""

    def serialize(self, request: EngineRequest) -> None:
        """Write the rank files, then `engine-times.json`."""
        started, cpu_started = time.monotonic(), time.process_time()
        super().serialize(request)
        times = {
            "started": started,
            "finished": time.monotonic(),
            "cpu_started": cpu_started,
            "cpu_finished": time.process_time(),
        }
        (request.output_dir.parent / ENGINE_TIMES).write_text(json.dumps(times))


def run_preshard(
    model_uri: str,
    destination: str,
    key: str,
    tensor_parallel_size: int,
    scratch: Path,
    extra_args: Sequence[str],
    *,
    sign_payloads: bool = False,
) -> Timing:
    """`preshard serialize` in this process with the timed CPU engine; its phases.

    `sign_payloads` makes its uploader's client sign every payload with SHA-256, as it did
    before it relied on its checksum headers alone: the change this comparison justifies.
    """
    shutil.rmtree(scratch / "shards", ignore_errors=True)
    times = scratch / ENGINE_TIMES
    times.unlink(missing_ok=True)
    termination_log = scratch / "termination-log"
    argv = [
        "serialize",
        "--model", model_uri,
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--dtype", DTYPE,
        "--dest", f"{destination}/{key}/",
        "--artifact-key", key,
        "--scratch-dir", str(scratch),
        "--termination-log", str(termination_log),
        *extra_args,
    ]  # fmt: skip
    os.environ[ENGINE_ENV] = ENGINE_SPEC
    started = time.monotonic()
    # The outcome line goes to stdout, between the benchmark's tables; it is read from the
    # termination log instead.
    signing = signed_payloads() if sign_payloads else contextlib.nullcontext()
    with signing, contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    finished, cpu_finished = time.monotonic(), time.process_time()
    outcome = Outcome.from_message(termination_log.read_text())
    if code != 0 or outcome is None or not outcome.ok:
        detail = f"{outcome.reason}: {outcome.message}" if outcome else f"exit code {code}"
        raise common.BenchmarkError(f"preshard serialize failed ({detail})")
    engine = json.loads(times.read_text())
    return Timing(
        prepare_s=engine["started"] - started,
        engine_s=engine["finished"] - engine["started"],
        upload_s=finished - engine["finished"],
        client_cpu_s=cpu_finished - engine["cpu_finished"],
    )


@contextlib.contextmanager
def signed_payloads() -> Iterator[None]:
    """Every S3 client `preshard` makes in this process signs its payloads."""
    original = s3.make_client

    def signing(**kwargs: Any) -> S3Client:
        return original(**{**kwargs, "sign_payloads": True})

    s3.make_client = signing
    try:
        yield
    finally:
        s3.make_client = original


def run_boto3(client: S3Client, files: Sequence[Path], bucket: str, prefix: str) -> Timing:
    """boto3's managed `upload_file` with its default `TransferConfig`, one file at a time."""
    watch, cpu = common.Stopwatch(), time.process_time()
    for path in files:
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return Timing(upload_s=watch.elapsed, client_cpu_s=time.process_time() - cpu)


def run_crt(endpoint: str | None, files: Sequence[Path], bucket: str, prefix: str) -> Timing:
    """The AWS CRT's transfer client (`boto3[crt]`) with its defaults, every file submitted
    at once."""
    watch, cpu = common.Stopwatch(), time.process_time()
    with common.crt_transfer_manager(endpoint) as manager:
        futures = [manager.upload(str(p), bucket, f"{prefix}/{p.name}") for p in files]
        for future in futures:
            future.result()
    return Timing(upload_s=watch.elapsed, client_cpu_s=time.process_time() - cpu)


@contextlib.contextmanager
def timed_tensorizer_uploads() -> Iterator[list[tuple[float, float]]]:
    """Time every upload tensorizer makes when an `s3://` stream closes (wall and CPU).

    tensorizer serializes on background threads that `close()` waits for, so timing `close()`
    would count the end of the serialization as upload; its module-level `s3_upload` is the
    upload alone.
    """
    from tensorizer import stream_io  # noqa: PLC0415 - heavy; only this method uses it

    spans: list[tuple[float, float]] = []
    upload = stream_io.s3_upload

    def timed(*args: Any, **kwargs: Any) -> None:
        watch, cpu = common.Stopwatch(), time.process_time()
        try:
            upload(*args, **kwargs)
        finally:
            spans.append((watch.elapsed, time.process_time() - cpu))

    stream_io.s3_upload = timed
    try:
        yield spans
    finally:
        stream_io.s3_upload = upload


def run_tensorizer(model_dir: Path, tensor_parallel_size: int, uri_template: str) -> Timing:
    """Every rank serialized by tensorizer straight to `s3://` (a temporary file, uploaded
    when the stream closes), the tensors cut by the CPU engine's own code."""
    from tensorizer import TensorSerializer  # noqa: PLC0415 - heavy; only this method uses it
    from tensorizer.stream_io import open_stream  # noqa: PLC0415

    with timed_tensorizer_uploads() as uploads:
        watch = common.Stopwatch()
        checkpoint = load_checkpoint(model_dir)
        for rank in range(tensor_parallel_size):
            shard = {
                name: cast(rank_slice(name, tensor, rank, tensor_parallel_size), DTYPE)
                for name, tensor in checkpoint.items()
            }
            serializer = TensorSerializer(open_stream(uri_template % rank, "wb"))
            serializer.write_state_dict(shard)
            serializer.close()
            del shard
        total = watch.elapsed
    if len(uploads) != tensor_parallel_size:
        raise common.BenchmarkError(
            f"tensorizer uploaded {len(uploads)} of {tensor_parallel_size} files"
        )
    upload_s = sum(wall for wall, _ in uploads)
    return Timing(
        engine_s=total - upload_s, upload_s=upload_s, client_cpu_s=sum(cpu for _, cpu in uploads)
    )


def limit_client(concurrency: int) -> S3Client:
    """A client for the fastest upload: enough connections, no checksums, unsigned payloads."""
    config = Config(
        max_pool_connections=concurrency,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False},
        retries={"mode": "standard"},
    )
    return boto3.client("s3", config=config)


def run_limit(
    files: Sequence[Path], bucket: str, prefix: str, concurrency: int, part_size: int
) -> Timing:
    """Every part of every file through one pool of `concurrency` threads, nothing hashed."""
    client = limit_client(concurrency)

    def send(path: Path, key: str, upload_id: str, number: int) -> CompletedPartTypeDef:
        with path.open("rb", buffering=0) as file:
            data = os.pread(file.fileno(), part_size, (number - 1) * part_size)
        response = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        return {"PartNumber": number, "ETag": response["ETag"]}

    watch, cpu = common.Stopwatch(), time.process_time()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="limit") as pool:
        uploads: list[tuple[str, str, list[Future[CompletedPartTypeDef]]]] = []
        for path in files:
            key = f"{prefix}/{path.name}"
            upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            parts = max(1, math.ceil(path.stat().st_size / part_size))
            futures = [
                pool.submit(send, path, key, upload_id, number) for number in range(1, parts + 1)
            ]
            uploads.append((key, upload_id, futures))
        for key, upload_id, futures in uploads:
            client.complete_multipart_upload(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": [future.result() for future in futures]},
            )
    return Timing(upload_s=watch.elapsed, client_cpu_s=time.process_time() - cpu)


# One round ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every round does."""

    store: common.S3Store
    model: TinyModel
    model_uri: str
    prefix: str
    scratch: Path
    limit_settings: Sequence[tuple[int, int]]
    preshard_args: Sequence[str]
    with_signed_payloads: bool = False


@dataclass(frozen=True)
class Method:
    """One timed way of making or storing the rank files."""

    name: str
    setting: str | None
    run: Callable[[str], Timing]
    """Runs the method, writing under the given key prefix."""


class Round:
    """Every method once for one TP size, in an order that rotates from round to round, so
    that no method always follows the same one (a fresh write-back, a volume the server has
    just filled)."""

    def __init__(self, plan: Plan, tensor_parallel_size: int, number: int) -> None:
        self.plan = plan
        self.tensor_parallel_size = tensor_parallel_size
        self.number = number
        self.prefix = f"{plan.prefix}/tp{tensor_parallel_size}-{number}"
        self.shards = plan.scratch / "shards"

    def methods(self) -> list[Method]:
        """preshard, boto3, the CRT, every limit setting and tensorizer, rotated by the round
        number."""
        store, tp = self.plan.store, self.tensor_parallel_size
        bucket = store.bucket

        def preshard(prefix: str, *, sign_payloads: bool = False) -> Timing:
            return run_preshard(
                self.plan.model_uri,
                f"s3://{bucket}/{prefix}",
                f"tp{tp}-{self.number}",
                tp,
                self.plan.scratch,
                self.plan.preshard_args,
                sign_payloads=sign_payloads,
            )

        def tensorizer(prefix: str) -> Timing:
            template = f"s3://{bucket}/{prefix}/{RANK_FILE_TEMPLATE}"
            return run_tensorizer(self.plan.model.path, tp, template)

        signed = [Method(PRESHARD_SIGNED, None, functools.partial(preshard, sign_payloads=True))]
        methods = [
            Method(PRESHARD, None, preshard),
            *(signed if self.plan.with_signed_payloads else []),
            Method(
                BOTO3, None, lambda prefix: run_boto3(store.client(), self.files(), bucket, prefix)
            ),
            Method(CRT, None, lambda prefix: run_crt(store.endpoint, self.files(), bucket, prefix)),
            *(
                Method(
                    LIMIT,
                    f"{threads}x{part}MiB",
                    functools.partial(self._limit, threads=threads, part_size=part * MIB),
                )
                for threads, part in self.plan.limit_settings
            ),
            Method(TENSORIZER, None, tensorizer),
        ]
        shift = (self.number - 1) % len(methods)
        return methods[shift:] + methods[:shift]

    def files(self) -> list[Path]:
        """The rank files preshard's engine wrote last."""
        return sorted(self.shards.glob("model-rank-*.tensors"))

    def _limit(self, prefix: str, *, threads: int, part_size: int) -> Timing:
        return run_limit(self.files(), self.plan.store.bucket, prefix, threads, part_size)

    def run(self) -> list[dict[str, Any]]:
        """Every method once; one row each."""
        rows = []
        for method in self.methods():
            rows.append(self.measure(method))
        return rows

    def measure(self, method: Method) -> dict[str, Any]:
        """Run one method, with the server's CPU time around it; remove what it wrote."""
        store = self.plan.store
        label = f"{method.name}-{method.setting}" if method.setting else method.name
        prefix = f"{self.prefix}/{label}"
        server_cpu = store.server_cpu_seconds()
        try:
            timing = method.run(prefix)
        finally:
            store.delete_prefix(prefix)
        server_cpu_after = store.server_cpu_seconds()
        if server_cpu is not None and server_cpu_after is not None:
            timing = dataclasses.replace(timing, server_cpu_s=server_cpu_after - server_cpu)
        files = self.files()
        uploaded = sum(path.stat().st_size for path in files)
        if method.name in (PRESHARD, PRESHARD_SIGNED):
            uploaded += sum(
                (self.plan.model.path / name).stat().st_size
                for name in self.plan.model.config_files
            )
        row = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "round": self.number,
            "method": method.name,
            "setting": method.setting,
            "prepare_s": round(timing.prepare_s, 3),
            "engine_s": round(timing.engine_s, 3),
            "upload_s": round(timing.upload_s, 3),
            "total_s": round(timing.total_s, 3),
            "client_cpu_s": _rounded(timing.client_cpu_s),
            "server_cpu_s": _rounded(timing.server_cpu_s),
            "bytes": uploaded,
        }
        engine = f"engine {timing.engine_s:.1f}s, " if timing.engine_s else ""
        cpu = (
            f", CPU s: {_rounded(timing.client_cpu_s)} here, {_rounded(timing.server_cpu_s)} server"
        )
        common.say(
            f"TP {self.tensor_parallel_size} round {self.number}: {label}: {engine}"
            f"upload {timing.upload_s:.1f}s ({uploaded / timing.upload_s / 1e6:.0f} MB/s){cpu}"
        )
        return row


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def warm_up(plan: Plan, tensor_parallel_size: int) -> None:
    """One untimed `preshard serialize`: the source lands in the scratch directory (later
    runs find it there) and the rank files exist before the first round."""
    prefix = f"{plan.prefix}/tp{tensor_parallel_size}-warm-up"
    try:
        run_preshard(
            plan.model_uri,
            f"s3://{plan.store.bucket}/{prefix}",
            "warm-up",
            tensor_parallel_size,
            plan.scratch,
            plan.preshard_args,
        )
    finally:
        plan.store.delete_prefix(prefix)


# The summary ------------------------------------------------------------------------------------


def limit_settings_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each limit setting's median upload time per TP size; the fastest median is the limit."""
    grouped: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["method"] == LIMIT:
            grouped.setdefault((row["tensor_parallel_size"], row["setting"]), []).append(row)
    result = []
    for (tp, setting), group in grouped.items():
        upload = common.spread([r["upload_s"] for r in group])
        result.append(
            {
                "tensor_parallel_size": tp,
                "setting": setting,
                "upload_s": upload,
                "mb_per_s": round(group[0]["bytes"] / upload["median"] / 1e6, 1),
            }
        )
    for tp in {entry["tensor_parallel_size"] for entry in result}:
        mine = [entry for entry in result if entry["tensor_parallel_size"] == tp]
        best = min(mine, key=lambda entry: entry["upload_s"]["median"])
        for entry in mine:
            entry["limit"] = entry is best
    return result


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges per TP size and method, paired ratios, and the targets.

    The limit of a TP size is the setting with the fastest median; its time in each round is
    that round's limit. (The fastest setting of each round would favour the limit: the
    smallest of several noisy times is lower than a typical one.)
    """
    settings = limit_settings_summary(rows)
    chosen = {(s["tensor_parallel_size"], s["setting"]) for s in settings if s["limit"]}
    by_round: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["method"] == LIMIT and (row["tensor_parallel_size"], row["setting"]) not in chosen:
            continue
        slot = (row["tensor_parallel_size"], row["round"])
        by_round.setdefault(slot, {})[row["method"]] = row
    methods: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    for tp in sorted({tp for tp, _ in by_round}):
        rounds = [entry for (size, _), entry in sorted(by_round.items()) if size == tp]
        for method in METHODS:
            if all(method in r for r in rounds):
                methods.append(method_summary(tp, method, [r[method] for r in rounds]))
        ratios.append({"tensor_parallel_size": tp, **paired_ratios(rounds)})
    return {
        "methods": methods,
        "limit_settings": settings,
        "ratios": ratios,
        "targets": targets(ratios),
    }


def method_summary(tp: int, method: str, timed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One method at one TP size over the rounds."""
    upload = common.spread([r["upload_s"] for r in timed])
    size = timed[0]["bytes"]

    def cpu_per_gb(field: str) -> float | None:
        values = [r[field] for r in timed if r[field] is not None]
        return round(statistics.median(values) / (size / common.GB), 2) if values else None

    return {
        "tensor_parallel_size": tp,
        "method": method,
        "setting": timed[0]["setting"],
        "rounds": len(timed),
        "bytes": size,
        "prepare_s": common.spread([r["prepare_s"] for r in timed]),
        "engine_s": common.spread([r["engine_s"] for r in timed]),
        "upload_s": upload,
        "total_s": common.spread([r["total_s"] for r in timed]),
        "upload_mb_per_s": round(size / upload["median"] / 1e6, 1),
        "client_cpu_s_per_gb": cpu_per_gb("client_cpu_s"),
        "server_cpu_s_per_gb": cpu_per_gb("server_cpu_s"),
    }


def paired_ratios(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Ratios within each round, summarised over the rounds."""

    def over(
        numerator: Callable[[dict[str, dict[str, Any]]], float],
        denominator: Callable[[dict[str, dict[str, Any]]], float],
    ) -> dict[str, float]:
        return common.spread([numerator(r) / denominator(r) for r in rounds])

    def upload(method: str) -> Callable[[dict[str, dict[str, Any]]], float]:
        return lambda r: float(r[method]["upload_s"])

    def total(method: str) -> Callable[[dict[str, dict[str, Any]]], float]:
        return lambda r: float(r[method]["total_s"])

    signed = (
        {"signed_upload_over_preshard": over(upload(PRESHARD_SIGNED), upload(PRESHARD))}
        if all(PRESHARD_SIGNED in r for r in rounds)
        else {}
    )
    return {
        **signed,
        "preshard_upload_over_limit": over(upload(PRESHARD), upload(LIMIT)),
        "preshard_over_engine_plus_limit": over(
            total(PRESHARD), lambda r: r[PRESHARD]["engine_s"] + r[LIMIT]["upload_s"]
        ),
        "preshard_over_tensorizer": over(total(PRESHARD), total(TENSORIZER)),
        "preshard_upload_over_boto3": over(upload(PRESHARD), upload(BOTO3)),
        "preshard_upload_over_crt": over(upload(PRESHARD), upload(CRT)),
        "boto3_over_limit": over(upload(BOTO3), upload(LIMIT)),
        "crt_over_limit": over(upload(CRT), upload(LIMIT)),
        "tensorizer_upload_over_limit": over(upload(TENSORIZER), upload(LIMIT)),
    }


def targets(ratios: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The targets, judged on the median paired ratio of every TP size."""

    def goal(ratio: str, target: float, *, strictly: bool) -> dict[str, Any]:
        values = {r["tensor_parallel_size"]: r[ratio]["median"] for r in ratios}
        return {
            "target": target,
            "by_tensor_parallel_size": values,
            "met": all(v < target if strictly else v <= target for v in values.values()),
        }

    return {
        "preshard_upload_within_limit": goal(
            "preshard_upload_over_limit", UPLOAD_OVER_LIMIT_TARGET, strictly=False
        ),
        "preshard_upload_faster_than_boto3": goal(
            "preshard_upload_over_boto3", OVER_BASELINE_TARGET, strictly=True
        ),
        "preshard_faster_than_tensorizer": goal(
            "preshard_over_tensorizer", OVER_BASELINE_TARGET, strictly=True
        ),
    }


def _median_range(values: dict[str, float]) -> str:
    return f"{values['median']:.2f} ({values['min']:.2f}-{values['max']:.2f})"


def print_report(summary: dict[str, Any]) -> None:
    """The tables: phases per method, the limit's settings, the ratios, the targets."""
    rows = []
    for entry in summary["methods"]:
        label = LABELS[entry["method"]]
        if entry["setting"]:
            label += f" {entry['setting']}"
        rows.append(
            [
                entry["tensor_parallel_size"],
                label,
                entry["engine_s"]["median"] or None,
                entry["upload_s"]["median"],
                f"{entry['upload_s']['min']:.1f}-{entry['upload_s']['max']:.1f}",
                entry["total_s"]["median"],
                entry["upload_mb_per_s"],
                entry["client_cpu_s_per_gb"],
                entry["server_cpu_s_per_gb"],
            ]
        )
    common.print_table(
        "Making shards: medians over the rounds",
        [
            "TP",
            "method",
            "engine s",
            "upload s",
            "upload range",
            "engine+upload s",
            "upload MB/s",
            "CPU s/GB here",
            "CPU s/GB server",
        ],
        rows,
    )
    common.print_table(
        "The limit's settings: median upload seconds",
        ["TP", "threads x part", "upload s", "upload MB/s", "the limit"],
        [
            [
                s["tensor_parallel_size"],
                s["setting"],
                s["upload_s"]["median"],
                s["mb_per_s"],
                "yes" if s["limit"] else "",
            ]
            for s in summary["limit_settings"]
        ],
    )
    columns = {
        "preshard upload / limit": "preshard_upload_over_limit",
        "preshard / (engine + limit)": "preshard_over_engine_plus_limit",
        "preshard / tensorizer": "preshard_over_tensorizer",
        "preshard / A upload": "preshard_upload_over_boto3",
        "preshard / C upload": "preshard_upload_over_crt",
        "A / limit": "boto3_over_limit",
        "C / limit": "crt_over_limit",
        "B upload / limit": "tensorizer_upload_over_limit",
        "signed / preshard upload": "signed_upload_over_preshard",
    }
    shown = {h: k for h, k in columns.items() if all(k in r for r in summary["ratios"])}
    common.print_table(
        "Ratios within each round: median (smallest-largest)",
        ["TP", *shown],
        [
            [r["tensor_parallel_size"], *(_median_range(r[key]) for key in shown.values())]
            for r in summary["ratios"]
        ],
    )
    goals = summary["targets"]
    common.print_table(
        "Targets (median paired ratio per TP size)",
        ["target", "ratios", "met"],
        [
            [
                f"preshard upload within {UPLOAD_OVER_LIMIT_TARGET}x of the limit",
                _by_tp(goals["preshard_upload_within_limit"]["by_tensor_parallel_size"]),
                "yes" if goals["preshard_upload_within_limit"]["met"] else "no",
            ],
            [
                "preshard upload faster than boto3 upload_file",
                _by_tp(goals["preshard_upload_faster_than_boto3"]["by_tensor_parallel_size"]),
                "yes" if goals["preshard_upload_faster_than_boto3"]["met"] else "no",
            ],
            [
                "preshard engine+upload faster than tensorizer to s3://",
                _by_tp(goals["preshard_faster_than_tensorizer"]["by_tensor_parallel_size"]),
                "yes" if goals["preshard_faster_than_tensorizer"]["met"] else "no",
            ],
        ],
    )


def _by_tp(values: dict[int, float]) -> str:
    return ", ".join(f"TP {tp}: {value:.2f}" for tp, value in values.items())


# The command line -------------------------------------------------------------------------------


def _numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_limit_settings(text: str) -> list[tuple[int, int]]:
    """`4x64,8x32` (threads x part MiB) as pairs."""
    settings = []
    for item in text.split(","):
        threads, _, part = item.strip().lower().partition("x")
        if not threads.isdigit() or not part.isdigit() or int(threads) < 1 or int(part) < 5:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not THREADSxPART_MIB (part at least 5 MiB), e.g. 8x32"
            )
        settings.append((int(threads), int(part)))
    return settings


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serialize",
        description="Make and upload shards with preshard, boto3 and tensorizer, and find the "
        "S3 server's own limit for the same bytes.",
    )
    parser.add_argument(
        "--size-gb", type=float, default=2.0, help="model size in GB (default: %(default)s)"
    )
    parser.add_argument(
        "--tp", type=_numbers, default=[1, 2, 4], help="tensor-parallel sizes (default: 1,2,4)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds per TP size (default: %(default)s)"
    )
    parser.add_argument(
        "--limit-settings",
        type=parse_limit_settings,
        default=list(DEFAULT_LIMIT_SETTINGS),
        help="threads x part MiB the limit tries (default: "
        + ",".join(f"{t}x{p}" for t, p in DEFAULT_LIMIT_SETTINGS)
        + ")",
    )
    parser.add_argument(
        "--preshard-args",
        default="",
        help="extra `preshard serialize` flags, e.g. '--upload-concurrency 8 --part-size 64Mi'",
    )
    parser.add_argument(
        "--with-signed-payloads",
        action="store_true",
        help="also run preshard with its uploader signing every payload (SHA-256)",
    )
    parser.add_argument(
        "--endpoint",
        help="use this S3 server (credentials from the environment) instead of starting one",
    )
    parser.add_argument("--bucket", help="the bucket (required with --endpoint)")
    parser.add_argument(
        "--prefix", default="bench-serialize", help="key prefix of everything written"
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=SCRATCH,
        help="local scratch directory (default: benchmarks/scratch/serialize)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=common.RESULTS_DIR / f"{NAME}.json",
        help="result file (default: benchmarks/results/serialize.json)",
    )
    args = parser.parse_args(argv)
    if args.endpoint and not args.bucket:
        parser.error("--endpoint needs --bucket")
    if args.repeats < 1 or not args.tp or min(args.tp) < 1:
        parser.error("--repeats and every --tp must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Make the model, run every round, print the tables and write the result file."""
    args = parse_args(argv)
    started = common.utc_now()
    scratch: Path = args.scratch
    shape = plan_model(int(args.size_gb * common.GB))
    common.say(f"writing a {shape.total_bytes() / common.GB:.2f} GB model ({shape}) to {scratch}")
    model = make_model(scratch / "source", shape)
    size = model_bytes(model)
    rows: list[dict[str, Any]] = []
    with common.s3_store(args.endpoint, args.bucket) as store:
        prefix = f"{args.prefix.strip('/')}/{secrets.token_hex(4)}"
        source_prefix = f"{prefix}/source"
        try:
            model_uri = upload_directory(store.client(), model.path, store.bucket, source_prefix)
            plan = Plan(
                store=store,
                model=model,
                model_uri=model_uri,
                prefix=prefix,
                scratch=scratch / "work",
                limit_settings=args.limit_settings,
                preshard_args=args.preshard_args.split(),
                with_signed_payloads=args.with_signed_payloads,
            )
            for tp in args.tp:
                warm_up(plan, tp)
                for number in range(1, args.repeats + 1):
                    rows.extend(Round(plan, tp, number).run())
                    store.reclaim_space()
        finally:
            store.delete_prefix(prefix)
            shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(rows)
    print_report(summary)
    path = common.write_result(
        NAME,
        {
            "options": {
                "size_gb": args.size_gb,
                "tensor_parallel_sizes": args.tp,
                "repeats": args.repeats,
                "limit_settings": [f"{t}x{p}MiB" for t, p in args.limit_settings],
                "preshard_args": args.preshard_args,
                "with_signed_payloads": args.with_signed_payloads,
                "own_server": args.endpoint is None,
            },
            "model": {
                "bytes": size,
                "shape": {
                    "hidden_size": shape.hidden_size,
                    "intermediate_size": shape.intermediate_size,
                    "layers": shape.layers,
                    "heads": shape.heads,
                    "kv_heads": shape.kv_heads,
                    "vocab": shape.vocab,
                },
                "dtype": "float32",
            },
            "runs": rows,
            **summary,
        },
        path=args.output,
        started=started,
    )
    print(f"\nresults written to {path}")
    return 0


def model_bytes(model: TinyModel) -> int:
    """The bytes of every file of the model directory."""
    return sum(p.stat().st_size for p in model.path.rglob("*") if p.is_file())


if __name__ == "__main__":
    sys.exit(main())
