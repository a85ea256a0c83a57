"""The service layer: parse a ShardedModel, plan, carry the plan out, record the status.

Handlers call `Reconciler.reconcile` and `Reconciler.cleanup`; both are synchronous and run in
kopf's thread pool. Every API call goes through `preshard.controller.kube`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from preshard import reasons
from preshard.api import models
from preshard.api.models import InvalidSpecError, ShardedModelSpec, parse_spec
from preshard.api.status import ShardedModelStatus
from preshard.builders import jobs, target
from preshard.builders.common import Manifest, Owner, ShardSet, child_name
from preshard.controller import kube
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
from preshard.settings import Settings

ANNOTATION_SKIP_CLEANUP: Final = "preshard.dev/skip-cleanup"
NOT_FOUND_RETRY_SECONDS: Final = 1.0
# How long a write of this operator (a Job created, a Deployment patched) is remembered while
# the watch stream that will show it catches up.
RECENT_WRITE_SECONDS: Final = 30.0

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
    """Writes made in the last `RECENT_WRITE_SECONDS`, shared by kopf's worker threads.

    An index lags behind the writes that change it; a pass that plans from it before it caught
    up would repeat a write that was already made (and be refused). Keys name the write: a Job
    by namespace and name, a Deployment patch by the uid and generation it was planned from.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[tuple[str, ...], float] = {}

    def __contains__(self, key: tuple[str, ...]) -> bool:
        with self._lock:
            made = self._at.get(key)
            return made is not None and time.monotonic() - made < RECENT_WRITE_SECONDS

    def remember(self, key: tuple[str, ...]) -> None:
        """Record a write made now, and forget those too old to matter."""
        now = time.monotonic()
        with self._lock:
            self._at = {k: t for k, t in self._at.items() if now - t < RECENT_WRITE_SECONDS}
            self._at[key] = now


@dataclass
class _Written:
    """The status this operator wrote last, until the watch stream shows it."""

    before: Manifest
    after: Manifest


class Reconciler:
    """Reconciles ShardedModels through one Kubernetes client."""

    def __init__(self, client: kube.Kube, settings: Settings) -> None:
        self.kube = client
        self.settings = settings
        self._written: dict[tuple[str, str], _Written] = {}
        self._recent = RecentWrites()

    def reconcile(self, body: Manifest, observed: Observed) -> Result:
        """One pass for one ShardedModel: decide, act, record."""
        metadata = body.get("metadata") or {}
        namespace, name = str(metadata["namespace"]), str(metadata["name"])
        generation = int(metadata.get("generation") or 0)
        raw_status = self._known_status(namespace, name, body.get("status") or {})
        status = ShardedModelStatus.model_validate(raw_status)
        try:
            spec = parse_spec(body.get("spec"))
        except InvalidSpecError as error:
            new_status = plan_invalid(status, generation, str(error), observed.now)
            changed = self._write_status(namespace, name, raw_status, new_status)
            events = [Event("Warning", reasons.INVALID_SPEC, str(error))] if changed else []
            return Result(events=events)
        resource = Resource(
            owner=Owner(name=name, namespace=namespace, uid=str(metadata.get("uid", ""))),
            generation=generation,
            annotations=metadata.get("annotations") or {},
            spec=spec,
            status=status,
        )
        decided = plan(resource, observed, self.settings)
        requeue = self.execute(decided, namespace, object_log(namespace, name, resource.owner.uid))
        self._write_status(namespace, name, raw_status, decided.status)
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
        """Undo what preshard did for a deleted ShardedModel; `CleanupPendingError` means wait."""
        metadata = body.get("metadata") or {}
        namespace, name = str(metadata["namespace"]), str(metadata["name"])
        if (metadata.get("annotations") or {}).get(ANNOTATION_SKIP_CLEANUP) == "true":
            return [
                Event(
                    "Warning",
                    reasons.CLEANUP_FAILED,
                    f"cleanup skipped ({ANNOTATION_SKIP_CLEANUP}=true): Deployments stay patched "
                    "and shard sets stay in storage",
                )
            ]
        events = self._restore_targets(namespace, name, deployments)
        status = ShardedModelStatus.model_validate(body.get("status") or {})
        for entry in status.shard_sets:
            running = job_views.get(entry.job) if entry.job else None
            if running is not None and not running.finished:
                self.kube.delete_job(namespace, running.name)
        self._written.pop((namespace, name), None)
        try:
            spec: ShardedModelSpec | None = parse_spec(body.get("spec"))
        except InvalidSpecError:
            spec = None
        if spec is None or spec.storage.retention != "Delete":
            return events
        owner = Owner(name=name, namespace=namespace, uid=str(metadata.get("uid", "")))
        waiting: list[str] = []
        for entry in status.shard_sets:
            if entry.uri in sets_used_elsewhere:
                continue
            shard_set = ShardSet.for_spec(spec, entry.tensor_parallel_size, entry.artifact_key)
            run = entry.delete_run + 1
            job_name = child_name(owner, shard_set, jobs.DELETE, run)
            view = job_views.get(job_name)
            if view is None:
                delete_job = jobs.build_delete_job(
                    jobs.JobInput(
                        owner=owner, spec=spec, shard_set=shard_set, settings=self.settings, run=run
                    )
                )
                try:
                    self.kube.create_job(delete_job)
                except kube.NamespaceTerminatingError:
                    events.append(
                        Event(
                            "Warning",
                            reasons.CLEANUP_FAILED,
                            "namespace is terminating: no Job can delete the shard sets; they "
                            "stay in storage",
                        )
                    )
                    return events
                waiting.append(f"{job_name} created")
            elif not view.finished:
                waiting.append(f"{job_name} running")
            elif not view.succeeded:
                outcome = view.outcome()
                raise CleanupPendingError(
                    f"deleting {entry.uri} failed ({outcome.reason}: {outcome.message})"
                )
        if waiting:
            raise CleanupPendingError("waiting for delete Jobs: " + ", ".join(waiting))
        events.append(
            Event("Normal", reasons.DELETED, f"{len(status.shard_sets)} shard set(s) deleted")
        )
        return events

    def _restore_targets(
        self, namespace: str, name: str, deployments: Mapping[str, Manifest]
    ) -> list[Event]:
        events: list[Event] = []
        for deployment_name, deployment in sorted(deployments.items()):
            if target.owner_of(deployment) != name:
                continue
            try:
                current = self.kube.get_deployment(namespace, deployment_name)
            except kube.NotFoundError:
                continue
            restored = target.build_restored_deployment(current)
            if restored is None:
                continue
            try:
                self.kube.patch_deployment(
                    namespace, deployment_name, target.deployment_patch(current, restored)
                )
            except kube.ConflictError as error:
                raise CleanupPendingError(str(error)) from None
            except kube.NotFoundError:
                continue
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
        for manifest in decided.create_jobs:
            job_name = manifest["metadata"]["name"]
            if ("job", namespace, job_name) in self._recent:
                # Created a moment ago; the Job index has not caught up yet.
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
                logger.info("created Job %s/%s", namespace, job_name)
        for patch in decided.patches:
            retry = self._patch(namespace, patch, logger)
            if retry is not None:
                # Not sent or refused: no event for it, and a look again later.
                requeue = retry if requeue is None else min(requeue, retry)
                decided.events = [e for e in decided.events if patch.name not in e.message]
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
        try:
            self.kube.patch_deployment(namespace, patch.name, patch.patch)
        except kube.ConflictError as error:
            # Someone else moved the Deployment on. Until the watch stream brings the new
            # version, a plan from this one would only be refused again.
            logger.info("%s", error)
            self._recent.remember(written)
            return RECENT_WRITE_SECONDS
        except kube.NotFoundError as error:
            logger.info("%s", error)
            return NOT_FOUND_RETRY_SECONDS
        self._recent.remember(written)
        return None

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
) -> Observed:
    """Bundle what the indexes hold for one ShardedModel."""
    return Observed(
        jobs=dict(jobs_by_name),
        deployments=dict(deployments),
        now=now,
        sets_used_elsewhere=sets_used_elsewhere,
        target_pods=dict(target_pods or {}),
    )


def trim(obj: Mapping[str, Any]) -> Manifest:
    """A copy without managedFields: the indexes keep what planning reads, not more."""
    result = dict(obj)
    metadata = dict(result.get("metadata") or {})
    metadata.pop("managedFields", None)
    result["metadata"] = metadata
    return result
