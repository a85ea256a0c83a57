"""The controller at scale: N ShardedModels on a real control plane, against the cluster's floor.

For each size N, in a fresh local cluster (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok fake nodes):

1. N vLLM-style Deployments exist (`vllm serve org/model-<i>`, `replicas: 0`); the operator
   (`preshard run`, cluster-wide as the Helm chart runs it) starts and lists them.
2. Apply: a pool of API clients creates N ShardedModels at once. The operator probes each shard
   set with a verify Job; kwok completes the Job's pod about a second after it starts, with
   the outcome `verify ok`, so the set is "already serialized", the Deployment is patched and
   the ShardedModel turns Ready.
3. Measured from the start of apply: all Jobs created, all Jobs complete, all Ready, and the
   operator's last write (settled); the operator's peak RSS and CPU time; its API requests by
   verb and resource. kube-apiserver's `apiserver_request_total` has no user label, so the
   operator runs as its own user and the API server's audit log, written for that user only,
   tells its requests apart (with their response codes); the metric gives every client's
   requests beside them.
4. Idle: `--idle-seconds` with nothing to do. Every operator request in that window counts;
   the target is no write at all.
5. Restart: the operator is stopped and started again with the N ShardedModels Ready, as a
   `helm upgrade` or a lost node restarts it. Its first list hands it all N at once, the
   sharpest burst it can see: measured until every ShardedModel has had a reconcile pass and
   the operator has neither passed nor sent a request for `--quiet-seconds`, its peak RSS (and
   its RSS second by second), CPU time, passes and requests; the target is no write at all (a
   write here would be a status rewritten or, worse, N Deployments patched and rolled out
   again).
6. Baseline: with the operator stopped, the same pool of clients creates the same N verify Jobs
   directly. The time until all complete is the floor this cluster sets on this machine in
   this run, and `Ready / baseline` the operator's cost over that floor.
7. Baseline with targets: in a namespace of their own, the same N Deployments; then the clients
   create the same N verify Jobs and, as each completes, send the operator's own JSON patch
   (`patching.patch_deployment`, `deployment_patch`, through `kube.Kube`) to its Deployment.
   The time until every patched template is rolled out is the floor of all the cluster work a
   ShardedModel's Ready stands for (the Jobs, and the Deployment controller's rollouts), and
   `Ready / baseline with targets` the operator's own cost over it: its CPU, and the API
   server's for its watches and its other writes (status, events, finalizers).
8. Apply alone: with the operator still stopped, the same clients apply the same N
   ShardedModels into a namespace of their own. Its time is the apply's floor on this machine:
   the API server and the clients without the operator's CPU beside them.

With `--other-pods P`, P pods that are not preshard's (another workload's, bound to the kwok
nodes and running) are in the cluster from before the operator's first start: what a cluster's
other workloads cost the operator. Its pod stream asks the API server for preshard's pods only
(`handlers.POD_SELECTOR`); an operator that watched every pod listed and held them all.

Why `replicas: 0`: the operator never touches replicas, and a running vLLM pod per model would
measure the scheduler and kwok (1000 pods asking for GPUs the fake nodes would need to hold)
rather than the controller. The Deployment controller still rolls each patched template out (a
new ReplicaSet, a status update), so the operator sees the Deployment events it would see in
production, minus those of the pods.

Why `--kube-api-qps`: kube-controller-manager's controllers each talk to the API server at 20
requests per second by default, and the Job controller spends about six requests on a Job that
runs one pod (create the pod, three status updates, two events): about 3.4 Jobs a second, 300 s
for 1000 Jobs, whatever the operator does. The benchmark raises that limit (and the
scheduler's) by default so the floor is this machine, not a client-side rate limiter; 0 keeps
Kubernetes' defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import queue
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, cast

import urllib3
from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from benchmarks import common, profile
from preshard.api import models
from preshard.builders import Manifest, jobs, patching
from preshard.builders.identity import artifact_key, serializer_vllm_version
from preshard.builders.shardset import Owner, ShardSet
from preshard.controller.kube import Kube
from preshard.controller.metrics import RECONCILE_PASSES
from preshard.settings import Settings
from preshard_devenv import nodes, procs, workloads
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.demo import install_crd
from preshard_devenv.operatorprocess import OperatorProcess

NAME: Final = "controller"
# kube-apiserver's only per-user metric (`authenticated_user_requests`) names a few well-known
# users and folds every other into `other`. Running the operator as `admin` makes its request
# count readable from /metrics too, a cross-check of the audit log.
OPERATOR_USER: Final = "admin"
NAMESPACE: Final = "models"
BASELINE_NAMESPACE: Final = "baseline"
TARGETS_NAMESPACE: Final = "baseline-targets"
# The ShardedModels applied again with the operator stopped: the apply's own floor.
APPLY_NAMESPACE: Final = "apply-alone"
# The pods of `--other-pods`: another workload's.
OTHERS_NAMESPACE: Final = "others"
TENSOR_PARALLEL_SIZE: Final = 2
REPLICAS: Final = 0
WATCH_SECONDS: Final = 5
POLL_SECONDS: Final = 0.25
STARTUP_QUIET_SECONDS: Final = 3.0
STARTUP_TIMEOUT_SECONDS: Final = 120.0
WRITE_VERBS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"})

# The targets this benchmark checks.
READY_TARGET_SECONDS: Final = 300.0
PEAK_RSS_TARGET_MIB: Final = 300.0
WRITES_PER_RESOURCE_TARGET: Final = 5.0

# Audit verbs as `apiserver_request_total` spells them, so both tables read alike.
_AUDIT_VERBS: Final = {
    "create": "POST",
    "update": "PUT",
    "patch": "PATCH",
    "delete": "DELETE",
    "deletecollection": "DELETECOLLECTION",
    "get": "GET",
    "list": "LIST",
    "watch": "WATCH",
}
_SAMPLE: Final = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)"
)
_LABEL: Final = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LOG_LEVEL: Final = re.compile(r"\[(ERROR|WARNING|CRITICAL)\s*\]")

Log = Callable[[str], None]
RequestKey = tuple[str, str]


def resource_name(resource: str, group: str, subresource: str) -> str:
    """A resource as kubectl names it (`jobs.batch`, `shardedmodels.preshard.dev/status`)."""
    name = f"{resource}.{group}" if group else resource
    return f"{name}/{subresource}" if subresource else name


# The cluster and its audit log --------------------------------------------------------------


class BenchmarkCluster(LocalCluster):
    """A local cluster with extra flags for some of its components."""

    def __init__(self, work_dir: Path, extra_args: Mapping[str, Sequence[str]]) -> None:
        super().__init__(work_dir)
        self._extra_args = {name: list(args) for name, args in extra_args.items()}

    def _start(self, name: str, argv: list[str], **kwargs: Any) -> procs.Process:
        # LocalCluster takes no extra component flags, so they join the argv here; a restarted
        # API server passes its argv again, hence only the flags it does not have yet.
        extra = [arg for arg in self._extra_args.get(name, ()) if arg not in argv]
        return super()._start(name, [*argv, *extra], **kwargs)


def component_args(audit_dir: Path, user: str, qps: int) -> dict[str, list[str]]:
    """API server flags that audit `user` (writing the policy file), and the client limits
    of kube-controller-manager and kube-scheduler (`qps` 0: their defaults)."""
    audit_dir.mkdir(parents=True, exist_ok=True)
    policy = audit_dir / "policy.json"
    policy.write_text(json.dumps(audit_policy(user)))
    args = {
        "kube-apiserver": [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={audit_dir / 'audit.log'}",
            "--audit-log-format=json",
            "--audit-log-maxsize=0",
        ]
    }
    if qps > 0:
        limits = [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"]
        args["kube-controller-manager"] = limits
        args["kube-scheduler"] = limits
    return args


def audit_policy(user: str) -> dict[str, Any]:
    """One line per request of `user` when it completes (metadata only), nothing for others."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived", "ResponseStarted"],
        "rules": [{"level": "Metadata", "users": [user]}, {"level": "None"}],
    }


@dataclass(frozen=True)
class Request:
    """One request of the audited user."""

    at: float
    """When it arrived (wall clock)."""
    verb: str
    resource: str
    code: int
    selector: str = ""
    """The label selector a LIST or WATCH asked for."""

    @property
    def write(self) -> bool:
        """Whether it asked to change something."""
        return self.verb in WRITE_VERBS


def parse_audit_event(line: str) -> Request | None:
    """A request from one audit log line (None for a line that is not a completed request)."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    if event.get("kind") != "Event" or event.get("stage") not in ("ResponseComplete", "Panic"):
        return None
    verb = str(event.get("verb", ""))
    uri = urllib.parse.urlsplit(str(event.get("requestURI", "")))
    ref = event.get("objectRef")
    if ref and ref.get("resource"):
        resource = resource_name(
            ref["resource"], ref.get("apiGroup", ""), ref.get("subresource", "")
        )
    else:
        resource = uri.path
    return Request(
        at=datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp(),
        verb=_AUDIT_VERBS.get(verb, verb.upper()),
        resource=resource,
        code=int((event.get("responseStatus") or {}).get("code", 0)),
        selector=urllib.parse.parse_qs(uri.query).get("labelSelector", [""])[0],
    )


class AuditLog:
    """The audit log, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[Request] = []
        self._offset = 0

    def poll(self) -> None:
        """Read the complete lines written since the last poll."""
        if not self.path.exists():
            return
        with self.path.open("rb") as log:
            log.seek(self._offset)
            data = log.read()
        end = data.rfind(b"\n")
        if end < 0:
            return
        for line in data[:end].decode(errors="replace").splitlines():
            request = parse_audit_event(line)
            if request is not None:
                self.requests.append(request)
        self._offset += end + 1

    def last(self, *, writes_only: bool) -> float | None:
        """When the latest request (or write) arrived."""
        moments = [r.at for r in self.requests if r.write or not writes_only]
        return max(moments) if moments else None

    def window(self, start: float, end: float) -> list[Request]:
        """The requests that arrived in `[start, end)`."""
        return [r for r in self.requests if start <= r.at < end]

    def wait_quiet(
        self, quiet: float, timeout: float, *, writes_only: bool, since: float
    ) -> float | None:
        """Wait until no request (or write) arrived for `quiet` seconds; returns the time of
        the last one after `since` (or `since` when there was none), None on timeout."""

        def quiet_since() -> float | None:
            self.poll()
            last = max(self.last(writes_only=writes_only) or since, since)
            return last if time.time() - last >= quiet else None

        try:
            return procs.wait_for(
                quiet_since, timeout=timeout, interval=POLL_SECONDS, what=f"{quiet:.0f}s quiet"
            )
        except TimeoutError:
            return None


def stream_selectors(requests: Iterable[Request]) -> dict[str, list[str]]:
    """The label selectors of the LISTs and WATCHes, by resource ("" for none): what the API
    server sent the operator."""
    selectors: dict[str, set[str]] = {}
    for request in requests:
        if request.verb in ("LIST", "WATCH"):
            selectors.setdefault(request.resource, set()).add(request.selector)
    return {resource: sorted(found) for resource, found in sorted(selectors.items())}


def count_requests(requests: Iterable[Request]) -> Counter[RequestKey]:
    """Requests by (verb, resource)."""
    return Counter((r.verb, r.resource) for r in requests)


def count_refused(requests: Iterable[Request]) -> Counter[RequestKey]:
    """Requests the API server refused, by (verb, resource with the HTTP code)."""
    return Counter((r.verb, f"{r.resource} ({r.code})") for r in requests if r.code >= 400)


@dataclass(frozen=True)
class MetricsSnapshot:
    """Counters read from kube-apiserver's /metrics."""

    requests: dict[RequestKey, float]
    """`apiserver_request_total` summed over codes and versions: every client's requests."""
    operator_requests: float
    """`authenticated_user_requests{username="admin"}`: the operator's requests."""


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample of a Prometheus text exposition: its name, labels and value."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None:
            yield match["name"], dict(_LABEL.findall(match["labels"] or "")), float(match["value"])


def parse_metrics(text: str) -> MetricsSnapshot:
    """The counters this benchmark reads, from the Prometheus text format."""
    requests: dict[RequestKey, float] = {}
    operator = 0.0
    for name, labels, value in samples(text):
        if name == "apiserver_request_total":
            resource = (
                resource_name(labels["resource"], labels.get("group", ""), labels["subresource"])
                if labels.get("resource")
                else "(non-resource)"
            )
            key = (labels.get("verb", ""), resource)
            requests[key] = requests.get(key, 0.0) + value
        elif name == "authenticated_user_requests" and labels["username"] == OPERATOR_USER:
            operator += value
    return MetricsSnapshot(requests=requests, operator_requests=operator)


def scrape_metrics(cluster: LocalCluster) -> MetricsSnapshot:
    """GET /metrics as the cluster admin."""
    with urllib.request.urlopen(  # noqa: S310 - the local API server's https URL
        f"{cluster.server}/metrics", timeout=30, context=cluster.ssl_context()
    ) as response:
        return parse_metrics(response.read().decode())


def metrics_delta(after: MetricsSnapshot, before: MetricsSnapshot) -> Counter[RequestKey]:
    """Every client's requests between two snapshots."""
    delta: Counter[RequestKey] = Counter()
    for key, value in after.requests.items():
        grown = round(value - before.requests.get(key, 0.0))
        if grown > 0:
            delta[key] = grown
    return delta


# Following Jobs and ShardedModels -----------------------------------------------------------


@dataclass
class Observations:
    """When each Job and ShardedModel reached each state, by wall-clock time."""

    job_created: dict[str, float] = field(default_factory=dict)
    job_done: dict[str, float] = field(default_factory=dict)
    job_failed: set[str] = field(default_factory=set)
    ready_at: dict[str, float] = field(default_factory=dict)
    ready_now: set[str] = field(default_factory=set)
    reasons: dict[str, str] = field(default_factory=dict)
    ready_lost: int = 0
    changes: list[float] = field(default_factory=list)
    rolled_out: set[str] = field(default_factory=set)
    """Deployments whose current template is rolled out."""
    patched_rolled_out: dict[str, float] = field(default_factory=dict)
    """When each Deployment's patched template was first seen rolled out."""


class Watcher:
    """Follows the Jobs, and optionally the ShardedModels or the Deployments, of one namespace
    through watch streams; `on_job_done` is called with each Job's name when it first ends."""

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        *,
        models_too: bool = False,
        deployments_too: bool = False,
        on_job_done: Callable[[str], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.seen = Observations()
        self._on_job_done = on_job_done
        self._lock = threading.Lock()
        self._stop = threading.Event()
        follow: list[tuple[str, str, str, Callable[[dict[str, Any]], None]]] = [
            ("batch", "v1", "jobs", self._on_job)
        ]
        if models_too:
            follow.append((models.GROUP, models.VERSION, models.PLURAL, self._on_model))
        if deployments_too:
            follow.append(("apps", "v1", "deployments", self._on_deployment))
        self._threads = [
            threading.Thread(target=self._follow, args=args, daemon=True) for args in follow
        ]

    def start(self) -> Watcher:
        """Start following."""
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop following (waits for the current watch request to end)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=WATCH_SECONDS + 10)

    def snapshot(self) -> Observations:
        """A copy of what was seen so far."""
        with self._lock:
            return copy.deepcopy(self.seen)

    def count(self, what: Callable[[Observations], int]) -> int:
        """One number from what was seen so far, without copying it."""
        with self._lock:
            return what(self.seen)

    def wait_ready(self, size: int, timeout: float, what: str) -> None:
        """Wait until `size` ShardedModels are Ready now; `TimeoutError` after `timeout`."""
        procs.wait_for(
            lambda: self.count(lambda seen: len(seen.ready_now)) >= size,
            timeout=timeout,
            interval=POLL_SECONDS,
            what=what,
        )

    def _follow(
        self, group: str, version: str, plural: str, handle: Callable[[dict[str, Any]], None]
    ) -> None:
        with self.cluster.api_client() as api:
            custom = k8s.CustomObjectsApi(api)
            version_seen: str | None = None
            while not self._stop.is_set():
                try:
                    if version_seen is None:
                        listing = cast(
                            dict[str, Any],
                            custom.list_namespaced_custom_object(
                                group, version, self.namespace, plural
                            ),
                        )
                        for item in listing["items"]:
                            handle(item)
                        version_seen = listing["metadata"]["resourceVersion"]
                    # The watch helper has no type annotations.
                    stream = watch.Watch()  # type: ignore[no-untyped-call]
                    for event in stream.stream(  # type: ignore[no-untyped-call]
                        custom.list_namespaced_custom_object,
                        group,
                        version,
                        self.namespace,
                        plural,
                        resource_version=version_seen,
                        timeout_seconds=WATCH_SECONDS,
                        deserialize=False,
                    ):
                        item = event["object"]
                        handle(item)
                        version_seen = item["metadata"]["resourceVersion"]
                        if self._stop.is_set():
                            stream.stop()  # type: ignore[no-untyped-call]
                except (ApiException, urllib3.exceptions.HTTPError, OSError):
                    # Expired (410) or the connection dropped: list again and carry on.
                    version_seen = None
                    self._stop.wait(0.5)

    def _on_job(self, job: dict[str, Any]) -> None:
        now = time.time()
        name = job["metadata"]["name"]
        with self._lock:
            self.seen.job_created.setdefault(name, now)
            ended = name in self.seen.job_done
            for condition in (job.get("status") or {}).get("conditions") or []:
                if condition.get("status") != "True":
                    continue
                if condition.get("type") == "Complete":
                    self.seen.job_done.setdefault(name, now)
                elif condition.get("type") == "Failed":
                    self.seen.job_failed.add(name)
                    self.seen.job_done.setdefault(name, now)
            ends_now = not ended and name in self.seen.job_done
        if ends_now and self._on_job_done is not None:
            self._on_job_done(name)

    def _on_deployment(self, deployment: dict[str, Any]) -> None:
        now = time.time()
        name = deployment["metadata"]["name"]
        rolled_out = patching.rollout_complete(deployment)
        patched = patching.applied_artifact_key(deployment) is not None
        with self._lock:
            if not rolled_out:
                self.seen.rolled_out.discard(name)
                return
            self.seen.rolled_out.add(name)
            if patched:
                self.seen.patched_rolled_out.setdefault(name, now)

    def _on_model(self, resource: dict[str, Any]) -> None:
        now = time.time()
        name = resource["metadata"]["name"]
        ready = workloads.condition(resource, "Ready")
        with self._lock:
            self.seen.changes.append(now)
            if ready is not None:
                self.seen.reasons[name] = str(ready.get("reason", ""))
            if ready is not None and ready.get("status") == "True":
                self.seen.ready_at.setdefault(name, now)
                self.seen.ready_now.add(name)
            elif name in self.seen.ready_now:
                self.seen.ready_now.discard(name)
                self.seen.ready_lost += 1


# The workload -------------------------------------------------------------------------------


def model_name(index: int) -> str:
    """The i-th ShardedModel's name."""
    return f"model-{index}"


def deployment_name(index: int) -> str:
    """The i-th target Deployment's name."""
    return f"vllm-{index}"


def vllm_container(index: int) -> dict[str, Any]:
    """A vLLM container as people write it: `vllm serve org/model-<i>`."""
    return workloads.vllm_container(f"org/model-{index}", port=None)


def model_spec(index: int) -> dict[str, Any]:
    """A ShardedModel spec with one TP size and one target Deployment."""
    return {
        "model": {"id": f"org/model-{index}", "revision": "main"},
        "storage": {
            "uri": "s3://models/shards",
            "endpoint": "http://s3.storage:8333",
            "credentialsSecretRef": {"name": "s3"},
        },
        "tensorParallelSizes": [TENSOR_PARALLEL_SIZE],
        "targets": [{"name": deployment_name(index)}],
    }


def _shard_set(
    index: int, namespace: str, settings: Settings
) -> tuple[models.ShardedModelSpec, ShardSet]:
    spec = models.parse_spec(model_spec(index))
    image = spec.serialization.image or settings.serializer_image
    key = artifact_key(spec, TENSOR_PARALLEL_SIZE, namespace=namespace, serializer_image=image)
    return spec, ShardSet.for_spec(spec, TENSOR_PARALLEL_SIZE, key)


def plain_verify_job(index: int, namespace: str, settings: Settings) -> dict[str, Any]:
    """The verify Job the operator would create for the i-th model, without an owner."""
    spec, shard_set = _shard_set(index, namespace, settings)
    owner = Owner(name=model_name(index), namespace=namespace, uid="")
    manifest = jobs.build_verify_job(
        jobs.JobInput(owner=owner, spec=spec, shard_set=shard_set, settings=settings, run=1)
    )
    # Without a ShardedModel to own it, an owner reference would get it garbage-collected.
    del manifest["metadata"]["ownerReferences"]
    return manifest


def target_patch(
    index: int, namespace: str, deployment: Manifest, settings: Settings
) -> list[Manifest]:
    """The JSON patch the operator sends to point the i-th Deployment at its verified set."""
    spec, shard_set = _shard_set(index, namespace, settings)
    patched = patching.patch_deployment(
        deployment,
        patching.TargetInput(
            owner=Owner(name=model_name(index), namespace=namespace, uid=""),
            spec=spec,
            shard_set=shard_set,
            settings=settings,
            container=None,
            shard_vllm_version=serializer_vllm_version(spec, settings),
        ),
    )
    if isinstance(patched, patching.Refusal):
        raise RuntimeError(f"{patched.reason}: {patched.message}")
    return patching.deployment_patch(deployment, patched.deployment)


def in_parallel(
    cluster: LocalCluster,
    count: int,
    action: Callable[[k8s.ApiClient, int], object],
    workers: int,
) -> float:
    """Call `action(api, i)` for every i below `count` from `workers` threads, each with its own
    API client; returns the seconds it took."""

    def work(first: int) -> None:
        with cluster.api_client() as api:
            for index in range(first, count, workers):
                action(api, index)

    stopwatch = common.Stopwatch()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(work, w) for w in range(min(workers, count))]:
            future.result()
    return stopwatch.elapsed


def apply_models(cluster: LocalCluster, namespace: str, size: int, workers: int) -> float:
    """Create the N ShardedModels in `namespace` from `workers` clients; the seconds it took."""
    return in_parallel(
        cluster,
        size,
        lambda api, i: workloads.create_sharded_model(api, namespace, model_name(i), model_spec(i)),
        workers,
    )


def create_other_pods(
    cluster: LocalCluster, count: int, extra_nodes: Sequence[str], workers: int
) -> float:
    """`count` pods of another workload, bound to the kwok nodes in turn; the seconds until
    kwok runs them all."""
    node_names = [*nodes.GPU_NODES, *extra_nodes]
    stopwatch = common.Stopwatch()
    with cluster.api_client() as admin:
        create_namespace(admin, OTHERS_NAMESPACE)

    def create(api: k8s.ApiClient, index: int) -> None:
        pod: Manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"other-{index:05d}", "labels": {"app": "other"}},
            "spec": {
                "nodeName": node_names[index % len(node_names)],
                "containers": [{"name": "app", "image": "registry.example/other:1"}],
            },
        }
        k8s.CoreV1Api(api).create_namespaced_pod(OTHERS_NAMESPACE, k8s.V1Pod.model_validate(pod))

    in_parallel(cluster, count, create, workers)
    with cluster.api_client() as admin:
        core = k8s.CoreV1Api(admin)

        def all_running() -> bool:
            listed = core.list_namespaced_pod(
                OTHERS_NAMESPACE, field_selector="status.phase=Running"
            )
            return len(listed.items) == count

        procs.wait_for(all_running, timeout=300, interval=1.0, what="kwok to run the other pods")
    return stopwatch.elapsed


def create_namespace(api: k8s.ApiClient, name: str) -> None:
    """Create a namespace."""
    k8s.CoreV1Api(api).create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))


def add_kwok_nodes(api: k8s.ApiClient, pods: int) -> list[str]:
    """Enough kwok GPU nodes besides the cluster's own that `pods` pods fit at once, so node
    capacity never limits the measurement; returns the new nodes' names."""
    template = next(m for m in nodes.manifests() if m["metadata"]["name"] == nodes.GPU_NODES[0])
    per_node = int(nodes.CAPACITY["pods"])
    extra = max(0, math.ceil(pods / per_node) - len(nodes.GPU_NODES))
    names = [f"kwok-bench-{i}" for i in range(extra)]
    core = k8s.CoreV1Api(api)
    for name in names:
        manifest = copy.deepcopy(template)
        manifest["metadata"]["name"] = name
        manifest["metadata"]["labels"]["kubernetes.io/hostname"] = name
        core.create_node(k8s.V1Node.model_validate(manifest))

    def all_ready() -> bool:
        for name in names:
            status = core.read_node(name).status
            conditions = (status.conditions if status else None) or []
            if not any(c.type == "Ready" and c.status == "True" for c in conditions):
                return False
        return True

    procs.wait_for(
        all_ready, timeout=60, interval=POLL_SECONDS, what="kwok to make the extra nodes Ready"
    )
    return names


# One size -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """How to run every size."""

    idle_seconds: float
    quiet_seconds: float
    timeout_seconds: float
    workers: int
    kube_api_qps: int
    profile: bool = False
    other_pods: int = 0


@dataclass
class Checkpoint:
    """The operator's and the cluster's counters at one moment."""

    at: float
    usage: common.ProcessUsage
    cpu: dict[str, float]
    metrics: MetricsSnapshot
    passes: float
    """The operator's reconcile passes so far, from its own metrics."""

    @classmethod
    def take(cls, cluster: LocalCluster, pid: int, metrics_port: int) -> Checkpoint:
        """Read every counter now."""
        return cls(
            at=time.time(),
            usage=common.process_usage(pid),
            cpu=cluster_cpu(cluster),
            metrics=scrape_metrics(cluster),
            passes=reconcile_passes(metrics_port),
        )


def reconcile_passes(metrics_port: int) -> float:
    """The operator's reconcile passes so far, read from the metrics it serves."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(value for name, _, value in samples(text) if name == f"{RECONCILE_PASSES}_total")


def cluster_cpu(cluster: LocalCluster) -> dict[str, float]:
    """The CPU seconds each of the cluster's processes has used so far."""
    cpu: dict[str, float] = {}
    for name, process in cluster.processes.items():
        with contextlib.suppress(OSError):
            cpu[name] = common.process_usage(process.pid).cpu_seconds
    return cpu


@dataclass
class Run:
    """What one operator run went through, from apply to the end of the idle window."""

    size: int
    apply_s: float
    converged: bool
    settled_at: float | None
    before: Checkpoint
    after_converge: Checkpoint
    after_idle: Checkpoint
    seen: Observations
    changes_before_idle: int
    profile: dict[str, Any] | None = None


def run_size(size: int, options: Options, work: Path, say: Log) -> dict[str, Any]:
    """Everything measured for one size, in a cluster of its own."""
    cluster = BenchmarkCluster(
        work / "cluster",
        component_args(work / "audit", OPERATOR_USER, options.kube_api_qps),
    )
    load_before = common.load_average()
    stopwatch = common.Stopwatch()
    cluster.start()
    cluster_start_s = stopwatch.elapsed
    say(f"N={size}: cluster up in {cluster_start_s:.1f}s")
    try:
        with cluster.api_client() as admin:
            install_crd(admin)
            extra_nodes = add_kwok_nodes(admin, size + options.other_pods)
            create_namespace(admin, NAMESPACE)
            create_namespace(admin, BASELINE_NAMESPACE)
            create_namespace(admin, TARGETS_NAMESPACE)
            create_namespace(admin, APPLY_NAMESPACE)
        deployments_s = in_parallel(
            cluster,
            size,
            lambda api, i: workloads.create_deployment(
                api, NAMESPACE, deployment_name(i), container=vllm_container(i), replicas=REPLICAS
            ),
            options.workers,
        )
        say(f"N={size}: {size} Deployments in {deployments_s:.1f}s, {len(extra_nodes)} more nodes")
        if options.other_pods:
            others_s = create_other_pods(cluster, options.other_pods, extra_nodes, options.workers)
            say(f"N={size}: {options.other_pods} other pods running after {others_s:.1f}s")
        audit = AuditLog(work / "audit" / "audit.log")
        metrics_port = procs.free_port()
        operator = OperatorProcess(
            cluster.user_kubeconfig(OPERATOR_USER, ["system:masters"]),
            work / "operator",
            env={"PRESHARD_METRICS_PORT": str(metrics_port)},
        )
        stopwatch.restart()
        operator.start()
        try:
            if (
                audit.wait_quiet(
                    STARTUP_QUIET_SECONDS,
                    STARTUP_TIMEOUT_SECONDS,
                    writes_only=False,
                    since=time.time(),
                )
                is None
            ):
                raise RuntimeError("the operator kept sending requests after it started")
            startup_s = stopwatch.elapsed
            say(f"N={size}: operator listening and quiet after {startup_s:.1f}s")
            assert operator.process is not None
            run = drive(
                cluster,
                operator.process.pid,
                metrics_port,
                audit,
                size,
                options,
                say,
                profile_to=work / "operator.profile" if options.profile else None,
            )
            operator.stop()
            restart = restart_operator(cluster, operator, metrics_port, audit, size, options, say)
        finally:
            operator.stop()
        # Watch requests are logged when they end: some only ended with the operator.
        audit.poll()
        say(f"N={size}: baseline: {size} verify Jobs without the operator")
        baseline = run_baseline(cluster, size, options, say, targets=False)
        say(f"N={size}: baseline with targets: the same Jobs, each followed by its patch")
        targets_baseline = run_baseline(cluster, size, options, say, targets=True)
        apply_alone_s = apply_models(cluster, APPLY_NAMESPACE, size, options.workers)
        say(f"N={size}: {size} ShardedModels applied without the operator in {apply_alone_s:.1f}s")
    finally:
        cluster.stop()
    result = summarize(run, audit, baseline, targets_baseline, restart, operator.log())
    return {
        "size": size,
        "load_average": {"before": load_before, "after": common.load_average()},
        "cluster_start_s": round(cluster_start_s, 1),
        "extra_nodes": len(extra_nodes),
        "deployments_create_s": round(deployments_s, 2),
        "operator_startup_s": round(startup_s, 2),
        "operator_startup_requests": table_of(count_requests(audit.window(0, run.before.at))),
        **result,
        "apply_alone_s": round(apply_alone_s, 2),
    }


def drive(
    cluster: LocalCluster,
    pid: int,
    metrics_port: int,
    audit: AuditLog,
    size: int,
    options: Options,
    say: Log,
    *,
    profile_to: Path | None = None,
) -> Run:
    """Apply N ShardedModels, wait for Ready and for the operator to settle, then stay idle.

    With `profile_to`, py-spy samples the operator from apply until it has settled.
    """
    watcher = Watcher(cluster, NAMESPACE, models_too=True).start()
    profiling = contextlib.ExitStack()
    try:
        before = Checkpoint.take(cluster, pid, metrics_port)
        if profile_to is not None:
            profiling.enter_context(profile.recording(pid, profile_to))
        apply_s = apply_models(cluster, NAMESPACE, size, options.workers)
        say(f"N={size}: applied {size} ShardedModels in {apply_s:.1f}s")
        try:
            watcher.wait_ready(size, options.timeout_seconds, "every ShardedModel to be Ready")
            converged = True
        except TimeoutError:
            converged = False
        ready = watcher.count(lambda seen: len(seen.ready_now))
        say(f"N={size}: {ready}/{size} Ready after {time.time() - before.at:.1f}s")
        settled_at = audit.wait_quiet(
            options.quiet_seconds,
            max(options.timeout_seconds - (time.time() - before.at), 3 * options.quiet_seconds),
            writes_only=True,
            since=before.at,
        )
        after_converge = Checkpoint.take(cluster, pid, metrics_port)
        profiling.close()
        changes_before_idle = watcher.count(lambda seen: len(seen.changes))
        say(f"N={size}: settled; idle for {options.idle_seconds:.0f}s")
        time.sleep(options.idle_seconds)
        after_idle = Checkpoint.take(cluster, pid, metrics_port)
    finally:
        profiling.close()
        watcher.stop()
    return Run(
        size=size,
        apply_s=apply_s,
        converged=converged,
        settled_at=settled_at,
        before=before,
        after_converge=after_converge,
        after_idle=after_idle,
        seen=watcher.snapshot(),
        changes_before_idle=changes_before_idle,
        profile=(
            profile.summarise(profile_to.read_text().splitlines())
            if profile_to is not None
            else None
        ),
    )


def restart_operator(
    cluster: LocalCluster,
    operator: OperatorProcess,
    metrics_port: int,
    audit: AuditLog,
    size: int,
    options: Options,
    say: Log,
) -> dict[str, Any]:
    """Start the stopped operator again with the N ShardedModels Ready; what it then does.

    Measured from its start until every ShardedModel has had a reconcile pass and the operator
    has neither passed nor sent a request for `quiet_seconds`: its peak RSS, CPU time and passes,
    every request (the API server's audit log) and every change its ShardedModels saw. The
    operator is left running.
    """
    watcher = Watcher(cluster, NAMESPACE, models_too=True).start()
    try:
        watcher.wait_ready(
            size,
            options.timeout_seconds,
            "every ShardedModel to be listed Ready before the restart",
        )
        changes_before = watcher.count(lambda seen: len(seen.changes))
        start = time.time()
        operator.start(timeout=options.timeout_seconds)
        assert operator.process is not None
        progress = PassProgress(metrics_port, size, operator.process.pid)
        settled: float | None = None
        with contextlib.suppress(TimeoutError):
            settled = procs.wait_for(
                lambda: progress.settled(audit, options.quiet_seconds),
                timeout=options.timeout_seconds,
                interval=POLL_SECONDS,
                what="the restarted operator to pass over every ShardedModel and go quiet",
            )
        end = time.time()
        usage = common.process_usage(operator.process.pid)
        seen = watcher.snapshot()
    finally:
        watcher.stop()
    counts = count_requests(audit.window(start, end))
    settled_s = _round(settled - start if settled is not None else None)
    caught_up_s = _round(progress.caught_up - start if progress.caught_up is not None else None)
    peak_at, peak = max(progress.rss, key=lambda sample: sample[1])
    say(f"N={size}: restarted operator passed over all at {caught_up_s}s, quiet after {settled_s}s")
    return {
        "caught_up_s": caught_up_s,
        "settled_s": settled_s,
        "peak_rss_mib": _mib(usage.peak_rss_bytes),
        "largest_rss_sampled": {"mib": _mib(peak), "at_s": round(peak_at - start, 2)},
        "rss_mib": {"caught_up": _mib(progress.rss_caught_up), "settled": _mib(usage.rss_bytes)},
        "rss_mib_by_second": progress.rss_by_second(start),
        "cpu_s": round(usage.cpu_seconds, 2),
        "reconcile_passes_per_shardedmodel": round(progress.passes / size, 2),
        "requests": table_of(counts),
        "requests_total": sum(counts.values()),
        "writes": writes_of(counts),
        "shardedmodel_changes": len(seen.changes) - changes_before,
        "ready_lost": seen.ready_lost,
    }


class PassProgress:
    """A starting operator's reconcile passes, polled from its metrics, and its RSS."""

    def __init__(self, metrics_port: int, size: int, pid: int) -> None:
        self.metrics_port = metrics_port
        self.size = size
        self.pid = pid
        self.passes = 0.0
        self.last_pass = time.time()
        self.caught_up: float | None = None
        """When the passes first numbered one per ShardedModel."""
        self.rss_caught_up = 0
        self.rss: list[tuple[float, int]] = []
        """(moment, bytes) at every poll."""

    def rss_by_second(self, start: float) -> list[list[float]]:
        """`[seconds after start, MiB]`: the first sample of every whole second."""
        seconds: dict[int, list[float]] = {}
        for at, rss in self.rss:
            seconds.setdefault(int(at - start), [round(at - start, 2), _mib(rss)])
        return list(seconds.values())

    def settled(self, audit: AuditLog, quiet: float) -> float | None:
        """The moment of the last pass or request, once there is a pass per ShardedModel and
        neither for `quiet` seconds; None before."""
        now = time.time()
        self.rss.append((now, common.process_usage(self.pid).rss_bytes))
        passes = reconcile_passes(self.metrics_port)
        if passes > self.passes:
            self.passes, self.last_pass = passes, now
        if self.caught_up is None and passes >= self.size:
            self.caught_up, self.rss_caught_up = now, self.rss[-1][1]
        audit.poll()
        last = max(self.last_pass, audit.last(writes_only=False) or 0.0)
        return last if self.caught_up is not None and now - last >= quiet else None


def run_baseline(
    cluster: LocalCluster, size: int, options: Options, say: Log, *, targets: bool
) -> dict[str, Any]:
    """The same N verify Jobs, created directly: the floor the cluster sets.

    With `targets`, in a namespace of their own, the same N Deployments are created first (not
    timed), and each Job's completion is followed by the operator's patch of its Deployment:
    the floor then ends when every patched template is rolled out.
    """
    namespace = TARGETS_NAMESPACE if targets else BASELINE_NAMESPACE
    settings = Settings()
    manifests = [plain_verify_job(i, namespace, settings) for i in range(size)]
    index_of = {manifest["metadata"]["name"]: i for i, manifest in enumerate(manifests)}
    ended: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    watcher = Watcher(
        cluster,
        namespace,
        deployments_too=targets,
        on_job_done=(lambda name: ended.put(index_of[name])) if targets else None,
    ).start()

    def finished(seen: Observations) -> int:
        return len(seen.patched_rolled_out if targets else seen.job_done)

    try:
        deployments = create_targets(cluster, size, options, watcher) if targets else []
        cpu_before = cluster_cpu(cluster)
        start = time.time()
        with ThreadPoolExecutor(max_workers=options.workers) as pool:
            patchers = [
                pool.submit(patch_targets, cluster, ended, deployments, settings)
                for _ in range(options.workers if targets else 0)
            ]
            create_s = in_parallel(
                cluster,
                size,
                lambda api, i: k8s.BatchV1Api(api).create_namespaced_job(
                    namespace, k8s.V1Job.model_validate(manifests[i])
                ),
                options.workers,
            )
            with contextlib.suppress(TimeoutError):
                procs.wait_for(
                    lambda: (
                        watcher.count(finished) >= size
                        or any(patcher.done() for patcher in patchers)
                    ),
                    timeout=options.timeout_seconds,
                    interval=POLL_SECONDS,
                    what="every baseline Job to complete"
                    + (" and its patch to roll out" * targets),
                )
            for _ in patchers:
                ended.put(None)
            for patcher in patchers:
                patcher.result()
        cpu = _cpu_delta(cluster_cpu(cluster), cpu_before)
        seconds = time.time() - start
    finally:
        watcher.stop()
    seen = watcher.snapshot()
    last = seen.patched_rolled_out if targets else seen.job_done
    all_complete = max(last.values()) - start if len(last) >= size else None
    say(f"N={size}: baseline: {len(last)}/{size} done after {seconds:.1f}s")
    result: dict[str, Any] = {
        "create_s": round(create_s, 2),
        "jobs_complete_s": seconds_after(start, seen.job_done.values()),
        "all_complete_s": _round(all_complete),
        "jobs_failed": len(seen.job_failed),
        # Whether the floor is the machine's CPU: what the cluster used of what the cores gave.
        "cluster_cpu_s": cpu,
        "cpu_available_s": round(seconds * common.cores(), 1),
    }
    if targets:
        result["rollouts_complete_s"] = seconds_after(start, seen.patched_rolled_out.values())
    return result


def create_targets(
    cluster: LocalCluster, size: int, options: Options, watcher: Watcher
) -> list[Manifest]:
    """The N Deployments in the watcher's namespace, each rolled out; returns them as stored."""
    created: list[Manifest] = [{} for _ in range(size)]

    def create(api: k8s.ApiClient, index: int) -> None:
        created[index] = workloads.create_deployment(
            api,
            watcher.namespace,
            deployment_name(index),
            container=vllm_container(index),
            replicas=REPLICAS,
        )

    in_parallel(cluster, size, create, options.workers)
    procs.wait_for(
        lambda: watcher.count(lambda seen: len(seen.rolled_out)) >= size,
        timeout=options.timeout_seconds,
        interval=POLL_SECONDS,
        what="the baseline's Deployments to roll out",
    )
    return created


def patch_targets(
    cluster: LocalCluster,
    ended: queue.SimpleQueue[int | None],
    deployments: Sequence[Manifest],
    settings: Settings,
) -> None:
    """Patch the Deployment of each model whose Job ended, as the operator would, until None."""
    with cluster.api_client() as api:
        kube = Kube(api)
        while (index := ended.get()) is not None:
            deployment = deployments[index]
            namespace = deployment["metadata"]["namespace"]
            kube.patch_deployment(
                namespace,
                deployment["metadata"]["name"],
                target_patch(index, namespace, deployment, settings),
            )


# Summaries ----------------------------------------------------------------------------------


def seconds_after(start: float, moments: Iterable[float]) -> dict[str, float | None]:
    """The median, 90th percentile and last of some moments, in seconds after `start`."""
    offsets = sorted(m - start for m in moments)
    if not offsets:
        return {"p50": None, "p90": None, "max": None}
    return {
        "p50": round(statistics.median(offsets), 2),
        "p90": round(offsets[max(0, math.ceil(0.9 * len(offsets)) - 1)], 2),
        "max": round(offsets[-1], 2),
    }


def table_of(counts: Counter[RequestKey], per: int = 1) -> dict[str, float]:
    """`{"VERB resource": count / per}`, largest first."""
    return {
        f"{verb} {resource}": round(value / per, 3)
        for (verb, resource), value in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    }


def writes_of(counts: Counter[RequestKey]) -> int:
    """How many of the counted requests are writes."""
    return sum(value for (verb, _), value in counts.items() if verb in WRITE_VERBS)


def log_levels(text: str) -> dict[str, int]:
    """How many operator log lines were warnings and errors."""
    found = Counter(match.group(1) for match in _LOG_LEVEL.finditer(text))
    return {level.lower(): found.get(level, 0) for level in ("WARNING", "ERROR", "CRITICAL")}


def summarize(
    run: Run,
    audit: AuditLog,
    baseline: dict[str, Any],
    targets_baseline: dict[str, Any],
    restart: dict[str, Any],
    operator_log: str,
) -> dict[str, Any]:
    """The figures of one size, from the raw observations."""
    size, seen = run.size, run.seen
    start, idle_start, idle_end = run.before.at, run.after_converge.at, run.after_idle.at
    converge = audit.window(start, idle_start)
    idle = audit.window(idle_start, idle_end)
    converge_counts, idle_counts = count_requests(converge), count_requests(idle)
    all_ready = max(seen.ready_at.values()) - start if run.converged else None
    result: dict[str, Any] = {
        "apply_s": round(run.apply_s, 2),
        "converged": run.converged,
        "ready": len(seen.ready_now),
        "not_ready_reasons": dict(
            Counter(
                seen.reasons.get(model_name(i), "(no status)")
                for i in range(size)
                if model_name(i) not in seen.ready_now
            )
        ),
        "jobs": len(seen.job_created),
        "jobs_failed": len(seen.job_failed),
        "jobs_created_s": seconds_after(start, seen.job_created.values()),
        "jobs_complete_s": seconds_after(start, seen.job_done.values()),
        "ready_s": seconds_after(start, seen.ready_at.values()),
        "all_ready_s": _round(all_ready),
        "operator_profile": run.profile,
        "settled_s": _round(run.settled_at - start if run.settled_at is not None else None),
        "baseline": baseline,
        "ready_over_baseline": _round(common.ratio(all_ready, baseline["all_complete_s"])),
        "baseline_with_targets": targets_baseline,
        "ready_over_baseline_with_targets": _round(
            common.ratio(all_ready, targets_baseline["all_complete_s"])
        ),
        "operator": {
            "peak_rss_mib": _mib(run.after_idle.usage.peak_rss_bytes),
            "rss_mib": {
                "before_apply": _mib(run.before.usage.rss_bytes),
                "settled": _mib(run.after_converge.usage.rss_bytes),
                "after_idle": _mib(run.after_idle.usage.rss_bytes),
            },
            "cpu_s": {
                "startup": round(run.before.usage.cpu_seconds, 2),
                "converge": round(
                    run.after_converge.usage.cpu_seconds - run.before.usage.cpu_seconds, 2
                ),
                "idle": round(
                    run.after_idle.usage.cpu_seconds - run.after_converge.usage.cpu_seconds, 2
                ),
            },
            "log": log_levels(operator_log),
            "reconcile_passes_per_shardedmodel": round(
                (run.after_converge.passes - run.before.passes) / size, 2
            ),
        },
        "cluster_cpu_s": {
            "converge": _cpu_delta(run.after_converge.cpu, run.before.cpu),
            "idle": _cpu_delta(run.after_idle.cpu, run.after_converge.cpu),
            "converge_available": round((idle_start - start) * common.cores(), 1),
        },
        "requests": {
            "operator_per_shardedmodel": table_of(converge_counts, size),
            "operator_refused_per_shardedmodel": table_of(count_refused(converge), size),
            "operator_total": sum(converge_counts.values()),
            "operator_total_from_metrics": round(
                run.after_converge.metrics.operator_requests - run.before.metrics.operator_requests
            ),
            "operator_writes": writes_of(converge_counts),
            "operator_writes_per_shardedmodel": round(writes_of(converge_counts) / size, 2),
            "all_clients_per_shardedmodel": table_of(
                metrics_delta(run.after_converge.metrics, run.before.metrics), size
            ),
        },
        "idle": {
            "seconds": round(idle_end - idle_start, 1),
            "operator_requests": table_of(idle_counts),
            "operator_total": sum(idle_counts.values()),
            "operator_total_from_metrics": round(
                run.after_idle.metrics.operator_requests
                - run.after_converge.metrics.operator_requests
            ),
            "operator_writes": writes_of(idle_counts),
            "shardedmodel_changes": len(seen.changes) - run.changes_before_idle,
            "ready_lost": seen.ready_lost,
            "all_clients": table_of(
                metrics_delta(run.after_idle.metrics, run.after_converge.metrics)
            ),
        },
        "restart": restart,
        "stream_selectors": stream_selectors(audit.requests),
    }
    result["targets"] = check_targets(result)
    return result


def _mib(value: int) -> float:
    return round(value / common.MIB, 1)


def _round(value: float | None, digits: int = 2) -> float | None:
    return round(value, digits) if value is not None else None


def _cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 2) for name in after}


def check_targets(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target with its limit, the measured value and whether it is met."""
    ready = result["all_ready_s"]
    rss = result["operator"]["peak_rss_mib"]
    writes = result["requests"]["operator_writes_per_shardedmodel"]
    idle_writes = result["idle"]["operator_writes"]
    restart = result["restart"]
    return {
        "all_ready_s": {
            "limit": READY_TARGET_SECONDS,
            "value": ready,
            "met": ready is not None and ready <= READY_TARGET_SECONDS,
        },
        "peak_rss_mib": {
            "limit": PEAK_RSS_TARGET_MIB,
            "value": rss,
            "met": rss < PEAK_RSS_TARGET_MIB,
        },
        "writes_per_shardedmodel": {
            "limit": WRITES_PER_RESOURCE_TARGET,
            "value": writes,
            "met": writes <= WRITES_PER_RESOURCE_TARGET,
        },
        "idle_writes": {"limit": 0, "value": idle_writes, "met": idle_writes == 0},
        "restart_peak_rss_mib": {
            "limit": PEAK_RSS_TARGET_MIB,
            "value": restart["peak_rss_mib"],
            "met": restart["peak_rss_mib"] < PEAK_RSS_TARGET_MIB,
        },
        "restart_writes": {"limit": 0, "value": restart["writes"], "met": restart["writes"] == 0},
    }


# Output -------------------------------------------------------------------------------------


def print_report(results: Sequence[dict[str, Any]]) -> None:
    """The summary, the request breakdown and the targets, as tables."""
    common.print_table(
        "The controller at scale: seconds from the start of apply; baseline: the same verify "
        "Jobs created without the operator; baseline+targets: those Jobs and, as each "
        "completes, the operator's patch of its Deployment, until every rollout is done; "
        "apply alone: the same ShardedModels applied with the operator stopped",
        [
            "N",
            "apply",
            "apply alone",
            "Jobs created",
            "Jobs done",
            "all Ready",
            "settled",
            "baseline",
            "Ready/baseline",
            "baseline+targets",
            "Ready/b+t",
            "peak RSS MiB",
            "CPU s",
            "passes/SHM",
            "req/SHM",
            "writes/SHM",
            "idle req",
            "idle writes",
        ],
        [
            [
                r["size"],
                r["apply_s"],
                r["apply_alone_s"],
                r["jobs_created_s"]["max"],
                r["jobs_complete_s"]["max"],
                r["all_ready_s"],
                r["settled_s"],
                r["baseline"]["all_complete_s"],
                r["ready_over_baseline"],
                r["baseline_with_targets"]["all_complete_s"],
                r["ready_over_baseline_with_targets"],
                r["operator"]["peak_rss_mib"],
                r["operator"]["cpu_s"]["converge"],
                r["operator"]["reconcile_passes_per_shardedmodel"],
                round(r["requests"]["operator_total"] / r["size"], 2),
                r["requests"]["operator_writes_per_shardedmodel"],
                r["idle"]["operator_total"],
                r["idle"]["operator_writes"],
            ]
            for r in results
        ],
    )
    _breakdown(
        "Operator requests per ShardedModel, apply to settled (audit log)",
        results,
        lambda r: r["requests"]["operator_per_shardedmodel"],
    )
    _breakdown(
        "... of which the API server refused",
        results,
        lambda r: r["requests"]["operator_refused_per_shardedmodel"],
    )
    _breakdown(
        "Operator requests while idle (total)", results, lambda r: r["idle"]["operator_requests"]
    )
    common.print_table(
        "The operator restarted with every ShardedModel Ready: seconds from its start until "
        "it had passed over each, and until its last pass or request before the quiet window",
        [
            "N",
            "passed over all",
            "quiet after",
            "peak RSS MiB",
            "largest sampled MiB",
            "at s",
            "RSS caught up",
            "CPU s",
            "passes/SHM",
            "requests",
            "writes",
            "SHM changes",
            "Ready lost",
        ],
        [
            [
                r["size"],
                r["restart"]["caught_up_s"],
                r["restart"]["settled_s"],
                r["restart"]["peak_rss_mib"],
                r["restart"]["largest_rss_sampled"]["mib"],
                r["restart"]["largest_rss_sampled"]["at_s"],
                r["restart"]["rss_mib"]["caught_up"],
                r["restart"]["cpu_s"],
                r["restart"]["reconcile_passes_per_shardedmodel"],
                r["restart"]["requests_total"],
                r["restart"]["writes"],
                r["restart"]["shardedmodel_changes"],
                r["restart"]["ready_lost"],
            ]
            for r in results
        ],
    )
    _breakdown(
        "Operator requests after the restart (total)", results, lambda r: r["restart"]["requests"]
    )
    _breakdown(
        "The operator by whose code ran, apply to settled (py-spy: seconds the GIL was held)",
        results,
        lambda r: {
            name: owner["seconds"]
            for name, owner in (r["operator_profile"] or {}).get("by_owner", {}).items()
        },
        column="owner",
    )
    common.print_table(
        "Targets",
        ["N", "target", "limit", "measured", "met"],
        [
            [r["size"], name, t["limit"], t["value"], "yes" if t["met"] else "NO"]
            for r in results
            for name, t in r["targets"].items()
        ],
    )


def _breakdown(
    title: str,
    results: Sequence[dict[str, Any]],
    table: Callable[[dict[str, Any]], dict[str, float]],
    *,
    column: str = "request",
) -> None:
    keys = sorted({key for r in results for key in table(r)})
    if keys:
        common.print_table(
            title,
            [column, *(f"N={r['size']}" for r in results)],
            [[key, *(table(r).get(key) for r in results)] for key in keys],
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.controller",
        description="The controller at scale on a local control plane with kwok nodes.",
    )
    parser.add_argument(
        "--sizes",
        default="200,1000",
        type=lambda text: tuple(int(part) for part in text.split(",") if part.strip()),
        help="numbers of ShardedModels, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=120.0,
        help="how long to watch the settled operator (default: %(default)s)",
    )
    parser.add_argument(
        "--quiet-seconds",
        type=float,
        default=10.0,
        help="no operator write for this long means it has settled (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout-seconds",
        type=float,
        default=900.0,
        help="give up waiting for Ready after this long, per size (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=8,
        help="API clients creating objects in parallel (default: %(default)s)",
    )
    parser.add_argument(
        "--kube-api-qps",
        type=int,
        default=100,
        help="client QPS of kube-controller-manager and kube-scheduler, burst twice that; "
        "0 keeps Kubernetes' defaults (default: %(default)s)",
    )
    parser.add_argument(
        "--other-pods",
        type=int,
        default=0,
        help="pods of another workload running in the cluster from the start (default: 0)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=common.RESULTS_DIR / f"{NAME}.json",
        help="result file (default: benchmarks/results/controller.json)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the clusters' logs and the audit logs"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the operator with py-spy from apply until it settles, and sum the samples "
        "by whose code ran (benchmarks/profile.py); its other figures then include py-spy's cost",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every size, print the tables, write the result file."""
    args = parse_args(argv)
    started = common.utc_now()
    options = Options(
        idle_seconds=args.idle_seconds,
        quiet_seconds=args.quiet_seconds,
        timeout_seconds=args.timeout_seconds,
        workers=args.workers,
        kube_api_qps=args.kube_api_qps,
        profile=args.profile,
        other_pods=args.other_pods,
    )
    if options.profile:
        profile.py_spy()
    work_dir = Path(tempfile.mkdtemp(prefix="preshard-bench-controller-"))
    results = []
    try:
        for size in args.sizes:
            results.append(run_size(size, options, work_dir / f"n{size}", common.say))
    finally:
        if args.keep:
            common.say(f"logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    print_report(results)
    path = common.write_result(
        NAME,
        {
            "options": {
                "sizes": list(args.sizes),
                "idle_seconds": options.idle_seconds,
                "quiet_seconds": options.quiet_seconds,
                "workers": options.workers,
                "kube_api_qps": options.kube_api_qps,
                "profile": options.profile,
                "other_pods": options.other_pods,
                "replicas": REPLICAS,
                "tensor_parallel_size": TENSOR_PARALLEL_SIZE,
            },
            "sizes": results,
        },
        path=args.output,
        started=started,
    )
    print(f"\nresults written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
