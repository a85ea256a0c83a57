"""The deletion of a ShardedModel, decided like any other pass: from its last status, the
Deployments it patched and its Jobs, what to undo and what is left to wait for.

The reconciler carries it out: restores the targets (each read afresh first: a restore must
undo the patch as it is now), stops running Jobs, starts the delete Jobs, and lets go of the
ShardedModel once nothing is left.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from preshard.api.models import ShardedModelSpec
from preshard.api.status import ShardedModelStatus
from preshard.builders import Manifest, jobs, patching
from preshard.builders.shardset import Owner, ShardSet, child_name
from preshard.contract import reasons
from preshard.controller.observe import JobView
from preshard.controller.plan.model import Event
from preshard.settings import Settings

ANNOTATION_SKIP_CLEANUP: Final = "preshard.dev/skip-cleanup"


@dataclass(frozen=True)
class Deletion:
    """What deleting a ShardedModel takes now."""

    skipped: bool = False
    """The user released it without cleanup (`preshard.dev/skip-cleanup`)."""
    restore: tuple[str, ...] = ()
    """Deployments it patched, to restore."""
    stop_jobs: tuple[str, ...] = ()
    """Its Jobs still running, to delete."""
    create_jobs: tuple[Manifest, ...] = ()
    """Delete Jobs to start, one per set of retention `Delete` that no one else lists."""
    running: tuple[str, ...] = ()
    """Delete Jobs started earlier and not finished."""
    finished: tuple[JobView, ...] = ()
    """Delete Jobs that finished (their results count once)."""
    failed: str | None = None
    """Why a delete Job failed: the deletion waits, and gives up after its timeout."""
    deleted: int = 0
    """How many sets are deleted once every delete Job succeeded."""

    @property
    def waiting(self) -> tuple[str, ...]:
        """What is left to wait for, as the condition of a pending deletion says it."""
        return (
            *(f"{j['metadata']['name']} created" for j in self.create_jobs),
            *(f"{name} running" for name in self.running),
        )

    def events(self) -> list[Event]:
        """The events of a deletion with nothing left to wait for."""
        if self.skipped:
            return [
                Event(
                    "Warning",
                    reasons.CLEANUP_FAILED,
                    f"cleanup skipped ({ANNOTATION_SKIP_CLEANUP}=true): Deployments stay patched "
                    "and shard sets stay in storage",
                )
            ]
        if not self.deleted:
            return []
        return [Event("Normal", reasons.DELETED, f"{self.deleted} shard set(s) deleted")]


def plan_deletion(
    owner: Owner,
    annotations: Mapping[str, str],
    spec: ShardedModelSpec | None,
    status: ShardedModelStatus,
    deployments: Mapping[str, Manifest],
    job_views: Mapping[str, JobView],
    sets_used_elsewhere: frozenset[str],
    settings: Settings,
) -> Deletion:
    """What deleting `owner` takes now; `spec` is None when it does not parse (its sets are
    then left in storage, as with retention `Retain`)."""
    if annotations.get(ANNOTATION_SKIP_CLEANUP) == "true":
        return Deletion(skipped=True)
    restore = tuple(
        name
        for name, deployment in sorted(deployments.items())
        if patching.owner_of(deployment) == owner.name
    )
    stop_jobs = tuple(
        entry.job
        for entry in status.shard_sets
        if entry.job is not None and entry.job in job_views and not job_views[entry.job].finished
    )
    if spec is None or spec.storage.retention != "Delete":
        return Deletion(restore=restore, stop_jobs=stop_jobs)
    create: list[Manifest] = []
    running: list[str] = []
    finished: list[JobView] = []
    failed: str | None = None
    for entry in status.shard_sets:
        if entry.uri in sets_used_elsewhere:
            continue
        shard_set = ShardSet.for_spec(spec, entry.tensor_parallel_size, entry.artifact_key)
        run = entry.delete_run + 1
        view = job_views.get(child_name(owner, shard_set, jobs.DELETE, run))
        if view is None:
            job = jobs.JobInput(
                owner=owner, spec=spec, shard_set=shard_set, settings=settings, run=run
            )
            create.append(jobs.build_delete_job(job))
            continue
        if not view.finished:
            running.append(view.name)
            continue
        finished.append(view)
        if not view.succeeded and failed is None:
            outcome = view.outcome()
            failed = f"deleting {entry.uri} failed ({outcome.reason}: {outcome.message})"
    return Deletion(
        restore=restore,
        stop_jobs=stop_jobs,
        create_jobs=tuple(create),
        running=tuple(running),
        finished=tuple(finished),
        failed=failed,
        deleted=len(status.shard_sets),
    )
