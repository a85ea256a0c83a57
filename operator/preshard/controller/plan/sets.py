"""One shard set's step: probe, serialize or reshard, verify, back off, fail; and the step of a
set no longer wanted: kept while a target loads it, then released or deleted.

Each step takes the set's previous entry (through the context) and returns its new entry with
the actions it needs: the Job to create or delete, the time to look again, an event.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from datetime import timedelta
from typing import Final

from preshard.api.status import ShardSetStatus, Stage
from preshard.builders import Manifest, jobs
from preshard.builders.shardset import ShardSet, child_name
from preshard.contract import reasons
from preshard.contract.layout import shard_set_location
from preshard.contract.outcome import Outcome
from preshard.controller.plan.context import Actions, Context
from preshard.controller.plan.model import ANNOTATION_RETRY, Event, clip, parse_time, timestamp

# Failures worth trying again later on their own: the store or the network may come back.
TRANSIENT: Final = frozenset(
    {
        reasons.UNREACHABLE,
        reasons.ACCESS_DENIED,
        reasons.BUCKET_NOT_FOUND,
        reasons.INTERNAL_ERROR,
        reasons.JOB_FAILED,
        reasons.DEADLINE_EXCEEDED,
        reasons.EVICTED,
    }
)
# A serialization that failed because the store went away is started again after a back-off
# (the upload resumes what is there), up to this many runs in all; other failures need a
# spec change or the retry annotation.
SERIALIZE_RETRIED: Final = frozenset({reasons.UNREACHABLE, reasons.EVICTED})
SERIALIZE_RUNS: Final = 3

Step = tuple[ShardSetStatus, Actions]
"""A set's new entry and the actions that take it there."""


def advance(context: Context, shard_set: ShardSet) -> Step:
    """The next step of a wanted shard set."""
    entry = context.previous.get(shard_set.artifact_key)
    max_gpus = context.settings.max_gpus_per_job
    if shard_set.tensor_parallel_size > max_gpus:
        failed = _entry(
            context,
            shard_set,
            stage="Failed",
            reason=reasons.TP_EXCEEDS_GPUS,
            message=(
                f"tensor-parallel size {shard_set.tensor_parallel_size} needs more GPUs than "
                f"one serialization Job may request ({max_gpus})"
            ),
        )
        return failed, Actions()
    if entry is None:
        entry = _entry(context, shard_set, stage="Probing", reason=reasons.PROBING)
        return _start(context, entry, shard_set, jobs.VERIFY)
    resource = context.resource
    token = resource.annotations.get(ANNOTATION_RETRY)
    retried = token is not None and token != entry.retry_token
    respecified = (
        entry.failed_generation is not None and resource.generation > entry.failed_generation
    )
    if entry.stage == "Failed" and (retried or respecified):
        entry = entry.model_copy(
            update={"retry_token": token, "failures": 0, "failed_generation": None}
        )
        return _start(context, entry, shard_set, jobs.SERIALIZE)
    # A set dropped from the spec while its Job ran keeps its stage, without the Job.
    stopped = entry.job is None and entry.next_check is None
    if entry.stage in ("Superseded", "Deleting") or (
        stopped and entry.stage not in ("Verified", "Failed")
    ):
        # Wanted again before it was deleted: stop a delete Job that runs, then check what
        # is left (the delete removes the manifest first, so a started one is a new set).
        stop = Actions()
        if entry.job is not None and _kind_of(entry.job) == jobs.DELETE:
            stop = Actions(delete_jobs=(entry.job,))
        probing, start = _start(
            context, entry.model_copy(update={"stage": "Probing"}), shard_set, jobs.VERIFY
        )
        return probing, stop + start
    if entry.job is not None:
        return _follow(context, entry, shard_set)
    due = parse_time(entry.next_check)
    if entry.stage in ("Probing", "Serializing", "Verifying", "Verified") and due is not None:
        if context.now >= due:
            kind = jobs.SERIALIZE if entry.stage == "Serializing" else jobs.VERIFY
            return _start(context, entry, shard_set, kind)
        return entry, Actions(wake_at=due)
    return entry, Actions()


def retire(
    context: Context, entry: ShardSetStatus, in_use: Set[str]
) -> tuple[ShardSetStatus | None, Actions]:
    """The step of a set the spec no longer wants: its new entry, or None once it is released
    or deleted. `in_use` holds the sets the target Deployments still load."""
    shard_set = ShardSet(
        tensor_parallel_size=entry.tensor_parallel_size,
        artifact_key=entry.artifact_key,
        location=ShardSet.for_spec(context.spec, 1, entry.artifact_key).location,
    )
    if entry.artifact_key in in_use:
        stop = Actions() if entry.job is None else Actions(delete_jobs=(entry.job,))
        superseded = entry.model_copy(
            update={
                "stage": "Superseded" if entry.stage == "Verified" else entry.stage,
                "reason": reasons.SUPERSEDED,
                "message": "no longer wanted; kept while a target still loads it",
                "job": None,
                "next_check": None,
                "progress": None,
            }
        )
        return superseded, stop
    stop = Actions()
    if entry.job is not None and _kind_of(entry.job) != jobs.DELETE:
        stop = Actions(delete_jobs=(entry.job,))
        entry = entry.model_copy(update={"job": None})
    deletable = (
        context.spec.storage.retention == "Delete"
        and entry.uri not in context.observed.sets_used_elsewhere
        and entry.stage not in ("Probing", "Failed")
    )
    if not deletable:
        released = Event("Normal", reasons.RELEASED, f"shard set {entry.uri} is no longer used")
        return None, stop + Actions(events=(released,))
    if entry.stage == "Deleting" and entry.job is None and entry.reason == reasons.DELETED:
        deleted = Event("Normal", reasons.DELETED, f"shard set {entry.uri} deleted")
        return None, stop + Actions(events=(deleted,))
    if entry.job is not None:
        followed, actions = _follow(context, entry, shard_set)
        return followed, stop + actions
    due = parse_time(entry.next_check)
    if due is not None and context.now < due:
        return entry, stop + Actions(wake_at=due)
    deleting, start = _start(context, entry, shard_set, jobs.DELETE)
    return deleting, stop + start


def _follow(context: Context, entry: ShardSetStatus, shard_set: ShardSet) -> Step:
    assert entry.job is not None  # noqa: S101 - the caller checked
    job = context.observed.jobs.get(entry.job)
    kind = _kind_of(entry.job)
    if job is None:
        # Not in the index yet (just created) or deleted under us: creating is idempotent.
        manifest = _build(context, kind, shard_set, _run_of(entry.job), entry)
        return entry, Actions(create_jobs=(manifest,))
    if job.deleting:
        # Deleted under us and not gone yet: it will not finish, and its name stays taken
        # until it is gone. The next run has a name of its own.
        return _start(context, entry, shard_set, kind)
    if not job.finished:
        problem = job.problem
        if problem is not None:
            return entry.model_copy(update={"reason": problem[0], "message": problem[1]}), Actions()
        running = _running_reason(kind, entry.stage)
        # An unknown progress keeps the last one known: a log that cannot be read now
        # (a restarted operator, a node that serves no logs) is no step back.
        step = context.observed.progress.get(job.name) or entry.progress
        if (entry.reason, entry.progress) == (running, step):
            return entry, Actions()
        updated = entry.model_copy(
            update={
                "reason": running,
                # A problem the pod had (a missing Secret, say) is gone.
                "message": entry.message
                if entry.reason == running
                else f"Job {job.name} is running",
                "progress": step,
            }
        )
        return updated, Actions()
    entry = entry.model_copy(update={"progress": None})
    outcome = job.outcome()
    if kind in (jobs.SERIALIZE, jobs.RESHARD):
        return _serialized(context, entry, shard_set, outcome)
    if kind == jobs.DELETE:
        return _deleted(context, entry, outcome)
    return _verified(context, entry, shard_set, outcome)


def _verified(
    context: Context, entry: ShardSetStatus, shard_set: ShardSet, outcome: Outcome
) -> Step:
    if outcome.ok:
        if outcome.tensor_parallel_size not in (None, shard_set.tensor_parallel_size):
            failed = _fail(
                context,
                entry,
                reasons.TP_MISMATCH,
                f"the set at {shard_set.uri} holds TP {outcome.tensor_parallel_size}, "
                f"not {shard_set.tensor_parallel_size}",
            )
            return failed, Actions()
        interval = context.spec.verification.interval_seconds
        message = outcome.message or f"complete at {shard_set.uri}"
        if entry.resharded_from is not None:
            message = f"resharded on CPU from {entry.resharded_from}; {message}"
        verified = entry.model_copy(
            update={
                "stage": "Verified",
                "reason": reasons.ALREADY_SERIALIZED
                if entry.stage == "Probing"
                else reasons.VERIFIED,
                "message": message,
                "job": None,
                "failures": 0,
                "verified_at": context.stamp,
                "next_check": timestamp(context.now + timedelta(seconds=interval))
                if interval
                else None,
                "total_bytes": outcome.total_bytes,
                "files": outcome.files,
                "vllm_version": outcome.vllm_version or entry.vllm_version,
                "tensorizer_version": outcome.tensorizer_version or entry.tensorizer_version,
                "manifest_format": outcome.manifest_format,
            }
        )
        return verified, Actions()
    if entry.stage == "Probing" and outcome.reason == reasons.MANIFEST_MISSING:
        return _make(context, entry.model_copy(update={"failures": 0}), shard_set)
    if outcome.reason in TRANSIENT:
        return _back_off(context, entry, outcome)
    return _fail(context, entry, outcome.reason, outcome.message), Actions()


def _serialized(
    context: Context, entry: ShardSetStatus, shard_set: ShardSet, outcome: Outcome
) -> Step:
    """After a serialize or reshard Job: verify what it wrote, or deal with its failure."""
    if outcome.ok:
        entry = entry.model_copy(
            update={
                "vllm_version": outcome.vllm_version,
                "tensorizer_version": outcome.tensorizer_version,
                "total_bytes": outcome.total_bytes,
                "files": outcome.files,
            }
        )
        return _start(context, entry, shard_set, jobs.VERIFY)
    if entry.stage == "Resharding":
        # Whatever stopped the reshard (a model it cannot lay out, an OOM kill, the store),
        # the GPU Job can still make the set; the event keeps the reshard's reason.
        fallback = Event(
            "Normal" if outcome.reason == reasons.RESHARD_UNSUPPORTED else "Warning",
            outcome.reason,
            clip(
                f"TP {shard_set.tensor_parallel_size} shard set {shard_set.artifact_key}: "
                f"reshard from {entry.resharded_from} failed, serializing on GPUs "
                f"instead: {outcome.message}"
            ),
        )
        serializing, start = _start(context, entry, shard_set, jobs.SERIALIZE)
        return serializing, Actions(events=(fallback,)) + start
    if outcome.reason in SERIALIZE_RETRIED and entry.serialize_run < SERIALIZE_RUNS:
        return _back_off(context, entry, outcome)
    return _fail(context, entry, outcome.reason, outcome.message), Actions()


def _deleted(context: Context, entry: ShardSetStatus, outcome: Outcome) -> Step:
    if outcome.ok:
        deleted = entry.model_copy(
            update={"stage": "Deleting", "reason": reasons.DELETED, "job": None}
        )
        return deleted, Actions()
    return _back_off(context, entry.model_copy(update={"reason": reasons.CLEANUP_FAILED}), outcome)


def _make(context: Context, entry: ShardSetStatus, shard_set: ShardSet) -> Step:
    """Write a set that is not in storage: on CPU from a sibling set if there is one.

    A sibling that is written and being verified right now is waited for: its check takes
    seconds, where a serialize Job holds GPUs for minutes. The set stays on its finished probe
    meanwhile, so each pass decides again, and the sibling's status write wakes the next one.
    """
    siblings = _siblings(context, shard_set)
    source = _smallest(e for e in siblings if e.stage in ("Verified", "Superseded"))
    if source is None:
        pending = _smallest(e for e in siblings if e.stage == "Verifying" and e.job is not None)
        if pending is not None:
            waiting = entry.model_copy(
                update={
                    "reason": reasons.WAITING_FOR_SOURCE,
                    "message": f"not in storage; waits for the TP {pending.tensor_parallel_size} "
                    f"set {pending.artifact_key}, being verified now, to reshard from it on CPU",
                }
            )
            return waiting, Actions()
        return _start(context, entry, shard_set, jobs.SERIALIZE)
    started, start = _start(
        context,
        entry.model_copy(update={"resharded_from": source.artifact_key}),
        shard_set,
        jobs.RESHARD,
    )
    resharding = started.model_copy(
        update={
            "message": f"resharding on CPU from the TP {source.tensor_parallel_size} set "
            f"{source.artifact_key}: {started.message}"
        }
    )
    return resharding, start


def _siblings(context: Context, shard_set: ShardSet) -> list[ShardSetStatus]:
    """This spec's sets at other TP sizes, if resharding is on: the possible reshard sources.

    A sibling's key must be the one the current spec gives its TP size: then model, revision,
    dtype, image (vLLM version), engine arguments and encryption key are the same, and the
    TP size is the only difference. A `Verified` one is a source, and so is one still loaded
    after the spec moved on (`Superseded`).
    """
    if not context.spec.serialization.reshard:
        return []
    return [
        e
        for e in context.previous.values()
        if e.tensor_parallel_size != shard_set.tensor_parallel_size
        and e.artifact_key == context.key(e.tensor_parallel_size)
    ]


def _smallest(entries: Iterable[ShardSetStatus]) -> ShardSetStatus | None:
    """The set of the smallest TP size, so the choice of a source is stable."""
    return min(entries, key=lambda e: e.tensor_parallel_size, default=None)


def _start(context: Context, entry: ShardSetStatus, shard_set: ShardSet, kind: str) -> Step:
    counter = {
        jobs.VERIFY: "verify_run",
        jobs.SERIALIZE: "serialize_run",
        jobs.RESHARD: "reshard_run",
    }.get(kind, "delete_run")
    # Past every run the cluster still has or just lost: a set released and wanted again
    # starts its counters at zero, while Jobs of its earlier life may remain (finished, or
    # deleted a moment ago), and no such name may be taken for the new run.
    recorded = int(getattr(entry, counter))
    last = _last_run(context, shard_set, kind)
    run = max(recorded, last) + 1
    if last > recorded and _running(
        context, child_name(context.resource.owner, shard_set, kind, last)
    ):
        # A run the status never recorded, still running: the operator stopped between
        # creating its Job and writing the status. That Job is this run (a second one would
        # hold the GPUs twice); creating it again is a no-op.
        run = last
    if kind == jobs.SERIALIZE:
        entry = entry.model_copy(update={"resharded_from": None})
    manifest = _build(context, kind, shard_set, run, entry)
    stage: Stage = entry.stage
    if kind == jobs.SERIALIZE:
        stage = "Serializing"
    elif kind == jobs.RESHARD:
        stage = "Resharding"
    elif kind == jobs.DELETE:
        stage = "Deleting"
    elif entry.stage in ("Serializing", "Resharding", "Failed"):
        stage = "Verifying"
    started = entry.model_copy(
        update={
            counter: run,
            "job": manifest["metadata"]["name"],
            "stage": stage,
            "reason": _running_reason(kind, stage),
            "message": f"Job {manifest['metadata']['name']} is running",
            "next_check": None,
        }
    )
    return started, Actions(create_jobs=(manifest,))


def _running(context: Context, name: str) -> bool:
    """Whether a Job runs and is not on its way out."""
    job = context.observed.jobs.get(name)
    return (
        job is not None
        and not job.finished
        and not job.deleting
        and name not in context.observed.deleted_jobs
    )


def _last_run(context: Context, shard_set: ShardSet, kind: str) -> int:
    """The highest run of this set's Jobs of this kind that the cluster still has, or that
    was deleted a moment ago."""
    prefix = child_name(context.resource.owner, shard_set, kind, 0)[:-1]
    names = [*context.observed.jobs, *context.observed.deleted_jobs]
    return max((_run_of(name) for name in names if name.startswith(prefix)), default=0)


def _back_off(context: Context, entry: ShardSetStatus, outcome: Outcome) -> Step:
    failures = entry.failures + 1
    delay = min(
        context.settings.retry_backoff_seconds * 2 ** (failures - 1),
        context.settings.retry_backoff_max_seconds,
    )
    due = context.now + timedelta(seconds=delay)
    waiting = entry.model_copy(
        update={
            "job": None,
            "failures": failures,
            "reason": outcome.reason,
            "message": clip(f"{outcome.message} (attempt {failures}; next in {delay}s)"),
            "next_check": timestamp(due),
        }
    )
    return waiting, Actions(wake_at=due)


def _fail(context: Context, entry: ShardSetStatus, reason: str, message: str) -> ShardSetStatus:
    return entry.model_copy(
        update={
            "stage": "Failed",
            "reason": reason,
            "message": clip(message),
            "job": None,
            "next_check": None,
            "failed_generation": context.resource.generation,
        }
    )


def _entry(
    context: Context, shard_set: ShardSet, *, stage: Stage, reason: str, message: str = ""
) -> ShardSetStatus:
    previous = context.previous.get(shard_set.artifact_key)
    base = previous or ShardSetStatus(
        tensor_parallel_size=shard_set.tensor_parallel_size,
        artifact_key=shard_set.artifact_key,
        uri=shard_set.uri,
        stage=stage,
    )
    return base.model_copy(update={"stage": stage, "reason": reason, "message": message})


def _build(
    context: Context, kind: str, shard_set: ShardSet, run: int, entry: ShardSetStatus
) -> Manifest:
    job_input = jobs.JobInput(
        owner=context.resource.owner,
        spec=context.spec,
        shard_set=shard_set,
        settings=context.settings,
        run=run,
    )
    if kind == jobs.RESHARD:
        assert entry.resharded_from is not None  # noqa: S101 - _make records it first
        source = shard_set_location(context.spec.storage.uri, entry.resharded_from)
        return jobs.build_reshard_job(job_input, source)
    builder = {
        jobs.SERIALIZE: jobs.build_serialize_job,
        jobs.DELETE: jobs.build_delete_job,
    }.get(kind, jobs.build_verify_job)
    return builder(job_input)


def _running_reason(kind: str, stage: Stage) -> str:
    """The reason a set carries while a Job of this kind runs for it."""
    if kind == jobs.SERIALIZE:
        return reasons.SERIALIZING
    if kind == jobs.RESHARD:
        return reasons.RESHARDING
    if kind == jobs.DELETE:
        return reasons.SUPERSEDED
    if stage == "Verified":
        return reasons.VERIFIED
    return reasons.PROBING if stage == "Probing" else reasons.VERIFYING


def _kind_of(job_name: str) -> str:
    return job_name.rsplit("-", 2)[-2]


def _run_of(job_name: str) -> int:
    return int(job_name.rsplit("-", 1)[-1])
