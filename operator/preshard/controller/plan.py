"""The reconcile decision: from the spec and what is observed, the next actions.

A pure function. It reads the parsed spec, the previous status, the ShardedModel's Jobs and the
namespace's Deployments, and returns the Jobs to create or delete, the Deployment patches, the
new status and the events. Running it twice on the same observation returns the same plan, and
a plan for a converged resource is empty.

Per shard set (one per wanted TP size) the lifecycle is:
probe (verify Job: already there?) → reshard (CPU Job, from a verified set of the same model at
another TP size) or serialize (GPU Job) → verify → Verified, re-verified every
`verification.intervalSeconds`. A reshard that fails for any reason falls back to the GPU Job.
Targets are pointed at a set only once it is Verified; while a new set is built they keep
serving the one they have (an ordered transition), and a set no longer wanted is released, or
deleted with retention `Delete`, once no target uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

from preshard.api import models
from preshard.api.status import (
    Condition,
    ShardedModelStatus,
    ShardSetStatus,
    Stage,
    TargetStatus,
)
from preshard.builders import jobs, target
from preshard.builders.common import Manifest, Owner, ShardSet, child_name
from preshard.builders.identity import serializer_vllm_version, shard_set_key
from preshard.builders.rollout import Rollout, rollout_of, template_digests
from preshard.contract import reasons
from preshard.contract.layout import shard_set_location
from preshard.contract.outcome import Outcome
from preshard.controller import conditions
from preshard.controller.observe import JobView, TargetPodView
from preshard.settings import Settings

ANNOTATION_RETRY: Final = "preshard.dev/retry"

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
MESSAGE_LIMIT: Final = 1024
# Target states whose Deployment loads its set (TargetsPatched), and those that need a person.
PATCHED_STATES: Final = frozenset({"Patched", "RollingOut", "Unavailable"})
TROUBLED_STATES: Final = frozenset({"Refused", "Conflict", "NotFound", "Unavailable", "RolledBack"})
# The same patch (same inputs, spec generation and retry value) is written at most this many
# times within the window; when something reverts it once more, the target is refused
# (TargetReverted) instead of restarting its GPU pods round after round.
PATCH_ROUNDS: Final = 3
PATCH_ROUNDS_WINDOW: Final = timedelta(minutes=10)

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the ShardedModel."""

    type: EventType
    reason: str
    message: str
    deployment: str | None = None
    """The target Deployment whose patch or restore this event announces: it is posted only if
    that write is made."""


@dataclass(frozen=True)
class DeploymentPatch:
    """A JSON patch for one Deployment."""

    name: str
    patch: list[Manifest]
    planned_from: tuple[str, int]
    """The Deployment's uid and generation the patch was planned from (its `test` checks the
    generation): a second patch from the same pair means the index has not caught up yet."""
    restore: bool = False
    kept: tuple[str, ...] = ()
    """A restore's note of preshard's fields the user changed since, kept as they are."""


@dataclass
class Plan:
    """What the controller does next."""

    status: ShardedModelStatus
    create_jobs: list[Manifest] = field(default_factory=list)
    delete_jobs: list[str] = field(default_factory=list)
    patches: list[DeploymentPatch] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None

    def wake_at(self, when: datetime, now: datetime) -> None:
        """Ask to be reconciled again no later than `when`."""
        delay = max(1.0, (when - now).total_seconds())
        self.requeue_after = delay if self.requeue_after is None else min(self.requeue_after, delay)


@dataclass(frozen=True)
class Observed:
    """Everything the planner reads besides the spec and status."""

    jobs: Mapping[str, JobView]
    deployments: Mapping[str, Manifest]
    now: datetime
    sets_used_elsewhere: frozenset[str] = frozenset()
    """URIs of this resource's shard sets that another ShardedModel lists too."""
    target_pods: Mapping[str, tuple[TargetPodView, ...]] = field(default_factory=dict)
    """The pods of patched templates, by Deployment name."""
    progress: Mapping[str, str] = field(default_factory=dict)
    """How far running Jobs are, by Job name, as their pods' logs last said (stepped)."""
    deleted_jobs: frozenset[str] = frozenset()
    """Names of this namespace's Jobs the operator deleted a few minutes ago: not to be used
    again yet (the Job controller would not start a pod for a new Job of such a name)."""


@dataclass(frozen=True)
class Resource:
    """The ShardedModel being reconciled."""

    owner: Owner
    generation: int
    annotations: Mapping[str, str]
    spec: models.ShardedModelSpec
    status: ShardedModelStatus


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC, second precision, as Kubernetes writes times."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    """The inverse of `timestamp`; None for None."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) if text else None


def plan(resource: Resource, observed: Observed, settings: Settings) -> Plan:
    """The next actions for one ShardedModel."""
    planner = _Planner(resource, observed, settings)
    return planner.run()


def plan_invalid(
    status: ShardedModelStatus, generation: int, message: str, now: datetime
) -> ShardedModelStatus:
    """The status of a ShardedModel whose spec does not parse: nothing else happens."""
    stamp = timestamp(now)
    result = status.conditions
    for type_ in (conditions.READY, conditions.SERIALIZED, conditions.VERIFIED):
        result = conditions.set_condition(
            result, type_, "False", reasons.INVALID_SPEC, message, now=stamp, generation=generation
        )
    return status.model_copy(update={"conditions": result, "observed_generation": generation})


class _Planner:
    def __init__(self, resource: Resource, observed: Observed, settings: Settings) -> None:
        self.resource = resource
        self.spec = resource.spec
        self.observed = observed
        self.settings = settings
        self.now = observed.now
        self.stamp = timestamp(observed.now)
        self.plan = Plan(status=resource.status)
        self.previous = {e.artifact_key: e for e in resource.status.shard_sets}
        # Sets a Deployment loads now, or its old pods load until its rollout completes.
        self.in_use: set[str] = set()

    # The whole pass --------------------------------------------------------------------------

    def run(self) -> Plan:
        desired = {
            tp: ShardSet.for_spec(self.spec, tp, self._key(tp))
            for tp in self.spec.tensor_parallel_sizes
        }
        entries = [self._advance(shard_set) for shard_set in desired.values()]
        wanted_keys = {s.artifact_key for s in desired.values()}
        by_key = {e.artifact_key: e for e in entries}
        targets = self._targets(desired, {**self.previous, **by_key})
        for key, entry in self.previous.items():
            if key not in wanted_keys:
                kept = self._retire(entry, self.in_use)
                if kept is not None:
                    entries.append(kept)
        status = ShardedModelStatus(
            observed_generation=self.resource.generation,
            conditions=self._conditions(
                [by_key[s.artifact_key] for s in desired.values()], targets
            ),
            shard_sets=entries,
            targets=targets,
        )
        self._announce(status)
        self.plan.status = status
        return self.plan

    def _key(self, tp: int) -> str:
        owner = self.resource.owner
        return shard_set_key(self.spec, tp, namespace=owner.namespace, settings=self.settings)

    # One shard set ---------------------------------------------------------------------------

    def _advance(self, shard_set: ShardSet) -> ShardSetStatus:
        entry = self.previous.get(shard_set.artifact_key)
        if shard_set.tensor_parallel_size > self.settings.max_gpus_per_job:
            return self._entry(
                shard_set,
                stage="Failed",
                reason=reasons.TP_EXCEEDS_GPUS,
                message=(
                    f"tensor-parallel size {shard_set.tensor_parallel_size} needs more GPUs than "
                    f"one serialization Job may request ({self.settings.max_gpus_per_job})"
                ),
            )
        if entry is None:
            entry = self._entry(shard_set, stage="Probing", reason=reasons.PROBING)
            return self._start(entry, shard_set, jobs.VERIFY)
        token = self.resource.annotations.get(ANNOTATION_RETRY)
        retried = token is not None and token != entry.retry_token
        respecified = (
            entry.failed_generation is not None
            and self.resource.generation > entry.failed_generation
        )
        if entry.stage == "Failed" and (retried or respecified):
            entry = entry.model_copy(
                update={"retry_token": token, "failures": 0, "failed_generation": None}
            )
            return self._start(entry, shard_set, jobs.SERIALIZE)
        # A set dropped from the spec while its Job ran keeps its stage, without the Job.
        stopped = entry.job is None and entry.next_check is None
        if entry.stage in ("Superseded", "Deleting") or (
            stopped and entry.stage not in ("Verified", "Failed")
        ):
            # Wanted again before it was deleted: stop a delete Job that runs, then check what
            # is left (the delete removes the manifest first, so a started one is a new set).
            if entry.job is not None and _kind_of(entry.job) == jobs.DELETE:
                self.plan.delete_jobs.append(entry.job)
            return self._start(
                entry.model_copy(update={"stage": "Probing"}), shard_set, jobs.VERIFY
            )
        if entry.job is not None:
            return self._follow(entry, shard_set)
        due = parse_time(entry.next_check)
        if entry.stage in ("Probing", "Serializing", "Verifying", "Verified") and due is not None:
            if self.now >= due:
                kind = jobs.SERIALIZE if entry.stage == "Serializing" else jobs.VERIFY
                return self._start(entry, shard_set, kind)
            self.plan.wake_at(due, self.now)
        return entry

    def _follow(self, entry: ShardSetStatus, shard_set: ShardSet) -> ShardSetStatus:
        assert entry.job is not None  # noqa: S101 - the caller checked
        job = self.observed.jobs.get(entry.job)
        kind = _kind_of(entry.job)
        if job is None:
            # Not in the index yet (just created) or deleted under us: creating is idempotent.
            self.plan.create_jobs.append(self._build(kind, shard_set, _run_of(entry.job), entry))
            return entry
        if job.deleting:
            # Deleted under us and not gone yet: it will not finish, and its name stays taken
            # until it is gone. The next run has a name of its own.
            return self._start(entry, shard_set, kind)
        if not job.finished:
            problem = job.problem
            if problem is not None:
                return entry.model_copy(update={"reason": problem[0], "message": problem[1]})
            running = _running_reason(kind, entry.stage)
            # An unknown progress keeps the last one known: a log that cannot be read now
            # (a restarted operator, a node that serves no logs) is no step back.
            step = self.observed.progress.get(job.name) or entry.progress
            if (entry.reason, entry.progress) == (running, step):
                return entry
            return entry.model_copy(
                update={
                    "reason": running,
                    # A problem the pod had (a missing Secret, say) is gone.
                    "message": entry.message
                    if entry.reason == running
                    else f"Job {job.name} is running",
                    "progress": step,
                }
            )
        entry = entry.model_copy(update={"progress": None})
        outcome = job.outcome()
        if kind in (jobs.SERIALIZE, jobs.RESHARD):
            return self._serialized(entry, shard_set, outcome)
        if kind == jobs.DELETE:
            return self._deleted(entry, shard_set, outcome)
        return self._verified(entry, shard_set, outcome)

    def _verified(
        self, entry: ShardSetStatus, shard_set: ShardSet, outcome: Outcome
    ) -> ShardSetStatus:
        if outcome.ok:
            if outcome.tensor_parallel_size not in (None, shard_set.tensor_parallel_size):
                return self._fail(
                    entry,
                    reasons.TP_MISMATCH,
                    f"the set at {shard_set.uri} holds TP {outcome.tensor_parallel_size}, "
                    f"not {shard_set.tensor_parallel_size}",
                )
            interval = self.spec.verification.interval_seconds
            message = outcome.message or f"complete at {shard_set.uri}"
            if entry.resharded_from is not None:
                message = f"resharded on CPU from {entry.resharded_from}; {message}"
            return entry.model_copy(
                update={
                    "stage": "Verified",
                    "reason": reasons.ALREADY_SERIALIZED
                    if entry.stage == "Probing"
                    else reasons.VERIFIED,
                    "message": message,
                    "job": None,
                    "failures": 0,
                    "verified_at": self.stamp,
                    "next_check": timestamp(self.now + timedelta(seconds=interval))
                    if interval
                    else None,
                    "total_bytes": outcome.total_bytes,
                    "files": outcome.files,
                    "vllm_version": outcome.vllm_version or entry.vllm_version,
                    "tensorizer_version": outcome.tensorizer_version or entry.tensorizer_version,
                }
            )
        if entry.stage == "Probing" and outcome.reason == reasons.MANIFEST_MISSING:
            return self._make(entry.model_copy(update={"failures": 0}), shard_set)
        if outcome.reason in TRANSIENT:
            return self._back_off(entry, outcome)
        return self._fail(entry, outcome.reason, outcome.message)

    def _serialized(
        self, entry: ShardSetStatus, shard_set: ShardSet, outcome: Outcome
    ) -> ShardSetStatus:
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
            return self._start(entry, shard_set, jobs.VERIFY)
        if entry.stage == "Resharding":
            # Whatever stopped the reshard (a model it cannot lay out, an OOM kill, the store),
            # the GPU Job can still make the set; the event keeps the reshard's reason.
            self.plan.events.append(
                Event(
                    "Normal" if outcome.reason == reasons.RESHARD_UNSUPPORTED else "Warning",
                    outcome.reason,
                    _clip(
                        f"TP {shard_set.tensor_parallel_size} shard set {shard_set.artifact_key}: "
                        f"reshard from {entry.resharded_from} failed, serializing on GPUs "
                        f"instead: {outcome.message}"
                    ),
                )
            )
            return self._start(entry, shard_set, jobs.SERIALIZE)
        if outcome.reason in SERIALIZE_RETRIED and entry.serialize_run < SERIALIZE_RUNS:
            return self._back_off(entry, outcome)
        return self._fail(entry, outcome.reason, outcome.message)

    def _deleted(
        self, entry: ShardSetStatus, shard_set: ShardSet, outcome: Outcome
    ) -> ShardSetStatus:
        if outcome.ok:
            return entry.model_copy(
                update={"stage": "Deleting", "reason": reasons.DELETED, "job": None}
            )
        return self._back_off(entry.model_copy(update={"reason": reasons.CLEANUP_FAILED}), outcome)

    def _make(self, entry: ShardSetStatus, shard_set: ShardSet) -> ShardSetStatus:
        """Write a set that is not in storage: on CPU from a sibling set if there is one."""
        source = self._reshard_source(shard_set)
        if source is None:
            return self._start(entry, shard_set, jobs.SERIALIZE)
        started = self._start(
            entry.model_copy(update={"resharded_from": source.artifact_key}),
            shard_set,
            jobs.RESHARD,
        )
        return started.model_copy(
            update={
                "message": f"resharding on CPU from the TP {source.tensor_parallel_size} set "
                f"{source.artifact_key}: {started.message}"
            }
        )

    def _reshard_source(self, shard_set: ShardSet) -> ShardSetStatus | None:
        """A verified set of this spec at another TP size, if resharding is on.

        Its key must be the one the current spec gives its TP size: then model, revision,
        dtype, image (vLLM version), engine arguments and encryption key are the same, and the
        TP size is the only difference. A set still loaded after the spec moved on
        (`Superseded`) qualifies too. The smallest TP size wins, so the choice is stable.
        """
        if not self.spec.serialization.reshard:
            return None
        candidates = [
            e
            for e in self.previous.values()
            if e.stage in ("Verified", "Superseded")
            and e.tensor_parallel_size != shard_set.tensor_parallel_size
            and e.artifact_key == self._key(e.tensor_parallel_size)
        ]
        return min(candidates, key=lambda e: e.tensor_parallel_size, default=None)

    def _start(self, entry: ShardSetStatus, shard_set: ShardSet, kind: str) -> ShardSetStatus:
        counter = {
            jobs.VERIFY: "verify_run",
            jobs.SERIALIZE: "serialize_run",
            jobs.RESHARD: "reshard_run",
        }.get(kind, "delete_run")
        # Past every run the cluster still has or just lost: a set released and wanted again
        # starts its counters at zero, while Jobs of its earlier life may remain (finished, or
        # deleted a moment ago), and no such name may be taken for the new run.
        run = max(int(getattr(entry, counter)), self._last_run(shard_set, kind)) + 1
        if kind == jobs.SERIALIZE:
            entry = entry.model_copy(update={"resharded_from": None})
        manifest = self._build(kind, shard_set, run, entry)
        self.plan.create_jobs.append(manifest)
        stage: Stage = entry.stage
        if kind == jobs.SERIALIZE:
            stage = "Serializing"
        elif kind == jobs.RESHARD:
            stage = "Resharding"
        elif kind == jobs.DELETE:
            stage = "Deleting"
        elif entry.stage in ("Serializing", "Resharding", "Failed"):
            stage = "Verifying"
        return entry.model_copy(
            update={
                counter: run,
                "job": manifest["metadata"]["name"],
                "stage": stage,
                "reason": _running_reason(kind, stage),
                "message": f"Job {manifest['metadata']['name']} is running",
                "next_check": None,
            }
        )

    def _last_run(self, shard_set: ShardSet, kind: str) -> int:
        """The highest run of this set's Jobs of this kind that the cluster still has, or that
        was deleted a moment ago."""
        prefix = child_name(self.resource.owner, shard_set, kind, 0)[:-1]
        names = [*self.observed.jobs, *self.observed.deleted_jobs]
        return max((_run_of(name) for name in names if name.startswith(prefix)), default=0)

    def _back_off(self, entry: ShardSetStatus, outcome: Outcome) -> ShardSetStatus:
        failures = entry.failures + 1
        delay = min(
            self.settings.retry_backoff_seconds * 2 ** (failures - 1),
            self.settings.retry_backoff_max_seconds,
        )
        due = self.now + timedelta(seconds=delay)
        self.plan.wake_at(due, self.now)
        return entry.model_copy(
            update={
                "job": None,
                "failures": failures,
                "reason": outcome.reason,
                "message": _clip(f"{outcome.message} (attempt {failures}; next in {delay}s)"),
                "next_check": timestamp(due),
            }
        )

    def _fail(self, entry: ShardSetStatus, reason: str, message: str) -> ShardSetStatus:
        return entry.model_copy(
            update={
                "stage": "Failed",
                "reason": reason,
                "message": _clip(message),
                "job": None,
                "next_check": None,
                "failed_generation": self.resource.generation,
            }
        )

    def _entry(
        self, shard_set: ShardSet, *, stage: Stage, reason: str, message: str = ""
    ) -> ShardSetStatus:
        previous = self.previous.get(shard_set.artifact_key)
        base = previous or ShardSetStatus(
            tensor_parallel_size=shard_set.tensor_parallel_size,
            artifact_key=shard_set.artifact_key,
            uri=shard_set.uri,
            stage=stage,
        )
        return base.model_copy(update={"stage": stage, "reason": reason, "message": message})

    def _build(self, kind: str, shard_set: ShardSet, run: int, entry: ShardSetStatus) -> Manifest:
        job_input = jobs.JobInput(
            owner=self.resource.owner,
            spec=self.spec,
            shard_set=shard_set,
            settings=self.settings,
            run=run,
        )
        if kind == jobs.RESHARD:
            assert entry.resharded_from is not None  # noqa: S101 - _make records it first
            source = shard_set_location(self.spec.storage.uri, entry.resharded_from)
            return jobs.build_reshard_job(job_input, source)
        builder = {
            jobs.SERIALIZE: jobs.build_serialize_job,
            jobs.DELETE: jobs.build_delete_job,
        }.get(kind, jobs.build_verify_job)
        return builder(job_input)

    # Sets no longer wanted ---------------------------------------------------------------------

    def _retire(self, entry: ShardSetStatus, in_use: set[str]) -> ShardSetStatus | None:
        shard_set = ShardSet(
            tensor_parallel_size=entry.tensor_parallel_size,
            artifact_key=entry.artifact_key,
            location=ShardSet.for_spec(self.spec, 1, entry.artifact_key).location,
        )
        if entry.artifact_key in in_use:
            if entry.job is not None:
                self.plan.delete_jobs.append(entry.job)
            return entry.model_copy(
                update={
                    "stage": "Superseded" if entry.stage == "Verified" else entry.stage,
                    "reason": reasons.SUPERSEDED,
                    "message": "no longer wanted; kept while a target still loads it",
                    "job": None,
                    "next_check": None,
                    "progress": None,
                }
            )
        if entry.job is not None and _kind_of(entry.job) != jobs.DELETE:
            self.plan.delete_jobs.append(entry.job)
            entry = entry.model_copy(update={"job": None})
        deletable = (
            self.spec.storage.retention == "Delete"
            and entry.uri not in self.observed.sets_used_elsewhere
            and entry.stage not in ("Probing", "Failed")
        )
        if not deletable:
            self.plan.events.append(
                Event("Normal", reasons.RELEASED, f"shard set {entry.uri} is no longer used")
            )
            return None
        if entry.stage == "Deleting" and entry.job is None and entry.reason == reasons.DELETED:
            self.plan.events.append(
                Event("Normal", reasons.DELETED, f"shard set {entry.uri} deleted")
            )
            return None
        if entry.job is not None:
            return self._follow(entry, shard_set)
        due = parse_time(entry.next_check)
        if due is not None and self.now < due:
            self.plan.wake_at(due, self.now)
            return entry
        return self._start(entry, shard_set, jobs.DELETE)

    # Targets ---------------------------------------------------------------------------------

    def _targets(
        self, desired: dict[int, ShardSet], entries: dict[str, ShardSetStatus]
    ) -> list[TargetStatus]:
        statuses: list[TargetStatus] = []
        matched: set[str] = set()
        for spec_target in self.spec.targets:
            tp = self.spec.target_tp(spec_target)
            names = self._resolve(spec_target)
            if not names:
                statuses.append(
                    TargetStatus(
                        name=spec_target.name or "(selector)",
                        tensor_parallel_size=tp,
                        state="NotFound",
                        reason=reasons.TARGET_NOT_FOUND,
                        message=f"{spec_target.label} not found in namespace "
                        f"{self.resource.owner.namespace}; waiting for it",
                    )
                )
            for name in names:
                if name in matched:
                    continue
                matched.add(name)
                statuses.append(self._target(name, spec_target, desired[tp], entries))
        for name, deployment in sorted(self.observed.deployments.items()):
            if name not in matched and target.owner_of(deployment) == self.resource.owner.name:
                self._note_in_use(deployment)
                self._restore(name, deployment)
        return statuses

    def _resolve(self, spec_target: models.Target) -> list[str]:
        if spec_target.name is not None:
            return [spec_target.name] if spec_target.name in self.observed.deployments else []
        assert spec_target.selector is not None  # noqa: S101 - the model guarantees one of both
        return sorted(
            name
            for name, deployment in self.observed.deployments.items()
            if spec_target.selector.matches((deployment.get("metadata") or {}).get("labels") or {})
        )

    def _target(
        self,
        name: str,
        spec_target: models.Target,
        wanted: ShardSet,
        entries: dict[str, ShardSetStatus],
    ) -> TargetStatus:
        deployment = self.observed.deployments[name]
        tp = wanted.tensor_parallel_size
        base = TargetStatus(name=name, tensor_parallel_size=tp, state="Waiting")
        owner = target.owner_of(deployment)
        if owner == self.resource.owner.name:
            self._note_in_use(deployment)
        if owner is not None and owner != self.resource.owner.name:
            return base.model_copy(
                update={
                    "state": "Conflict",
                    "reason": reasons.TARGET_CONFLICT,
                    "message": f"Deployment {name} is already managed by ShardedModel {owner}",
                }
            )
        applied = target.applied_artifact_key(deployment) if owner else None
        wanted_entry = entries.get(wanted.artifact_key)
        serving = _serving_set(wanted, wanted_entry, applied, entries, self.spec)
        if serving is None:
            entry_reason = wanted_entry.reason if wanted_entry else reasons.WAITING_FOR_SHARDS
            failed = wanted_entry is not None and wanted_entry.stage == "Failed"
            return base.model_copy(
                update={
                    "artifact_key": applied,
                    "reason": entry_reason if failed else reasons.WAITING_FOR_SHARDS,
                    "message": f"waiting for the TP {tp} shard set {wanted.artifact_key}"
                    + (
                        f" ({wanted_entry.reason}: {wanted_entry.message})"
                        if failed and wanted_entry
                        else ""
                    ),
                    "rollout": rollout_of(deployment).summary if applied else None,
                }
            )
        serving_entry = entries.get(serving.artifact_key)
        target_input = target.TargetInput(
            owner=self.resource.owner,
            spec=self.spec,
            shard_set=serving,
            settings=self.settings,
            container=spec_target.container,
            allow_controller_owned=spec_target.allow_controller_owned,
            shard_vllm_version=(serving_entry.vllm_version if serving_entry else None)
            or serializer_vllm_version(self.spec, self.settings),
            allow_vllm_version_mismatch=spec_target.allow_vllm_version_mismatch,
        )
        patched = target.patch_deployment(deployment, target_input)
        if isinstance(patched, target.Refusal):
            return base.model_copy(
                update={
                    "artifact_key": applied,
                    "state": "Refused",
                    "reason": patched.reason,
                    "message": patched.message,
                }
            )
        status = self._patched_target(
            name, spec_target, deployment, patched.deployment, base, serving, wanted
        )
        if status.state == "Refused":
            return status
        return self._with_line(
            self._with_overrides(status, patched.overrides), patched.version_note
        )

    def _patched_target(
        self,
        name: str,
        spec_target: models.Target,
        deployment: Manifest,
        desired: Manifest,
        base: TargetStatus,
        serving: ShardSet,
        wanted: ShardSet,
    ) -> TargetStatus:
        """The state of a target its set can be loaded by, and the patch it needs."""
        tp = wanted.tensor_parallel_size
        owner = target.owner_of(deployment)
        container = target.choose_container(
            desired["spec"]["template"]["spec"], spec_target.container
        )
        container_name = container.get("name") if isinstance(container, dict) else None
        switched = serving.artifact_key == wanted.artifact_key
        base = base.model_copy(
            update={
                "container": container_name,
                "artifact_key": serving.artifact_key,
                "tensor_parallel_size": serving.tensor_parallel_size,
            }
        )
        rolled_back = self._rolled_back(name, serving.artifact_key)
        if rolled_back is not None:
            # Its patched rollout failed and the original template was put back: not again for
            # this set until the spec or the retry annotation changes.
            if owner == self.resource.owner.name:
                self._restore(name, deployment)  # the restore is not in the index yet
            return rolled_back
        if target.managed_view(desired, container_name) != target.managed_view(
            deployment, container_name
        ):
            rounds = self._patch_rounds(name, deployment, desired)
            if rounds is None:
                return self._reverted(name, deployment, base)
            target.annotations_of(desired)[target.ANNOTATION_PATCH_ROUNDS] = rounds
            self.plan.patches.append(
                DeploymentPatch(
                    name=name,
                    patch=target.deployment_patch(deployment, desired),
                    planned_from=target.identity_of(deployment),
                )
            )
            if not switched:
                return base.model_copy(
                    update={
                        "reason": reasons.WAITING_FOR_SHARDS,
                        "message": f"serves {serving.uri} until TP {tp} set "
                        f"{wanted.artifact_key} is verified",
                        "rollout": "in progress",
                    }
                )
            return base.model_copy(
                update={
                    "state": "RollingOut",
                    "reason": reasons.ROLLING_OUT,
                    "message": f"rolling out the patched template that loads {serving.uri}",
                    "rollout": "in progress",
                }
            )
        rollout = rollout_of(deployment)
        if not switched:
            return base.model_copy(
                update={
                    "reason": reasons.WAITING_FOR_SHARDS,
                    "message": f"serves {serving.uri} until TP {tp} set "
                    f"{wanted.artifact_key} is verified",
                    "rollout": rollout.summary,
                }
            )
        return self._rollout_state(name, spec_target, deployment, base, serving, rollout)

    def _patch_rounds(self, name: str, deployment: Manifest, desired: Manifest) -> str | None:
        """The record of patch rounds to write with this patch; None when writing it again
        would be one round too many.

        A round is a write of the same patch: the same inputs (`preshard.dev/input-hash`), spec
        generation and retry value. Only a revert of the patch (a GitOps tool's, or a hand edit
        of a managed field) makes preshard write the same patch again; a changed input starts
        over at one. Once refused, it stays refused for the same record, however long ago the
        rounds were: a new spec generation or retry value tries again.
        """
        record = target.patch_rounds_of(deployment)
        wanted = {
            "inputHash": target.annotations_of(desired).get(target.ANNOTATION_INPUT_HASH),
            "generation": self.resource.generation,
            "retry": self.resource.annotations.get(ANNOTATION_RETRY),
        }
        same = record is not None and all(record.get(k) == v for k, v in wanted.items())
        previous = next((t for t in self.resource.status.targets if t.name == name), None)
        if same and previous is not None and previous.reason == reasons.TARGET_REVERTED:
            return None
        since = _time_of(record.get("since")) if same and record else None
        count = record.get("count") if same and record else None
        if since is None or not isinstance(count, int) or self.now - since > PATCH_ROUNDS_WINDOW:
            since, count = self.now, 0
        if count >= PATCH_ROUNDS:
            return None
        return target.patch_rounds_record({**wanted, "count": count + 1, "since": timestamp(since)})

    def _reverted(self, name: str, deployment: Manifest, base: TargetStatus) -> TargetStatus:
        """A target whose patch something keeps reverting: left as that writer made it."""
        record = target.patch_rounds_of(deployment) or {}
        minutes = int(PATCH_ROUNDS_WINDOW.total_seconds() // 60)
        return base.model_copy(
            update={
                "state": "Refused",
                "reason": reasons.TARGET_REVERTED,
                "message": _clip(
                    f"the patch of Deployment {name} was undone {record.get('count', '?')} times "
                    f"within {minutes} minutes of its first write: something else (Argo CD or "
                    "Flux with self-heal, another controller, a script) puts its own pod "
                    "template back. preshard stops patching it rather than restart its GPU pods "
                    "each round, and leaves it as that writer made it. Make the two coexist: "
                    "have that tool ignore the fields preshard manages (Argo CD: "
                    "ignoreDifferences with managedFieldsManagers: [preshard] and "
                    "RespectIgnoreDifferences=true; see the GitOps section of docs/install.md), "
                    f"then set a new {ANNOTATION_RETRY} value or change the spec to patch again"
                ),
                "rollout": rollout_of(deployment).summary,
            }
        )

    def _with_line(self, status: TargetStatus, line: str | None) -> TargetStatus:
        """The status with one more line in its message (clipped to fit)."""
        if line is None or status.state == "RolledBack":
            return status
        return status.model_copy(update={"message": _clip(f"{status.message}\n{line}")})

    def _with_overrides(self, status: TargetStatus, overrides: tuple[str, ...]) -> TargetStatus:
        """The status with a line on what the patch changed of the user's command line, and a
        Warning event when that line is new: nothing of theirs is replaced without a word."""
        if not overrides or status.state == "RolledBack":
            return status
        line = target.overrides_line(overrides)
        line = line if len(line) <= MESSAGE_LIMIT // 2 else line[: MESSAGE_LIMIT // 2 - 3] + "..."
        previous = next((t for t in self.resource.status.targets if t.name == status.name), None)
        if previous is None or line not in previous.message:
            self.plan.events.append(
                Event(
                    "Warning",
                    reasons.ARGS_OVERRIDDEN,
                    f"Deployment {status.name}: {line}",
                    deployment=status.name,
                )
            )
        room = MESSAGE_LIMIT - len(line) - 1
        message = status.message if len(status.message) <= room else status.message[: room - 3]
        if message != status.message:
            message += "..."
        return status.model_copy(update={"message": f"{message}\n{line}"})

    def _rollout_state(
        self,
        name: str,
        spec_target: models.Target,
        deployment: Manifest,
        base: TargetStatus,
        serving: ShardSet,
        rollout: Rollout,
    ) -> TargetStatus:
        """The state of a patched target from its rollout and its pods."""
        container_name = base.container
        if rollout.serving:
            image_note = _image_note(deployment, container_name)
            scaled = rollout.phase == "ScaledToZero"
            return base.model_copy(
                update={
                    "state": "Patched",
                    "reason": reasons.TARGET_IMAGE_CHANGED
                    if image_note
                    else reasons.SCALED_TO_ZERO
                    if scaled
                    else reasons.PATCHED,
                    "message": image_note
                    or f"loads {serving.uri}"
                    + ("; scaled to zero replicas, it serves nothing" if scaled else ""),
                    "rollout": rollout.summary,
                }
            )
        problem = self._pod_problem(name, deployment, container_name)
        if rollout.phase == "DeadlineExceeded":
            failure = f"the rollout of {serving.uri} exceeded its progress deadline"
            detail = problem or rollout.detail
            if spec_target.on_rollout_failure == "Restore":
                self._restore(name, deployment)
                return base.model_copy(
                    update={
                        "state": "RolledBack",
                        "artifact_key": None,
                        "reason": reasons.ROLLOUT_FAILED,
                        "message": _clip(
                            f"{failure} ({detail}); the original template is restored. A spec "
                            f"change or a new {ANNOTATION_RETRY} value patches it again"
                        ),
                        "rollout": "restored",
                        "failed_artifact_key": serving.artifact_key,
                        "failed_generation": self.resource.generation,
                        "retry_token": self.resource.annotations.get(ANNOTATION_RETRY),
                    }
                )
            return base.model_copy(
                update={
                    "state": "Unavailable",
                    "reason": reasons.TARGET_UNAVAILABLE,
                    "message": _clip(f"{failure} ({detail})"),
                    "rollout": rollout.summary,
                }
            )
        if problem is not None:
            return base.model_copy(
                update={
                    "state": "Unavailable",
                    "reason": reasons.TARGET_UNAVAILABLE,
                    "message": _clip(f"patched pods of {serving.uri} fail: {problem}"),
                    "rollout": rollout.summary,
                }
            )
        return base.model_copy(
            update={
                "state": "RollingOut",
                "reason": reasons.ROLLING_OUT,
                "message": f"rolling out the patched template that loads {serving.uri}",
                "rollout": rollout.summary,
            }
        )

    def _pod_problem(
        self, name: str, deployment: Manifest, container_name: str | None
    ) -> str | None:
        """What the first failing pod of the current patched template says, if one fails."""
        digests = template_digests(deployment, container_name)
        if digests is None:
            return None
        pods = sorted(self.observed.target_pods.get(name, ()), key=lambda p: (p.created, p.name))
        for pod in pods:
            if not pod.runs(digests[0], container_name, digests[1]):
                continue
            problem = pod.problem(container_name)
            if problem is not None:
                return problem.describe(pod.name)
        return None

    def _rolled_back(self, name: str, key: str) -> TargetStatus | None:
        """The previous status of a target rolled back for this set, unless tried again since."""
        previous = next((t for t in self.resource.status.targets if t.name == name), None)
        if (
            previous is None
            or previous.state != "RolledBack"
            or previous.failed_artifact_key != key
            or previous.failed_generation is None
            or self.resource.generation > previous.failed_generation
            or self.resource.annotations.get(ANNOTATION_RETRY) != previous.retry_token
        ):
            return None
        return previous

    def _note_in_use(self, deployment: Manifest) -> None:
        annotations = target.annotations_of(deployment)
        applied = annotations.get(target.ANNOTATION_ARTIFACT_KEY)
        if applied:
            self.in_use.add(applied)
        previous = annotations.get(target.ANNOTATION_PREVIOUS_KEY)
        if previous and not target.rollout_complete(deployment):
            self.in_use.add(previous)

    def _restore(self, name: str, deployment: Manifest) -> None:
        restored = target.restore_deployment(deployment)
        if restored is None:
            return
        self.plan.patches.append(
            DeploymentPatch(
                name=name,
                patch=target.deployment_patch(deployment, restored.deployment),
                planned_from=target.identity_of(deployment),
                restore=True,
                kept=restored.kept,
            )
        )

    # Conditions and events -------------------------------------------------------------------

    def _conditions(
        self, wanted: list[ShardSetStatus], targets: list[TargetStatus]
    ) -> list[Condition]:
        generation = self.resource.generation
        result = list(self.resource.status.conditions)

        def put(type_: str, ok: bool, reason: str, message: str) -> None:
            nonlocal result
            result = conditions.set_condition(
                result,
                type_,
                "True" if ok else "False",
                reason,
                _clip(message),
                now=self.stamp,
                generation=generation,
            )

        failed = [e for e in wanted if e.stage == "Failed"]
        not_serialized = [e for e in wanted if e.stage not in ("Verifying", "Verified")]
        not_verified = [e for e in wanted if e.stage != "Verified"]
        if any(e.serialize_run for e in wanted):
            serialized_reason = reasons.SERIALIZED
        elif any(e.reshard_run for e in wanted):
            serialized_reason = reasons.RESHARDED
        else:
            serialized_reason = reasons.ALREADY_SERIALIZED
        put(
            conditions.SERIALIZED,
            not not_serialized,
            _first_reason(not_serialized, serialized_reason),
            _describe_sets(not_serialized) or "every shard set is written",
        )
        put(
            conditions.VERIFIED,
            not not_verified,
            _first_reason(not_verified, reasons.VERIFIED),
            _describe_sets(not_verified) or "every shard set verified complete",
        )
        unpatched = [t for t in targets if t.state not in PATCHED_STATES]
        if not self.spec.targets:
            put(conditions.TARGETS_PATCHED, True, reasons.NO_TARGETS, "no targets to patch")
        else:
            put(
                conditions.TARGETS_PATCHED,
                not unpatched,
                unpatched[0].reason if unpatched else reasons.PATCHED,
                "; ".join(f"{t.name}: {t.message}" for t in unpatched)
                or f"{len(targets)} Deployment(s) load their shard sets",
            )
        not_serving = [t for t in targets if t.state != "Patched"]
        problems = [t for t in not_serving if t.state in TROUBLED_STATES]
        ready = not not_verified and not not_serving
        if ready:
            ready_reason, ready_message = (
                reasons.READY,
                "shards verified and every target's rollout complete",
            )
        elif failed:
            ready_reason, ready_message = failed[0].reason, _describe_sets(failed)
        elif problems:
            ready_reason = problems[0].reason
            ready_message = "; ".join(f"{t.name}: {t.message}" for t in problems)
        elif not_verified:
            ready_reason, ready_message = (
                _first_reason(not_verified, ""),
                _describe_sets(not_verified),
            )
        else:
            ready_reason = not_serving[0].reason
            ready_message = "; ".join(f"{t.name}: {t.message}" for t in not_serving)
        put(conditions.READY, ready, ready_reason, ready_message)
        troubled = [e for e in wanted if e.failures > 0 or (e.stage == "Failed" and e.verified_at)]
        put(
            conditions.DEGRADED,
            bool(troubled),
            troubled[0].reason if troubled else reasons.AS_EXPECTED,
            _describe_sets(troubled) or "no faults",
        )
        return result

    def _announce(self, status: ShardedModelStatus) -> None:
        before = {e.artifact_key: e for e in self.resource.status.shard_sets}
        for entry in status.shard_sets:
            old = before.get(entry.artifact_key)
            if old is not None and (old.stage, old.reason, old.job) == (
                entry.stage,
                entry.reason,
                entry.job,
            ):
                continue
            if old is not None and old.stage == entry.stage == "Verified" and not entry.failures:
                # A periodic check that starts or passes is no news.
                continue
            failed = entry.stage == "Failed" or entry.failures > 0
            text = f"TP {entry.tensor_parallel_size} shard set {entry.artifact_key}: {entry.stage}"
            detail = entry.message
            self.plan.events.append(
                Event(
                    "Warning" if failed else "Normal",
                    entry.reason or entry.stage,
                    _clip(f"{text}: {detail}" if detail else text),
                )
            )
        old_targets = {t.name: t for t in self.resource.status.targets}
        for state in status.targets:
            old_target = old_targets.get(state.name)
            if old_target is not None and (
                old_target.state,
                old_target.reason,
                old_target.artifact_key,
            ) == (
                state.state,
                state.reason,
                state.artifact_key,
            ):
                continue
            if old_target is None and state.state == "Waiting":
                # Every new resource waits at first; that is no news.
                continue
            if (
                old_target is not None
                and (old_target.state, state.state) == ("RollingOut", "Patched")
                and old_target.artifact_key == state.artifact_key
                and state.reason in (reasons.PATCHED, reasons.SCALED_TO_ZERO)
            ):
                # The rollout the patch event announced is done: Ready says so.
                continue
            bad = state.state in TROUBLED_STATES or state.reason == reasons.TARGET_IMAGE_CHANGED
            self.plan.events.append(
                Event(
                    "Warning" if bad else "Normal",
                    state.reason or state.state,
                    _clip(f"Deployment {state.name}: {state.message}"),
                    deployment=state.name,
                )
            )
        for patch in self.plan.patches:
            # A patch shows as its target's transition; a restore has no target left to show.
            if patch.restore:
                self.plan.events.append(
                    Event(
                        "Warning" if patch.kept else "Normal",
                        reasons.RESTORED,
                        _clip(target.restore_message(patch.name, patch.kept)),
                        deployment=patch.name,
                    )
                )


def _serving_set(
    wanted: ShardSet,
    wanted_entry: ShardSetStatus | None,
    applied: str | None,
    entries: Mapping[str, ShardSetStatus],
    spec: models.ShardedModelSpec,
) -> ShardSet | None:
    """The set a target should load now: the wanted one once verified, else the one it has."""
    if wanted_entry is not None and wanted_entry.stage == "Verified":
        return wanted
    if applied is None or applied == wanted.artifact_key:
        return None
    current = entries.get(applied)
    if current is None or current.stage not in ("Verified", "Superseded"):
        return None
    return ShardSet.for_spec(spec, current.tensor_parallel_size, current.artifact_key)


def _image_note(deployment: Manifest, container_name: str | None) -> str | None:
    recorded = target.annotations_of(deployment).get(target.ANNOTATION_IMAGE)
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers")
    current = next(
        (c.get("image") for c in containers or [] if c.get("name") == container_name), None
    )
    if recorded and current and recorded != current:
        return (
            f"container image changed from {recorded} to {current} after the shards were "
            "pointed at; check that it runs the vLLM version the shards were made with"
        )
    return None


def _time_of(value: object) -> datetime | None:
    """A time preshard recorded (`timestamp`); None when it is not one."""
    try:
        return parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


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


def _first_reason(entries: list[ShardSetStatus], default: str) -> str:
    return entries[0].reason or entries[0].stage if entries else default


def _describe_sets(entries: list[ShardSetStatus]) -> str:
    return "; ".join(
        f"TP {e.tensor_parallel_size} ({e.artifact_key}): {e.stage}"
        + (f", {e.reason}" if e.reason else "")
        + (f": {e.message}" if e.message else "")
        for e in entries
    )


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."
