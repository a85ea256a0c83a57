"""Starting a model: the stock `vllm serve` against the one preshard patches, through real vLLM.

What a user waits for when a Deployment scales up is the time from the pod's start to its first
completion. This benchmark measures it with real vLLM at both ends (its CPU build, the engine
tier's `.venv-engine`, `make engine-env`):

1. a Llama-shaped model is written from a seed (`--layers`, `--hidden-size`, `--vocab`; about
   1 GB of float32 by default) and stored under an S3 prefix, as a model mirrored to S3;
2. `preshard serialize` with the real `VllmEngine`, in the serializer image's environment, makes
   its shard set at `--tensor-parallel-size` and stores it on the same S3 server;
3. then `--repeats` rounds, each starting three pods' servers in turn (the order rotates), no
   vLLM worker bound to cores (`VLLM_CPU_OMP_THREADS_BIND=nobind`, as on a GPU node):
   - **stock, local disk**: `vllm serve DIR` of the safetensors on local disk, their pages
     evicted from the page cache first: a node that already holds the weights, the most
     favourable start a Deployment without preshard gets;
   - **stock, S3 download**: a hand-written init container (boto3's `download_file`, its
     defaults, for every object of the model's prefix) copies the model to a fresh directory,
     then `vllm serve` of that directory: a Deployment without preshard whose weights are in
     S3;
   - **patched**: what a patched pod runs: the init container's `preshard fetch-config` (the
     config files and the bundled tensorizer into fresh directories), then `vllm serve` with the
     command line preshard writes for the set (tensorizer streams each rank file from S3);
   - **raw download**: the rank files by `curl` from presigned URLs, one connection per file,
     all at once, nothing kept (`benchmarks.load`'s raw download).

For each start it records the init container's seconds, the server's seconds to `/health` and
to the first completion (a greedy completion of fixed prompt token ids, sent as soon as
`/health` answers), and the seconds vLLM itself logs for loading the weights. Every server must
answer with the same token ids. The figures, paired within rounds: the patched pod's start to
its first completion (init container included) over each stock pod's, and the raw download's
time over the patched weight load (the speed of vLLM's load as a share of the download's).

On two CPU cores and a model of a gigabyte, engine start-up (imports, the CPU workers, the KV
cache) dominates every start; the weight load is the part a shard set changes.

    python -m benchmarks.engine [--layers 16] [--hidden-size 1024] [--vocab 32000]
        [--tensor-parallel-size 1] [--repeats 3] [--work DIR] [--output FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import secrets
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

from benchmarks import common
from benchmarks.load import curl_ranges, evict
from benchmarks.reshard import run_process
from benchmarks.serialize import upload_directory
from preshard.builders.vllm_args import TensorizerLoad, rewrite_vllm_command
from preshard.contract.layout import S3Location, rank_file_name, tensorizer_uri
from preshard_devenv import engine
from preshard_devenv.tinymodel import write_tiny_llama

NAME: Final = "engine"
SCRATCH: Final = common.ROOT / "benchmarks" / "scratch" / NAME
SERVED: Final = "org/model"
PROMPT: Final = (5, 17, 33, 100)
NUM_READERS: Final = 8
PRESIGN_SECONDS: Final = 3600
# No worker bound to cores, as on a GPU node: bound, vLLM's CPU build pins each worker (and
# tensorizer's reader threads with it) to its cores, which halves the weight load of TP 1 here.
OMP_BIND: Final = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TENSOR_PARALLEL_SIZES: Final = (1, 2)
# What vLLM logs for its weight load: the default loader (safetensors into the model) and the
# tensorizer loader (stream open to every tensor in the model), in vLLM 0.32.
_LOADED: Final = re.compile(
    r"Loading weights took ([\d.]+) seconds|Deserialized .+? in ([\d.]+)s, "
)
DISK: Final = "stock, local disk"
DOWNLOAD: Final = "stock, S3 download"
PATCHED: Final = "patched"
STARTS: Final = (DISK, DOWNLOAD, PATCHED)
RAW: Final = "raw download"
# A hand-written init container: boto3's `download_file` (its defaults) of every object.
_DOWNLOAD_SCRIPT: Final = """
import sys, boto3, pathlib
bucket, prefix, target = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
client = boto3.client("s3")
for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
    for item in page.get("Contents", []):
        path = target / item["Key"][len(prefix):]
        path.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, item["Key"], str(path))
"""
# The figures of a start, as the report names them.
FIGURE_NAMES: Final = {
    "init_s": "init container",
    "health_s": "/health",
    "first_completion_s": "first completion",
    "pod_s": "pod to first completion",
    "weights_s": "vLLM weight load",
}


@dataclass(frozen=True)
class Start:
    """One server start, from its process's start."""

    health_s: float
    first_completion_s: float
    weights_s: float | None
    """What vLLM logged for loading the weights."""
    init_s: float | None = None
    """The init container's time before the server starts, where the pod has one."""
    token_ids: tuple[int, ...] = ()

    @property
    def pod_s(self) -> float:
        """The pod's start to its first completion."""
        return (self.init_s or 0.0) + self.first_completion_s


@dataclass(frozen=True)
class ShardSet:
    """The set `preshard serialize` stored, and presigned URLs of its rank files."""

    location: S3Location
    urls: tuple[str, ...]
    sizes: tuple[int, ...]
    serialize_s: float
    versions: dict[str, str | None]
    """vLLM's and tensorizer's, as the serialization recorded them."""


class Bench:
    """The pods' starts and the downloads of one benchmark run."""

    def __init__(
        self, store: common.S3Store, work: Path, model: Path, model_uri: str, tp: int
    ) -> None:
        self.store = store
        self.work = work
        self.model = model
        self.model_uri = model_uri
        self.tp = tp
        self.s3_env = store_env(store)

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        home = self.work / "home"
        home.mkdir(parents=True, exist_ok=True)
        return {
            "PATH": f"{engine.engine_bin()}:/usr/bin:/bin",
            "HOME": str(home),
            **engine.VLLM_CPU_ENV,
            **OMP_BIND,
            **(extra or {}),
        }

    def serialize(self, key: str) -> ShardSet:
        """The model's shard set, made by vLLM through `preshard serialize`."""
        location = S3Location.parse(f"s3://{self.store.bucket}/{key}/sets/{key}/")
        args = ["serialize", "--model", self.model_uri, "--tensor-parallel-size", str(self.tp)]
        args += ["--dtype", "float32", "--max-model-len", "256", "--dest", location.uri]
        args += ["--artifact-key", key, "--scratch-dir", str(self.work / "scratch")]
        run = run_process(
            [str(engine.engine_bin() / "preshard"), *args],
            self.work / "serialize.log",
            env=self._env(engine.serializer_image().env),
        )
        shutil.rmtree(self.work / "scratch", ignore_errors=True)
        client = self.store.client()
        keys = [location.key(rank_file_name(rank)) for rank in range(self.tp)]
        sizes = tuple(
            client.head_object(Bucket=location.bucket, Key=k)["ContentLength"] for k in keys
        )
        urls = tuple(
            client.generate_presigned_url(
                "get_object",
                Params={"Bucket": location.bucket, "Key": k},
                ExpiresIn=PRESIGN_SECONDS,
            )
            for k in keys
        )
        versions = {
            "vllm": run.outcome.vllm_version if run.outcome else None,
            "tensorizer": run.outcome.tensorizer_version if run.outcome else None,
        }
        return ShardSet(location, urls, sizes, run.seconds, versions)

    def start(self, kind: str, shard_set: ShardSet, round_: int) -> Start:
        """One start of the kind named."""
        if kind == DISK:
            return self.from_disk(round_)
        if kind == DOWNLOAD:
            return self.after_download(round_)
        return self.patched(shard_set, round_)

    def from_disk(self, round_: int) -> Start:
        """`vllm serve` of the model directory, its weights read from the disk."""
        for weights in self.model.glob("*.safetensors"):
            evict(weights)
        return self._serve(f"disk-{round_}", self._stock_args(self.model), self._env())

    def after_download(self, round_: int) -> Start:
        """An init container downloads the model from S3, then `vllm serve` of the copy."""
        pod = self.work / f"download-{round_}"
        pod.mkdir(parents=True)
        location = S3Location.parse(self.model_uri)
        init = run_process(
            [sys.executable, "-c", _DOWNLOAD_SCRIPT, location.bucket, location.key(""), str(pod)],
            self.work / f"download-{round_}.log",
            env=self.s3_env,
        )
        start = self._serve(f"download-{round_}", self._stock_args(pod), self._env())
        shutil.rmtree(pod)
        return replace(start, init_s=init.seconds)

    def _stock_args(self, model: Path) -> list[str]:
        return [str(model), "--served-model-name", SERVED, *engine.VLLM_CPU_ARGS, *self._tp_args()]

    def patched(self, shard_set: ShardSet, round_: int) -> Start:
        """The patched pod: `preshard fetch-config`, then `vllm serve` as preshard rewrites it."""
        pod = self.work / f"patched-{round_}"
        config, tensorizer = pod / "model", pod / "tensorizer"
        pod.mkdir(parents=True)
        init = run_process(
            [
                str(Path(sys.executable).with_name("preshard")),
                "fetch-config",
                shard_set.location.uri,
                str(config),
                "--tensorizer-dir",
                str(tensorizer),
            ],
            pod / "fetch-config.log",
            env={**self.s3_env, **engine.tools_env()},
        )
        load = TensorizerLoad(
            model_dir=str(config),
            tensor_parallel_size=self.tp,
            tensorizer_uri=tensorizer_uri(shard_set.location, self.tp),
            num_readers=NUM_READERS,
        )
        user_args = [SERVED, *engine.VLLM_CPU_ARGS, *self._tp_args()]
        rewritten = rewrite_vllm_command(["vllm", "serve"], user_args, load)
        env = self._env({**self.s3_env, "PYTHONPATH": str(tensorizer)})
        start = self._serve(f"patched-{round_}", rewritten.args or [], env)
        return replace(start, init_s=init.seconds)

    def raw_download(self, shard_set: ShardSet) -> float:
        """Seconds to fetch every rank file at once, one connection each, nothing kept."""
        watch = common.Stopwatch()
        with concurrent.futures.ThreadPoolExecutor(len(shard_set.urls)) as pool:
            list(pool.map(curl_ranges, shard_set.urls, shard_set.sizes, [1] * self.tp))
        return watch.elapsed

    def _tp_args(self) -> list[str]:
        return ["--tensor-parallel-size", str(self.tp)] if self.tp > 1 else []

    def _serve(self, name: str, args: Sequence[str], env: dict[str, str]) -> Start:
        log_dir = self.work / "logs"
        watch = common.Stopwatch()
        server = engine.VllmServer.launch(
            engine.engine_bin() / "vllm",
            args,
            log_dir,
            env=env,
            name=name,
            poll_interval=0.2,
        )
        try:
            health = watch.elapsed
            answer = engine.complete(server.url(""), SERVED, PROMPT)
            first = watch.elapsed
        finally:
            server.stop()
        log = (log_dir / f"{name}.log").read_text(errors="replace")
        loaded = [float(a or b) for a, b in _LOADED.findall(log)]
        return Start(
            health_s=health,
            first_completion_s=first,
            weights_s=max(loaded) if loaded else None,
            token_ids=answer.token_ids,
        )


def store_env(store: common.S3Store) -> dict[str, str]:
    """What a pod needs to reach the store: its endpoint and credentials, nothing else."""
    if store.server is None:
        raise common.BenchmarkError("the engine benchmark runs its own S3 server")
    return store.server.env()


def make_model(directory: Path, args: argparse.Namespace) -> int:
    """Write the model; its weight bytes."""
    heads = max(4, args.hidden_size // 128)
    write_tiny_llama(
        directory,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 11 // 4,
        layers=args.layers,
        heads=heads,
        kv_heads=2,
        vocab=args.vocab,
    )
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def run_rounds(bench: Bench, shard_set: ShardSet, repeats: int) -> list[dict[str, Any]]:
    """Every start and the raw download once per round; the order of the starts rotates."""
    rows: list[dict[str, Any]] = []
    for round_ in range(repeats):
        order = STARTS[round_ % len(STARTS) :] + STARTS[: round_ % len(STARTS)]
        starts: dict[str, Start] = {}
        for kind in order:
            common.say(f"round {round_ + 1}/{repeats}: {kind}")
            starts[kind] = bench.start(kind, shard_set, round_)
        answers = {kind: start.token_ids for kind, start in starts.items()}
        if len(set(answers.values())) != 1:
            raise common.BenchmarkError(f"the servers answered differently: {answers}")
        for kind, start in starts.items():
            row = {"round": round_, "start": kind, **asdict(start), "pod_s": start.pod_s}
            row.pop("token_ids")
            rows.append(row)
        rows.append({"round": round_, "start": RAW, "download_s": bench.raw_download(shard_set)})
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of every figure per start, and the ratios paired within rounds."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        rounds.setdefault(row["round"], {})[row["start"]] = row
    by_round = list(rounds.values())
    starts = {
        kind: {
            figure: common.spread([r[kind][figure] for r in by_round])
            for figure in FIGURE_NAMES
            if all(r[kind][figure] is not None for r in by_round)
        }
        for kind in STARTS
    }
    loads = [
        r[RAW]["download_s"] / r[PATCHED]["weights_s"] for r in by_round if r[PATCHED]["weights_s"]
    ]
    return {
        "starts": starts,
        "raw_download_s": common.spread([r[RAW]["download_s"] for r in by_round]),
        "patched_pod_over_local_disk": common.spread(
            [r[PATCHED]["pod_s"] / r[DISK]["pod_s"] for r in by_round]
        ),
        "patched_pod_over_s3_download": common.spread(
            [r[PATCHED]["pod_s"] / r[DOWNLOAD]["pod_s"] for r in by_round]
        ),
        "patched_load_speed_over_raw_download": common.spread(loads) if loads else None,
    }


# The rows of the second table: what each ratio is called, and its key in the summary.
RATIO_NAMES: Final = {
    "raw_download_s": "raw download of the rank files, s",
    "patched_pod_over_local_disk": "to the first completion: patched / stock, local disk",
    "patched_pod_over_s3_download": "to the first completion: patched / stock, S3 download",
    "patched_load_speed_over_raw_download": "patched weight load speed / raw download",
}


def print_report(summary: Mapping[str, Any], model_bytes: int, shard_set: ShardSet) -> None:
    """The medians of every start, then the raw download and the ratios."""
    rows = [
        [kind, *(summary["starts"][kind].get(f, {}).get("median") for f in FIGURE_NAMES)]
        for kind in STARTS
    ]
    common.print_table(
        f"Starting a {model_bytes / common.GB:.2f} GB model through vLLM, seconds (medians); "
        f"its serialization took {shard_set.serialize_s:.1f} s",
        ["start", *FIGURE_NAMES.values()],
        rows,
    )

    def shown(values: Mapping[str, float] | None) -> str:
        if values is None:
            return "-"
        return f"{values['median']:.3g} ({values['min']:.3g}-{values['max']:.3g})"

    common.print_table(
        "Paired within rounds",
        ["figure", "median (range)"],
        [[name, shown(summary[key])] for key, name in RATIO_NAMES.items()],
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    parser.add_argument("--hidden-size", type=int, default=1024, help="default 1024")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        choices=TENSOR_PARALLEL_SIZES,
        default=1,
        help="default 1",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--work", type=Path, default=SCRATCH, help="work directory")
    parser.add_argument("--output", type=Path, help="result file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if shutil.which("curl") is None:
        parser.error("curl is needed for the raw download")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Make the model and its shard set, time every start, print the table, write the result."""
    args = parse_args(argv)
    started = common.utc_now()
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    engine.engine_bin()
    model = work / "model"
    model_bytes = make_model(model, args)
    common.say(f"wrote a {model_bytes / common.GB:.2f} GB model")
    with common.s3_store(None, None) as store:
        key = f"bench-engine-{secrets.token_hex(4)}"
        try:
            model_uri = upload_directory(store.client(), model, store.bucket, f"{key}/model")
            bench = Bench(store, work, model, model_uri, args.tensor_parallel_size)
            common.say(f"serializing at TP {bench.tp} with vLLM")
            shard_set = bench.serialize(key)
            rows = run_rounds(bench, shard_set, args.repeats)
        finally:
            store.delete_prefix(key)
    summary = summarize(rows)
    print_report(summary, model_bytes, shard_set)
    path = common.write_result(
        NAME,
        {
            "options": {
                "layers": args.layers,
                "hidden_size": args.hidden_size,
                "vocab": args.vocab,
                "tensor_parallel_size": args.tensor_parallel_size,
                "repeats": args.repeats,
                "num_readers": NUM_READERS,
            },
            "model_bytes": model_bytes,
            "set_bytes": sum(shard_set.sizes),
            "serialize_s": shard_set.serialize_s,
            "versions": shard_set.versions,
            "runs": rows,
            **summary,
        },
        path=args.output,
        started=started,
    )
    print(f"results written to {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
