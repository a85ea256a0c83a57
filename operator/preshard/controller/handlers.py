"""The kopf handlers: a thin layer that feeds indexes, wakes reconcilers and reports.

The design is the informer pattern in kopf's terms. Indexes hold what planning reads (the
operator's Jobs and their pods, the Deployments, the artifact keys of every ShardedModel), fed
by watch streams, so a reconcile costs no API reads. One daemon per ShardedModel reconciles
whenever something it depends on changes, and otherwise sleeps until its next timed check.
Writes happen only when the plan says the world differs from the spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Final

import aiohttp
import kopf

from preshard.api import models
from preshard.builders import jobs, patching
from preshard.builders.shardset import LABEL_MANAGED_BY, LABEL_SHARDEDMODEL, MANAGED_BY
from preshard.contract import reasons
from preshard.controller import kube, metrics, progress
from preshard.controller.observe import (
    JobView,
    PodView,
    TargetPodView,
    job_view,
    pod_view,
    target_pod_view,
)
from preshard.controller.plan import Event
from preshard.controller.reconciler import (
    CleanupPendingError,
    Reconciler,
    now_utc,
    observed_for,
    trim,
)
from preshard.settings import Settings

# Without events, a ShardedModel is looked at again at least this often.
RESYNC_SECONDS: Final = 600.0
CLEANUP_RETRY_SECONDS: Final = 5.0
JOB_NAME_LABELS: Final = ("batch.kubernetes.io/job-name", "job-name")
# The Jobs whose progress is read from their pod's log: the long ones.
PROGRESS_COMMANDS: Final = frozenset({jobs.SERIALIZE, jobs.RESHARD})
OWNED: Final = {LABEL_MANAGED_BY: MANAGED_BY}
# What kopf watches: one stream each, per namespace when the operator is namespaced.
JOBS: Final = ("batch", "v1", "jobs")
PODS: Final = ("", "v1", "pods")
DEPLOYMENTS: Final = ("apps", "v1", "deployments")
SHARDEDMODELS: Final = (models.GROUP, models.VERSION, models.PLURAL)
WATCHED: Final = (JOBS, PODS, DEPLOYMENTS, SHARDEDMODELS)
# Sent with the Job stream, so the API server streams only the Jobs preshard created (all carry
# it: `shardset.labels`), not every Job of the cluster.
JOB_SELECTOR: Final = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# Sent with the pod stream: the pods of preshard's Jobs and of patched pod templates carry the
# label (`patching.patch_deployment` sets it), another workload's pods do not. kopf lists every
# object of a stream and holds them all while it starts, so a cluster's other pods would cost the
# operator memory (about 30 KiB each) and time.
POD_SELECTOR: Final = LABEL_SHARDEDMODEL
# Requests kopf may have in flight at once besides its watch streams.
API_REQUESTS: Final = 32

Key = tuple[str, str]


@dataclass(frozen=True)
class DeploymentKey:
    """A key of the Deployment index: all of a namespace's, one by name, or those one
    ShardedModel patched."""

    namespace: str
    name: str = ""
    patched_by: str = ""


DeploymentEntry = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Interest:
    """Which Deployments a ShardedModel cares about, so a Deployment event wakes only it."""

    names: frozenset[str] = frozenset()
    selectors: tuple[models.LabelSelector, ...] = ()

    def matches(self, name: str, labels: dict[str, str], owner: str | None, me: str) -> bool:
        """Whether an event on this Deployment may change this ShardedModel's plan."""
        return (
            name in self.names
            or owner == me
            or any(selector.matches(labels) for selector in self.selectors)
        )


@dataclass
class Wakeups:
    """One asyncio event per running reconciler, set by the watch handlers.

    A Deployment event wakes the reconcilers that name it, own it, or select by label in its
    namespace, found through maps rather than by asking every ShardedModel. Every wake comes from
    a coroutine handler, on the loop the reconcilers wait on.
    """

    events: dict[Key, asyncio.Event] = field(default_factory=dict)
    interests: dict[Key, Interest] = field(default_factory=dict)
    naming: dict[Key, set[str]] = field(default_factory=lambda: defaultdict(set))
    selecting: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    owners: dict[Key, str] = field(default_factory=dict)
    """The ShardedModel that patched each Deployment, as its last watch event showed."""

    def register(self, key: Key) -> asyncio.Event:
        """A new event for a reconciler that starts. Until its interest is known, any
        Deployment in its namespace may matter to it.

        Always a new one, and `unregister` forgets only its own: kopf abandons a daemon that
        outlives its cancellation timeout, and one that ends after a ShardedModel of the same
        name was created again must not take its successor's event with it.
        """
        self.selecting[key[0]].add(key[1])
        event = self.events[key] = asyncio.Event()
        return event

    def set_interest(self, key: Key, interest: Interest) -> None:
        """Record which Deployments a reconciler cares about now."""
        if self.interests.get(key) == interest:
            return
        self._forget_interest(key)
        self.interests[key] = interest
        namespace, name = key
        for deployment in interest.names:
            self.naming[(namespace, deployment)].add(name)
        if interest.selectors:
            self.selecting[namespace].add(name)

    def unregister(self, key: Key, event: asyncio.Event) -> None:
        """Forget a reconciler that stopped, unless a newer one of the same key replaced it."""
        if self.events.get(key) is event:
            self._forget_interest(key)
            del self.events[key]

    def wake(self, key: Key) -> None:
        """Wake one reconciler, if it runs."""
        event = self.events.get(key)
        if event is not None:
            event.set()

    def wake_for_deployment(
        self, namespace: str, name: str, body: kopf.Body, *, deleted: bool = False
    ) -> None:
        """Wake the reconcilers whose targets may include this Deployment."""
        labels = dict(body.get("metadata", {}).get("labels") or {})
        owner = patching.owner_of(dict(body))
        if owner is None or deleted:
            self.owners.pop((namespace, name), None)
        else:
            self.owners[(namespace, name)] = owner
        candidates = self.naming.get((namespace, name), set()) | self.selecting.get(
            namespace, set()
        )
        if owner is not None:
            candidates = candidates | {owner}
        for shm in candidates:
            interest = self.interests.get((namespace, shm))
            if interest is None or interest.matches(name, labels, owner, shm):
                self.wake((namespace, shm))

    def wake_for_pod(self, namespace: str, deployment: str) -> None:
        """Wake the reconciler that patched this Deployment (a pod of its template changed)."""
        owner = self.owners.get((namespace, deployment))
        if owner is not None:
            self.wake((namespace, owner))

    def _forget_interest(self, key: Key) -> None:
        namespace, name = key
        old = self.interests.pop(key, None)
        for deployment in old.names if old else ():
            named = self.naming.get((namespace, deployment))
            if named is not None:
                named.discard(name)
                if not named:
                    del self.naming[(namespace, deployment)]
        self.selecting[namespace].discard(name)


class NoDiffBase(kopf.DiffBaseStorage):
    """No record of the last handled spec, so no write of one.

    kopf keeps the spec it handled last (by default in an annotation) to tell creations and
    updates apart for its change handlers. The only change handler here is `on.delete`, which
    kopf finds by the deletion timestamp, not by a diff; the daemon reconciles from the whole
    body. The record would cost every ShardedModel a write and a watch event for nothing.
    """

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        """Nothing to compare, so nothing to extract: kopf builds the essence of every watched
        object (pods, Jobs and Deployments too) on every event, a deep copy of the body and a
        second one of the copy, only to diff it against the record this storage never keeps."""
        return kopf.BodyEssence()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Every kopf setting and every shared client, in one place."""
    settings.persistence.finalizer = f"{models.GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=models.GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    # Events are posted by the reconciler on transitions; kopf's own log lines are not events.
    settings.posting.level = logging.WARNING
    # The resources are known in advance; scanning CRDs and namespaces would need RBAC the
    # operator deliberately lacks (and kopf retries the refusals for a minute at start-up).
    settings.scanning.disabled = True
    configure_watching(settings)
    settings.execution.max_workers = 8
    settings.batching.error_delays = [1, 2, 5, 10, 20, 30]
    operator_settings: Settings = memo.get("settings") or Settings.from_env()
    memo.settings = operator_settings
    memo.api = kube.load_configuration()
    # `preshard run` passes the metrics it serves; without them the counts go nowhere.
    recorder: metrics.Metrics = memo.get("metrics") or metrics.Metrics()
    client = kube.Kube(memo.api)
    memo.reconciler = Reconciler(client, operator_settings, recorder)
    memo.wakeups = Wakeups()
    memo.progress = (
        progress.ProgressReader(
            lambda namespace, pod: client.read_log_tail(
                namespace,
                pod,
                jobs.CONTAINER,
                lines=progress.TAIL_LINES,
                limit_bytes=progress.TAIL_BYTES,
            ),
            operator_settings.progress_seconds,
        )
        if operator_settings.progress_seconds
        else None
    )


def configure_watching(settings: kopf.OperatorSettings) -> None:
    """How kopf's watch streams are opened: their timeouts, and the API server's filter."""
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.label_selectors[JOBS] = JOB_SELECTOR
    settings.watching.label_selectors[PODS] = POD_SELECTOR


def api_connection_limit(namespaces: Sequence[str]) -> int:
    """How many connections to the API server kopf's session may hold: one per watch stream and
    `API_REQUESTS` more; 0 (no bound) where a namespace pattern leaves the number of streams
    open."""
    if any(set(namespace) & set("*?[]!") for namespace in namespaces):
        return 0
    return len(WATCHED) * max(1, len(namespaces)) + API_REQUESTS


@kopf.on.login()
async def login(
    memo: kopf.Memo, logger: kopf.Logger, settings: kopf.OperatorSettings, **_: Any
) -> kopf.AiohttpSession | None:
    """The kubeconfig's or the ServiceAccount's credentials, in a session with bounded
    connections.

    kopf's own session opens as many connections as there are requests in flight. When a
    thousand ShardedModels arrive in a few seconds, kopf adds each one's finalizer at once: a
    thousand TLS connections to the API server, about a quarter of a MiB of buffers each, that
    the process kept after they closed. Bounded, the requests wait their turn on a few
    connections that stay open.
    """
    info = kopf.login_via_client(logger=logger, settings=settings)
    if info is None:
        return None
    limit = api_connection_limit(memo.get("namespaces") or ())
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        auth=info.as_aiohttp_basic_auth(),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
        priority=info.priority,
        aiohttp_session=session,
    )


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    """Close the API client's connection pool."""
    api = memo.get("api")
    if api is not None:
        api.close()


# The index handlers and the event handlers are coroutines although they do no I/O: kopf runs a
# plain function in its thread pool, so every watch event would wait there behind busy threads
# (and the indexes fall behind the writes under load), and an event handler would set the
# daemons' asyncio events from a thread that is not the event loop's.


@kopf.index(*JOBS, labels=OWNED)
async def job_index(namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any) -> Any:
    """Jobs of each ShardedModel: `(namespace, name) -> JobView` (without pods)."""
    owner = labels.get(LABEL_SHARDEDMODEL)
    if owner is None or namespace is None:
        return None
    return {(namespace, owner): job_view(dict(body), [])}


@kopf.index(*PODS, labels=OWNED)
async def pod_index(namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any) -> Any:
    """Pods of each Job: `(namespace, job name) -> PodView`."""
    job_name = next((labels[k] for k in JOB_NAME_LABELS if k in labels), None)
    if job_name is None or namespace is None:
        return None
    return {(namespace, job_name): pod_view(dict(body))}


# The pod stream (POD_SELECTOR) carries the pods of preshard's Jobs and of patched templates; this
# index keeps the latter.
@kopf.index(*PODS)
async def target_pod_index(namespace: str | None, body: kopf.Body, **_: Any) -> Any:
    """Pods of patched Deployments: `(namespace, Deployment name) -> TargetPodView`."""
    view = target_pod_view(dict(body))
    if view is None or namespace is None:
        return None
    return {(namespace, view.deployment): view}


@kopf.index(*DEPLOYMENTS)
async def deployment_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> Any:
    """Deployments: `DeploymentKey -> (name, manifest)`."""
    return deployment_entries(namespace or "", name, body)


def deployment_entries(
    namespace: str, name: str, body: Mapping[str, Any]
) -> dict[DeploymentKey, DeploymentEntry]:
    """The keys a Deployment is indexed under (its namespace, its name and, once patched, the
    ShardedModel that patched it), each with the same copy of its manifest."""
    entry = (name, copy.deepcopy(trim(body)))
    keys = [DeploymentKey(namespace), DeploymentKey(namespace, name=name)]
    owner = patching.owner_of(entry[1])
    if owner is not None:
        keys.append(DeploymentKey(namespace, patched_by=owner))
    return dict.fromkeys(keys, entry)


@kopf.index(*SHARDEDMODELS)
async def shard_set_index(namespace: str | None, name: str, status: kopf.Status, **_: Any) -> Any:
    """Shard sets in use: `set URI -> (namespace, name)` of each ShardedModel that lists it.

    By URI, not artifact key: the same key under another storage prefix is another set.
    """
    return {
        entry.get("uri"): (namespace, name)
        for entry in status.get("shardSets") or []
        if entry.get("uri")
    }


@kopf.on.event(*JOBS, labels=OWNED)
@kopf.on.event(*PODS, labels=OWNED)
async def owned_changed(
    namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """A Job or pod of ours changed: wake its ShardedModel."""
    owner = labels.get(LABEL_SHARDEDMODEL)
    if owner is not None and namespace is not None:
        memo.wakeups.wake((namespace, owner))


@kopf.on.event(*DEPLOYMENTS)
async def deployment_changed(
    namespace: str | None, name: str, body: kopf.Body, type: str, memo: kopf.Memo, **_: Any
) -> None:
    """A Deployment changed: wake the ShardedModels that may target it."""
    memo.wakeups.wake_for_deployment(namespace or "", name, body, deleted=type == "DELETED")


def _failing_patched_pod(body: kopf.Body, **_: Any) -> bool:
    # A filter, run on the event loop for every pod event: only a failing pod of a patched
    # template goes on to wake anyone. A pod that recovers, or goes, changes its Deployment's
    # status, whose event wakes the reconciler.
    view = target_pod_view(dict(body))
    return view is not None and bool(view.problems)


@kopf.on.event(*PODS, when=_failing_patched_pod)
async def target_pod_failing(
    namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """A pod of a patched Deployment crashes or cannot start: wake the ShardedModel."""
    view = target_pod_view(dict(body))
    if view is not None and namespace is not None:
        memo.wakeups.wake_for_pod(namespace, view.deployment)


@kopf.on.event(*SHARDEDMODELS)
async def resource_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A ShardedModel changed (spec, annotations or our own status write): reconcile it."""
    memo.wakeups.wake((namespace or "", name))


@kopf.daemon(*SHARDEDMODELS, cancellation_timeout=1.0)
async def reconcile(
    stopped: kopf.DaemonStopped,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """Reconcile one ShardedModel whenever something it depends on changes."""
    namespace = namespace or ""
    key = (namespace, name)
    wakeup = memo.wakeups.register(key)
    indexes = Indexes.of(kwargs)
    try:
        while not stopped:
            wakeup.clear()
            try:
                delay = await _reconcile_once(key, body, memo, indexes)
            except Exception:
                logger.exception("reconcile failed; retrying")
                delay = 10.0
            # Stopping (deletion, operator exit) cancels this wait: kopf cancels async daemons.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
    finally:
        memo.wakeups.unregister(key, wakeup)


async def _reconcile_once(key: Key, body: kopf.Body, memo: kopf.Memo, indexes: Indexes) -> float:
    """One pass; returns when to look again. Its observation is dropped before the daemon
    sleeps, so a thousand sleeping daemons hold no copies of the indexes."""
    snapshot = _snapshot(body)
    interest = _interest(snapshot)
    memo.wakeups.set_interest(key, interest)
    deployments = indexes.deployments_for(key, interest)
    job_views = indexes.jobs_of(key)
    reader: progress.ProgressReader | None = memo.progress
    steps = await asyncio.to_thread(_progress, reader, key[0], job_views) if reader else {}
    observed = observed_for(
        job_views,
        deployments,
        indexes.sets_elsewhere(key, _set_uris(snapshot)),
        now_utc(),
        target_pods=indexes.target_pods_of(key[0], deployments),
        progress={name: step.text for name, step in steps.items() if step is not None},
    )
    reconciler: Reconciler = memo.reconciler
    result = await asyncio.to_thread(reconciler.reconcile, snapshot, observed)
    _post(body, result.events)
    delay = result.requeue_after or RESYNC_SECONDS
    # While a serialize or reshard Job runs, look at its progress again after a poll interval.
    return min(delay, reader.interval) if reader and steps else delay


def _progress(
    reader: progress.ProgressReader, namespace: str, job_views: dict[str, JobView]
) -> dict[str, progress.Step | None]:
    """The steps of the running serialize and reshard Jobs, by Job name (None: not known)."""
    steps: dict[str, progress.Step | None] = {}
    for name, job in job_views.items():
        pod = job.latest_pod
        if job.finished or job.command not in PROGRESS_COMMANDS or pod is None:
            continue
        if pod.phase == "Running":
            steps[name] = reader.step(namespace, pod.name)
    return steps


@kopf.on.delete(*SHARDEDMODELS)
def cleanup(
    namespace: str | None,
    name: str,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    runtime: timedelta,
    **kwargs: Any,
) -> None:
    """Restore patched Deployments and honour the retention policy, then let go."""
    namespace = namespace or ""
    reconciler: Reconciler = memo.reconciler
    key = (namespace, name)
    indexes = Indexes.of(kwargs)
    snapshot = _snapshot(body)
    try:
        events = reconciler.cleanup(
            snapshot,
            indexes.deployments_for(key, Interest()),
            indexes.jobs_of(key),
            indexes.sets_elsewhere(key, _set_uris(snapshot)),
        )
    except CleanupPendingError as pending:
        if runtime.total_seconds() > memo.settings.cleanup_timeout_seconds:
            message = (
                f"cleanup gave up after {memo.settings.cleanup_timeout_seconds}s: {pending}; "
                "remove leftover shard sets by hand"
            )
            logger.warning(message)
            _post(body, [Event("Warning", reasons.CLEANUP_FAILED, message)])
            reconciler.forget(namespace, name)
            return
        raise kopf.TemporaryError(str(pending), delay=CLEANUP_RETRY_SECONDS) from None
    except kube.ConflictError as error:
        raise kopf.TemporaryError(str(error), delay=1) from None
    _post(body, events)


@dataclass(frozen=True)
class Indexes:
    """The indexes kopf passes to every handler, by the names of the index functions."""

    jobs: kopf.Index[Key, JobView]
    pods: kopf.Index[Key, PodView]
    deployments: kopf.Index[DeploymentKey, DeploymentEntry]
    shard_sets: kopf.Index[str, Key]
    target_pods: kopf.Index[Key, TargetPodView]

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> Indexes:
        """Pick the indexes out of a handler's keyword arguments."""
        return cls(
            jobs=kwargs["job_index"],
            pods=kwargs["pod_index"],
            deployments=kwargs["deployment_index"],
            shard_sets=kwargs["shard_set_index"],
            target_pods=kwargs["target_pod_index"],
        )

    def jobs_of(self, key: Key) -> dict[str, JobView]:
        """The ShardedModel's Jobs, each with its pods."""
        namespace = key[0]
        return {
            job.name: replace(job, pods=tuple(self.pods.get((namespace, job.name), ())))
            for job in self.jobs.get(key, ())
        }

    def deployments_for(self, key: Key, interest: Interest) -> dict[str, dict[str, Any]]:
        """The Deployments a ShardedModel may target or has patched, by name.

        Only a label selector needs every Deployment of the namespace; names and the patch
        annotation are looked up, so a pass does not grow with the namespace.
        """
        namespace, name = key
        candidates: Iterable[DeploymentEntry]
        if interest.selectors:
            candidates = self.deployments.get(DeploymentKey(namespace), ())
        else:
            lookups = [DeploymentKey(namespace, name=target) for target in interest.names]
            lookups.append(DeploymentKey(namespace, patched_by=name))
            candidates = itertools.chain.from_iterable(
                self.deployments.get(lookup, ()) for lookup in lookups
            )
        return {
            deployment: manifest
            for deployment, manifest in candidates
            if interest.matches(
                deployment,
                (manifest.get("metadata") or {}).get("labels") or {},
                patching.owner_of(manifest),
                name,
            )
        }

    def target_pods_of(
        self, namespace: str, deployments: Iterable[str]
    ) -> dict[str, tuple[TargetPodView, ...]]:
        """The pods of patched templates of these Deployments, by Deployment name."""
        found = {name: tuple(self.target_pods.get((namespace, name), ())) for name in deployments}
        return {name: pods for name, pods in found.items() if pods}

    def sets_elsewhere(self, key: Key, uris: Iterable[str]) -> frozenset[str]:
        """Which of these shard set URIs another ShardedModel lists too."""
        return frozenset(
            uri for uri in uris if any(owner != key for owner in self.shard_sets.get(uri, ()))
        )


def _snapshot(body: kopf.Body) -> dict[str, Any]:
    """A copy of the ShardedModel of its own, as kopf updates the body in place while a pass
    runs in a thread; without managedFields, which planning never reads and which are much of
    what would be copied."""
    return copy.deepcopy(trim(body))


def _set_uris(body: dict[str, Any]) -> list[str]:
    status = body.get("status") or {}
    return [str(e["uri"]) for e in status.get("shardSets") or [] if e.get("uri")]


def _interest(body: dict[str, Any]) -> Interest:
    try:
        spec = models.parse_spec(body.get("spec"))
    except models.InvalidSpecError:
        return Interest()
    return Interest(
        names=frozenset(t.name for t in spec.targets if t.name),
        selectors=tuple(t.selector for t in spec.targets if t.selector),
    )


def _post(body: kopf.Body, events: Iterable[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
