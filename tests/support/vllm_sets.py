"""Shard sets made by vLLM itself and by `preshard reshard`, for the engine tier.

Both run as their images run them: `preshard serialize` with the real `VllmEngine` and
`preshard reshard` in the serializer image's environment (vLLM's CPU build, `.venv-engine`),
`preshard verify --deep` in the tools image's (this virtualenv).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from preshard.contract.layout import S3Location
from preshard_devenv import engine
from preshard_devenv.s3server import S3Bucket, S3Server
from tests.support.commands import pod_env, run_preshard
from tests.support.models import StoredSet, fetch_set

# vLLM's CPU workers bind to the cores; TP 4 on two cores puts two workers on each.
OMP_BIND: Final = {1: "0|1", 2: "0|1", 4: "0|1|0|1"}


def serialize_with_vllm(
    s3_server: S3Server, bucket: S3Bucket, source: str, tp: int, key: str, work: Path
) -> StoredSet:
    """The model at `source` serialized by vLLM at TP `tp`, stored as `.../reshard/<key>/`."""
    location = S3Location.parse(f"s3://{bucket.name}/reshard/{key}/")
    env = {
        **pod_env(s3_server, work / f"home-{key}"),
        **engine.serializer_image().env,
        "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND[tp],
    }
    args = ["serialize", "--model", source, "--tensor-parallel-size", str(tp)]
    args += ["--dtype", "float32", "--max-model-len", "256", "--dest", location.uri]
    args += ["--artifact-key", key, "--scratch-dir", str(work / f"scratch-{key}")]
    outcome = run_preshard(
        engine.engine_bin() / "preshard", args, env, work / f"serialize-{key}.log", timeout=900
    )
    assert outcome.vllm_version == "0.32.0"
    return fetch_set(bucket, location, outcome, work / key)


def reshard_set(
    s3_server: S3Server, bucket: S3Bucket, source: StoredSet, tp: int, name: str, work: Path
) -> StoredSet:
    """`source` resharded to TP `tp` by `preshard reshard`, then verified with `--deep`."""
    location = S3Location.parse(f"s3://{bucket.name}/reshard/{name}/")
    env = {**pod_env(s3_server, work / f"home-{name}"), **engine.serializer_image().env}
    args = ["reshard", source.location.uri, "--to-tensor-parallel-size", str(tp)]
    args += ["--dest", location.uri, "--scratch-dir", str(work / f"scratch-{name}")]
    outcome = run_preshard(
        engine.engine_bin() / "preshard", args, env, work / f"reshard-{name}.log", timeout=300
    )
    run_preshard(
        Path(sys.executable).with_name("preshard"),
        ["verify", location.uri, "--tensor-parallel-size", str(tp), "--deep"],
        {**pod_env(s3_server, work / "tools-home"), **engine.tools_env()},
        work / f"verify-{name}.log",
        timeout=120,
    )
    return fetch_set(bucket, location, outcome, work / name)
