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
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Final

import kopf

from preshard import reasons
from preshard.api import models
from preshard.builders import target
from preshard.builders.common import LABEL_MANAGED_BY, LABEL_SHARDEDMODEL, MANAGED_BY
from preshard.controller import kube
from preshard.controller.observe import JobView, PodView, job_view, pod_view
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
OWNED: Final = {LABEL_MANAGED_BY: MANAGED_BY}

Key = tuple[str, str]


@dataclass
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
    """One asyncio event per running reconciler, set by the watch handlers."""

    events: dict[Key, asyncio.Event] = field(default_factory=dict)
    interests: dict[Key, Interest] = field(default_factory=dict)
    by_namespace: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def register(self, key: Key) -> asyncio.Event:
        """The event a reconciler waits on."""
        event = self.events.setdefault(key, asyncio.Event())
        self.by_namespace[key[0]].add(key[1])
        return event

    def unregister(self, key: Key) -> None:
        """Forget a reconciler that stopped."""
        self.events.pop(key, None)
        self.interests.pop(key, None)
        self.by_namespace[key[0]].discard(key[1])

    def wake(self, key: Key) -> None:
        """Wake one reconciler, if it runs."""
        event = self.events.get(key)
        if event is not None:
            event.set()

    def wake_for_deployment(self, namespace: str, name: str, body: kopf.Body) -> None:
        """Wake the reconcilers whose targets may include this Deployment."""
        labels = dict(body.get("metadata", {}).get("labels") or {})
        owner = target.owner_of(dict(body))
        for shm in self.by_namespace.get(namespace, ()):
            interest = self.interests.get((namespace, shm))
            if interest is None or interest.matches(name, labels, owner, shm):
                self.wake((namespace, shm))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Every kopf setting and every shared client, in one place."""
    settings.persistence.finalizer = f"{models.GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=models.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=models.GROUP, key="last-handled-configuration"
    )
    # Events are posted by the reconciler on transitions; kopf's own log lines are not events.
    settings.posting.level = logging.WARNING
    # The resources are known in advance; scanning CRDs and namespaces would need RBAC the
    # operator deliberately lacks (and kopf retries the refusals for a minute at start-up).
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 8
    settings.batching.error_delays = [1, 2, 5, 10, 20, 30]
    operator_settings: Settings = memo.get("settings") or Settings.from_env()
    memo.settings = operator_settings
    memo.api = kube.load_configuration()
    memo.reconciler = Reconciler(kube.Kube(memo.api), operator_settings)
    memo.wakeups = Wakeups()


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    """Close the API client's connection pool."""
    api = memo.get("api")
    if api is not None:
        api.close()


@kopf.index("batch", "v1", "jobs", labels=OWNED)
def job_index(namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any) -> Any:
    """Jobs of each ShardedModel: `(namespace, name) -> JobView` (without pods)."""
    owner = labels.get(LABEL_SHARDEDMODEL)
    if owner is None or namespace is None:
        return None
    return {(namespace, owner): job_view(dict(body), [])}


@kopf.index("", "v1", "pods", labels=OWNED)
def pod_index(namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any) -> Any:
    """Pods of each Job: `(namespace, job name) -> PodView`."""
    job_name = next((labels[k] for k in JOB_NAME_LABELS if k in labels), None)
    if job_name is None or namespace is None:
        return None
    return {(namespace, job_name): pod_view(dict(body))}


@kopf.index("apps", "v1", "deployments")
def deployment_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> Any:
    """Deployments by namespace: `namespace -> (name, manifest)`."""
    return {namespace or "": (name, trim(copy.deepcopy(dict(body))))}


@kopf.index(models.GROUP, models.VERSION, models.PLURAL)
def artifact_index(namespace: str | None, name: str, status: kopf.Status, **_: Any) -> Any:
    """Artifact keys in use: `key -> (namespace, name)` of each ShardedModel that lists it."""
    return {
        entry.get("artifactKey"): (namespace, name)
        for entry in status.get("shardSets") or []
        if entry.get("artifactKey")
    }


@kopf.on.event("batch", "v1", "jobs", labels=OWNED)
@kopf.on.event("", "v1", "pods", labels=OWNED)
def owned_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A Job or pod of ours changed: wake its ShardedModel."""
    owner = labels.get(LABEL_SHARDEDMODEL)
    if owner is not None and namespace is not None:
        memo.wakeups.wake((namespace, owner))


@kopf.on.event("apps", "v1", "deployments")
def deployment_changed(
    namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """A Deployment changed: wake the ShardedModels that may target it."""
    memo.wakeups.wake_for_deployment(namespace or "", name, body)


@kopf.on.event(models.GROUP, models.VERSION, models.PLURAL)
def resource_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A ShardedModel changed (spec, annotations or our own status write): reconcile it."""
    memo.wakeups.wake((namespace or "", name))


@kopf.daemon(models.GROUP, models.VERSION, models.PLURAL, cancellation_timeout=1.0)
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
    reconciler: Reconciler = memo.reconciler
    try:
        while not stopped:
            wakeup.clear()
            snapshot = copy.deepcopy(dict(body))
            memo.wakeups.interests[key] = _interest(snapshot)
            indexes = Indexes.of(kwargs)
            observed = observed_for(
                indexes.jobs_of(key),
                indexes.deployments_in(namespace),
                indexes.keys_elsewhere(key),
                now_utc(),
            )
            try:
                result = await asyncio.to_thread(reconciler.reconcile, snapshot, observed)
            except Exception:
                logger.exception("reconcile failed; retrying")
                delay = 10.0
            else:
                _post(body, result.events)
                delay = result.requeue_after or RESYNC_SECONDS
            # Stopping (deletion, operator exit) cancels this wait: kopf cancels async daemons.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
    finally:
        memo.wakeups.unregister(key)


@kopf.on.delete(models.GROUP, models.VERSION, models.PLURAL)
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
    try:
        events = reconciler.cleanup(
            copy.deepcopy(dict(body)),
            indexes.deployments_in(namespace),
            indexes.jobs_of(key),
            indexes.keys_elsewhere(key),
        )
    except CleanupPendingError as pending:
        if runtime.total_seconds() > memo.settings.cleanup_timeout_seconds:
            message = (
                f"cleanup gave up after {memo.settings.cleanup_timeout_seconds}s: {pending}; "
                "remove leftover shard sets by hand"
            )
            logger.warning(message)
            _post(body, [Event("Warning", reasons.CLEANUP_FAILED, message)])
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
    deployments: kopf.Index[str, tuple[str, dict[str, Any]]]
    artifacts: kopf.Index[str, Key]

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> Indexes:
        """Pick the indexes out of a handler's keyword arguments."""
        return cls(
            jobs=kwargs["job_index"],
            pods=kwargs["pod_index"],
            deployments=kwargs["deployment_index"],
            artifacts=kwargs["artifact_index"],
        )

    def jobs_of(self, key: Key) -> dict[str, JobView]:
        """The ShardedModel's Jobs, each with its pods."""
        namespace = key[0]
        return {
            job.name: replace(job, pods=tuple(self.pods.get((namespace, job.name), ())))
            for job in self.jobs.get(key, ())
        }

    def deployments_in(self, namespace: str) -> dict[str, dict[str, Any]]:
        """The namespace's Deployments by name."""
        return dict(self.deployments.get(namespace, ()))

    def keys_elsewhere(self, key: Key) -> frozenset[str]:
        """Artifact keys that another ShardedModel lists too."""
        return frozenset(
            artifact
            for artifact, owners in self.artifacts.items()
            if any(owner != key for owner in owners)
        )


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
