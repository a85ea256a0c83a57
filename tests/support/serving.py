"""What a patched Deployment serves: its serving pod, the runner's directory of that pod, the
flags and environment of its container, and its shard set read the way its vLLM reads it."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Final

import pytest
from kubernetes import client as k8s

from preshard_devenv.podrunner import PodRunner
from preshard_devenv.tinymodel import TinyModel
from tests.support import shardedmodels as shm
from tests.support.cluster import pods
from tests.support.models import assert_shards_match

Manifest = dict[str, Any]

MODEL_VOLUME: Final = "preshard-model"
INIT_CONTAINER: Final = "preshard-fetch-config"


def serving_pod(api: k8s.ApiClient, namespace: str, deployment: str) -> Any | None:
    """The Running pod of a patched Deployment whose config was fetched, if there is one."""
    for pod in pods(api, namespace, f"app={deployment}"):
        if pod.metadata.deletion_timestamp is not None or pod.status.phase != "Running":
            continue
        for status in pod.status.init_container_statuses or []:
            terminated = status.state.terminated if status.state else None
            if status.name == INIT_CONTAINER and terminated and terminated.exit_code == 0:
                return pod
    return None


def pod_dir(runner: PodRunner, namespace: str, pod_name: str) -> Path:
    """The runner's local directory of one pod (volumes, logs)."""
    (found,) = (runner.work_dir / namespace).glob(f"{pod_name}-*")
    return found


def container_flags(deployment: Manifest) -> tuple[int, str, Manifest]:
    """The TP size, the load format and the tensorizer JSON a patched Deployment names."""
    args = shm.vllm_args(deployment)
    tp = int(shm.flag(args, "--tensor-parallel-size") or 0)
    load_format = shm.flag(args, "--load-format") or ""
    extra: Manifest = json.loads(shm.flag(args, "--model-loader-extra-config") or "{}")
    return tp, load_format, extra


def container_env(
    api: k8s.ApiClient, namespace: str, deployment: Manifest, container: str = "vllm"
) -> dict[str, str]:
    """A container's environment as the kubelet resolves it (Secret references read)."""
    core = k8s.CoreV1Api(api)
    spec = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container
    )
    env: dict[str, str] = {}
    for variable in spec.get("env") or []:
        reference = (variable.get("valueFrom") or {}).get("secretKeyRef")
        if reference is None:
            env[variable["name"]] = variable.get("value", "")
            continue
        secret = core.read_namespaced_secret(reference["name"], namespace)
        env[variable["name"]] = base64.b64decode((secret.data or {})[reference["key"]]).decode()
    return env


def load_like_vllm(
    api: k8s.ApiClient,
    namespace: str,
    deployment: Manifest,
    model: TinyModel,
    directory: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    key: bytes | None = None,
) -> list[Path]:
    """Read every rank file the Deployment names, as its vLLM would, and compare the tensors.

    The URI template and the TP size come from the container's args; the credentials and the
    endpoint from its environment (tensorizer's S3 reader takes the endpoint from
    `AWS_ENDPOINT_URL_S3`, as in the pod). Returns the local copies.
    """
    from tensorizer.stream_io import open_stream  # noqa: PLC0415 - heavy, only where loading

    tp, load_format, extra = container_flags(deployment)
    assert load_format == "tensorizer"
    template = str(extra["tensorizer_uri"])
    assert "%03d" in template
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in container_env(api, namespace, deployment).items():
        monkeypatch.setenv(name, value)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(tp):
        path = directory / f"rank-{rank}.tensors"
        # One read to the end: the stream does not know its length, so sized reads past
        # the end fail instead of returning short.
        with open_stream(template % rank, "rb") as stream:
            path.write_bytes(stream.read())
        paths.append(path)
    assert_shards_match(model, paths, key=key)
    return paths
