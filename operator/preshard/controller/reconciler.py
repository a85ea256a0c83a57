"""The service layer: parse a ShardedModel, plan, carry the plan out, record the status.

Handlers call `Reconciler.reconcile` and `Reconciler.cleanup`; both are synchronous and run in
kopf's thread pool. Every API call goes through `preshard.controller.kube`. What the metrics
count is read here, from the plan, the API's answers and the status before and after a pass
(`preshard.controller.metrics` only counts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final

from preshard.api import models
from preshard.api.models import InvalidSpecError, ShardedModelSpec, parse_spec
from preshard.api.status import ShardedModelStatus, ShardSetStatus
from preshard.builders import Manifest, jobs, patching
from preshard.builders.shardset import LABEL_COMMAND, Owner
from preshard.contract import reasons
from preshard.contract.outcome import Outcome
from preshard.controller import conditions, kube, metrics
from preshard.controller.observe import JobView, TargetPodView
from preshard.controller.plan import (
    DeploymentPatch,
    Event,
    Observed,
    Plan,
    Resource,
    plan,
    plan_invalid,
)
from preshard.controller.plan.deletion import Deletion, plan_deletion
from preshard.settings import Settings

NOT_FOUND_RETRY_SECONDS: Final = 1.0
# How long a write of this operator (a Job created, a Deployment patched) is remembered while
# the watch stream that will show it catches up.
RECENT_WRITE_SECONDS: Final = 30.0
# How long a deleted Job's name is not used again. The Job controller keys what it waits for
# (its "expectations") by namespace and name: a Job created again under the name of one deleted
# before its pod was seen gets no pod until those expire, after five minutes.
DELETED_JOB_SECONDS: Final = 330.0

log = logging.getLogger(__name__)

ObjectLog = logging.LoggerAdapter[logging.Logger]


def object_log(namespace: str, name: str, uid: str = "") -> ObjectLog:
    """The log of one ShardedModel's reconcile: every line it writes names the resource.

    Each record carries `k8s_ref`, the object reference kopf's log formatters read, as the
    records of kopf's own per-object logger do: a JSON line gets it as its `object` field, a
    text line the prefix `[namespace/name]`. The lines go to this module's logger, not to
    `kopf.objects`, so they keep their level in a quiet operator and are never posted as events.
    """
    reference = {
        "apiVersion": f"{models.GROUP}/{models.VERSION}",
        "kind": models.KIND,
        "name": name,
        "uid": uid,
        "namespace": namespace,
    }
    return logging.LoggerAdapter(log, {"k8s_ref": reference})


class CleanupPendingError(Exception):
    """Deletion waits for something (a delete Job, a Deployment write); try again soon."""


@dataclass
class Result:
    """What one reconcile did, for the handler to report."""

    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


class RecentWrites:
    """Writes made in the last `seconds`, shared by kopf's worker threads.

    An index lags behind the writes that change it; a pass that plans from it before it caught
    up would repeat a write that was already made (and be refused). Keys name the write: a Job
    by namespace and name, a Deployment patch by the uid and generation it was planned from.
    """

    def __init__(self, seconds: float = RECENT_WRITE_SECONDS) -> None:
        self._lock = threading.Lock()
        self._seconds = seconds
        self._at: dict[tuple[str, ...], float] = {}

    def __contains__(self, key: tuple[str, ...]) -> bool:
        with self._lock:
            made = self._at.get(key)
            return made is not None and time.monotonic() - made < self._seconds

    def remember(self, key: tuple[str, ...]) -> None:
        """Record a write made now, and forget those too old to matter."""
        now = time.monotonic()
        with self._lock:
            self._at = {k: t for k, t in self._at.items() if now - t < self._seconds}
            self._at[key] = now

    def matching(self, prefix: tuple[str, ...]) -> frozenset[tuple[str, ...]]:
        """The keys remembered now that start with `prefix`."""
        now = time.monotonic()
        with self._lock:
            return frozenset(
                k
                for k, t in self._at.items()
                if k[: len(prefix)] == prefix and now - t < self._seconds
            )


@dataclass
class _Written:
    """The status this operator wrote last, until the watch stream shows it."""

    before: Manifest
    after: Manifest


class Reconciler:
    """Reconciles ShardedModels through one Kubernetes client."""

    def __init__(
        self, client: kube.Kube, settings: Settings, recorder: metrics.Metrics | None = None
    ) -> None:
        self.kube = client
        self.settings = settings
        self.metrics = recorder if recorder is not None else metrics.Metrics()
        self._written: dict[tuple[str, str], _Written] = {}
        self._recent = RecentWrites()
        self._deleted_jobs = RecentWrites(DELETED_JOB_SECONDS)
        # Delete Jobs of a deletion whose result is counted already, by ShardedModel: deletion
        # retries until every Job is done and reads the finished ones each time.
        self._cleanup_counted: dict[tuple[str, str], set[str]] = {}

    def reconcile(self, body: Manifest, observed: Observed) -> Result:
        """One pass for one ShardedModel: decide, act, record; every pass is counted and timed."""
        with self.metrics.reconcile_pass() as counted:
            return self._reconcile(body, observed, counted)

    def _reconcile(
        self, body: Manifest, observed: Observed, counted: metrics.ReconcilePass
    ) -> Result:
        metadata = body.get("metadata") or {}
        namespace, name = str(metadata["namespace"]), str(metadata["name"])
        generation = int(metadata.get("generation") or 0)
        raw_status = self._known_status(namespace, name, body.get("status") or {})
        status = ShardedModelStatus.model_validate(raw_status)
        try:
            spec = parse_spec(body.get("spec"))
        except InvalidSpecError as error:
            counted.error = reasons.INVALID_SPEC
            new_status = plan_invalid(status, generation, str(error), observed.now)
            changed = self._write_status(namespace, name, raw_status, new_status)
            self._count_status(metadata, status, new_status, observed)
            events = [Event("Warning", reasons.INVALID_SPEC, str(error))] if changed else []
            return Result(events=events)
        resource = Resource(
            owner=Owner(name=name, namespace=namespace, uid=str(metadata.get("uid", ""))),
            generation=generation,
            annotations=metadata.get("annotations") or {},
            spec=spec,
            status=status,
        )
        deleted = frozenset(job for _, job in self._deleted_jobs.matching((namespace,)))
        decided = plan(resource, replace(observed, deleted_jobs=deleted), self.settings)
        requeue = self.execute(decided, namespace, object_log(namespace, name, resource.owner.uid))
        self._write_status(namespace, name, raw_status, decided.status)
        # Counted once the status that records it is written: a pass that fails before that
        # is repeated, and counts then.
        self._count_status(metadata, status, decided.status, observed)
        if requeue is not None:
            decided.requeue_after = min(requeue, decided.requeue_after or requeue)
        return Result(events=decided.events, requeue_after=decided.requeue_after)

    def cleanup(
        self,
        body: Manifest,
        deployments: Mapping[str, Manifest],
        job_views: Mapping[str, JobView],
        sets_used_elsewhere: frozenset[str],
    ) -> list[Event]:
        """Undo what preshard did for a deleted ShardedModel; `CleanupPendingError` means wait.
        Once done, the ShardedModel is forgotten (`forget`)."""
        metadata = body.get("metadata") or {}
        namespace, name = str(metadata["namespace"]), str(metadata["name"])
        try:
            spec: ShardedModelSpec | None = parse_spec(body.get("spec"))
        except InvalidSpecError:
            spec = None
        deletion = plan_deletion(
            Owner(name=name, namespace=namespace, uid=str(metadata.get("uid", ""))),
            metadata.get("annotations") or {},
            spec,
            ShardedModelStatus.model_validate(body.get("status") or {}),
            deployments,
            job_views,
            sets_used_elsewhere,
            self.settings,
        )
        events = self._delete(namespace, name, deletion)
        self.forget(namespace, name)
        return events

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is kept about a ShardedModel that is gone: the status written last, what
        its deletion counted, and its series in the metrics."""
        self._written.pop((namespace, name), None)
        self._cleanup_counted.pop((namespace, name), None)
        self.metrics.forget(namespace, name)

    def _delete(self, namespace: str, name: str, deletion: Deletion) -> list[Event]:
        """Carry a deletion out; `CleanupPendingError` while something is left to wait for."""
        if deletion.skipped:
            return deletion.events()
        events = self._restore_targets(namespace, deletion.restore)
        for job_name in deletion.stop_jobs:
            self.kube.delete_job(namespace, job_name)
        self._written.pop((namespace, name), None)
        for view in deletion.finished:
            self._count_deletion_job((namespace, name), view)
        for manifest in deletion.create_jobs:
            try:
                self._create_deletion_job(manifest)
            except kube.NamespaceTerminatingError:
                return [
                    *events,
                    Event(
                        "Warning",
                        reasons.CLEANUP_FAILED,
                        "namespace is terminating: no Job can delete the shard sets; they "
                        "stay in storage",
                    ),
                ]
        if deletion.failed is not None:
            raise CleanupPendingError(deletion.failed)
        if deletion.waiting:
            raise CleanupPendingError("waiting for delete Jobs: " + ", ".join(deletion.waiting))
        return [*events, *deletion.events()]

    def _create_deletion_job(self, manifest: Manifest) -> None:
        if self.kube.create_job(manifest):
            self.metrics.job_started(jobs.DELETE)

    def _count_deletion_job(self, key: tuple[str, str], view: JobView | None) -> None:
        """Count a finished delete Job of a deletion once, though deletion reads it again on
        every retry until all are done."""
        if view is None or not view.finished:
            return
        counted = self._cleanup_counted.setdefault(key, set())
        if view.name not in counted:
            counted.add(view.name)
            self.metrics.job_finished(view.command, view.outcome())

    def _restore_targets(self, namespace: str, names: Iterable[str]) -> list[Event]:
        events: list[Event] = []
        for deployment_name in names:
            try:
                current = self.kube.get_deployment(namespace, deployment_name)
            except kube.NotFoundError:
                continue
            restored = patching.build_restored_deployment(current)
            if restored is None:
                continue
            try:
                self.kube.patch_deployment(
                    namespace, deployment_name, patching.deployment_patch(current, restored)
                )
            except kube.ConflictError as error:
                self.metrics.deployment_patch(metrics.RESTORE, metrics.CONFLICT)
                raise CleanupPendingError(str(error)) from None
            except kube.NotFoundError:
                self.metrics.deployment_patch(metrics.RESTORE, metrics.NOT_FOUND)
                continue
            self.metrics.deployment_patch(metrics.RESTORE, metrics.APPLIED)
            events.append(
                Event("Normal", reasons.RESTORED, f"Deployment {deployment_name} restored")
            )
        return events

    def execute(self, decided: Plan, namespace: str, logger: ObjectLog) -> float | None:
        """Create and delete the plan's Jobs and patch its Deployments, skipping writes made a
        moment ago that the indexes do not show yet; the delay before the next pass, if any.
        `logger` is the ShardedModel's own (`object_log`)."""
        requeue: float | None = None
        for job_name in decided.delete_jobs:
            self.kube.delete_job(namespace, job_name)
            self._deleted_jobs.remember((namespace, job_name))
        for manifest in decided.create_jobs:
            job_name = manifest["metadata"]["name"]
            if ("job", namespace, job_name) in self._recent:
                # Created a moment ago; the Job index has not caught up yet. Its watch event
                # wakes this resource; the timer covers a Job deleted meanwhile by someone else.
                requeue = (
                    RECENT_WRITE_SECONDS if requeue is None else min(requeue, RECENT_WRITE_SECONDS)
                )
                continue
            try:
                created = self.kube.create_job(manifest)
            except kube.NamespaceTerminatingError:
                # The namespace is being deleted with this ShardedModel in it (its Jobs may go
                # first); nothing can start there, and the deletion handler takes over.
                logger.info("namespace %s is terminating; Job %s not created", namespace, job_name)
                break
            self._recent.remember(("job", namespace, job_name))
            if created:
                self.metrics.job_started(_job_kind(manifest))
                logger.info("created Job %s/%s", namespace, job_name)
        for patch in decided.patches:
            retry = self._patch(namespace, patch, logger)
            if retry is not None:
                # Not sent or refused: none of the events that announce it, and a look again
                # later.
                requeue = retry if requeue is None else min(requeue, retry)
                decided.events = [e for e in decided.events if e.deployment != patch.name]
        return requeue

    def _patch(self, namespace: str, patch: DeploymentPatch, logger: ObjectLog) -> float | None:
        """Patch a target unless that was done, or refused, from the same version a moment
        ago; None when the patch is applied, else the delay before the next look."""
        uid, generation = patch.planned_from
        written = ("deployment", namespace, patch.name, uid, str(generation))
        if written in self._recent:
            # Patched, or refused as stale, from this version a moment ago: the Deployment index
            # still shows the old one. Its watch event wakes this resource again; the timer only
            # covers a lost event.
            return RECENT_WRITE_SECONDS
        action = metrics.RESTORE if patch.restore else metrics.PATCH
        try:
            self.kube.patch_deployment(namespace, patch.name, patch.patch)
        except kube.ConflictError as error:
            # Someone else moved the Deployment on. Until the watch stream brings the new
            # version, a plan from this one would only be refused again.
            logger.info("%s", error)
            self.metrics.deployment_patch(action, metrics.CONFLICT)
            self._recent.remember(written)
            return RECENT_WRITE_SECONDS
        except kube.NotFoundError as error:
            logger.info("%s", error)
            self.metrics.deployment_patch(action, metrics.NOT_FOUND)
            return NOT_FOUND_RETRY_SECONDS
        self.metrics.deployment_patch(action, metrics.APPLIED)
        self._recent.remember(written)
        return None

    def _count_status(
        self,
        metadata: Manifest,
        before: ShardedModelStatus,
        after: ShardedModelStatus,
        observed: Observed,
    ) -> None:
        """Count what a pass recorded: the shard sets by stage, the Jobs whose result it read,
        and the first Ready."""
        namespace, name = str(metadata["namespace"]), str(metadata["name"])
        if metadata.get("deletionTimestamp"):
            # Going: deletion forgets it, and a pass that ends after that must not bring it back.
            self.metrics.forget(namespace, name)
        else:
            self.metrics.shard_sets(namespace, name, (e.stage for e in after.shard_sets))
        for entry, result, view in finished_jobs(before, after, observed.jobs):
            outcome = view.outcome()
            self.metrics.job_finished(view.command, outcome)
            if view.command == jobs.VERIFY:
                self.metrics.verification(_check_of(entry), _verification_reason(outcome, result))
        if first_ready(before, after):
            created = _parse_time(metadata.get("creationTimestamp"))
            if created is not None:
                self.metrics.ready((observed.now - created).total_seconds())

    def _known_status(self, namespace: str, name: str, seen: Manifest) -> Manifest:
        # A status written a moment ago may not be back through the watch stream yet; planning
        # from the older one would only repeat work, so use what was written.
        written = self._written.get((namespace, name))
        if written is not None and seen == written.before:
            return written.after
        self._written.pop((namespace, name), None)
        return seen

    def _write_status(
        self, namespace: str, name: str, before: Manifest, status: ShardedModelStatus
    ) -> bool:
        after = status.model_dump(by_alias=True, exclude_none=True)
        if after == ShardedModelStatus.model_validate(before).model_dump(
            by_alias=True, exclude_none=True
        ):
            return False
        self.kube.patch_status(namespace, name, after)
        self._written[(namespace, name)] = _Written(before=before, after=after)
        return True


def finished_jobs(
    before: ShardedModelStatus, after: ShardedModelStatus, job_views: Mapping[str, JobView]
) -> Iterator[tuple[ShardSetStatus, ShardSetStatus | None, JobView]]:
    """The finished Jobs whose result a pass read: named by a shard set before the pass, named
    by none after it (the planner moves a set on from a Job once it reads the Job's result).
    Each with the set's entry before and after (None when the set was dropped).

    Once that status is written, the Job is named nowhere, so each Job is found once."""
    still_named = {e.job for e in after.shard_sets if e.job is not None}
    by_key = {e.artifact_key: e for e in after.shard_sets}
    for entry in before.shard_sets:
        if entry.job is None or entry.job in still_named:
            continue
        view = job_views.get(entry.job)
        if view is not None and view.finished:
            yield entry, by_key.get(entry.artifact_key), view


def first_ready(before: ShardedModelStatus, after: ShardedModelStatus) -> bool:
    """Whether a pass turned `Ready` True for the first time in the resource's life.

    The status keeps no record of earlier Ready spells; the conditions' transition times tell.
    The first pass sets every condition at once, and `lastTransitionTime` moves only when a
    condition flips, so a `Ready` that has been False since then is the oldest condition. A
    resource that was Ready and lost it has flipped `Ready` since: some condition that stayed
    put (`Degraded`, `TargetsPatched`) is older.
    """
    new = conditions.find(after.conditions, conditions.READY)
    if new is None or new.status != "True":
        return False
    old = conditions.find(before.conditions, conditions.READY)
    if old is None:
        return True
    if old.status == "True":
        return False
    since = _parse_time(old.last_transition_time)
    times = [_parse_time(c.last_transition_time) for c in before.conditions]
    known = [t for t in times if t is not None]
    return since is not None and len(known) == len(times) and since <= min(known)


def _parse_time(text: object) -> datetime | None:
    """An RFC 3339 time as Kubernetes writes it; None for anything else."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def _job_kind(manifest: Manifest) -> str:
    """The kind of a Job the plan creates: its command label, else the kind in its name
    (`<name>-<key>-<kind>-<run>`)."""
    metadata = manifest.get("metadata") or {}
    label = (metadata.get("labels") or {}).get(LABEL_COMMAND)
    if label:
        return str(label)
    parts = str(metadata.get("name", "")).rsplit("-", 2)
    return parts[-2] if len(parts) == 3 else metrics.UNKNOWN_KIND


def _check_of(entry: ShardSetStatus) -> str:
    """Which check a verify Job of a set in this stage was."""
    if entry.stage == "Probing":
        return metrics.PROBE
    if entry.stage == "Verified":
        return metrics.REVERIFY
    return metrics.VERIFY


def _verification_reason(outcome: Outcome, result: ShardSetStatus | None) -> str:
    """What a verification found: the Job's reason, or the planner's when it refused a set the
    Job found whole (a set of another TP size)."""
    if outcome.ok and result is not None and result.stage == "Failed":
        return result.reason
    return outcome.reason


def now_utc() -> datetime:
    """The current time, timezone-aware."""
    return datetime.now().astimezone()


def observed_for(
    jobs_by_name: Mapping[str, JobView],
    deployments: Mapping[str, Manifest],
    sets_used_elsewhere: frozenset[str],
    now: datetime,
    *,
    target_pods: Mapping[str, tuple[TargetPodView, ...]] | None = None,
    progress: Mapping[str, str] | None = None,
) -> Observed:
    """Bundle what the indexes hold for one ShardedModel."""
    return Observed(
        jobs=dict(jobs_by_name),
        deployments=dict(deployments),
        now=now,
        sets_used_elsewhere=sets_used_elsewhere,
        target_pods=dict(target_pods or {}),
        progress=dict(progress or {}),
    )


def trim(obj: Mapping[str, Any]) -> Manifest:
    """A copy without managedFields: the indexes keep what planning reads, not more."""
    result = dict(obj)
    metadata = dict(result.get("metadata") or {})
    metadata.pop("managedFields", None)
    result["metadata"] = metadata
    return result
