"""What the controller observes, reduced to what it decides on.

The operator keeps in-memory indexes of its Jobs, their pods and the Deployments of watched
namespaces (kopf indexes fed by watch streams), so a reconcile reads no API at all. These pure
functions turn raw objects into the small summaries the indexes hold and the planner reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from preshard import reasons
from preshard.builders.common import LABEL_COMMAND
from preshard.builders.jobs import CONTAINER
from preshard.outcome import Command, Outcome, reason_for_exit_code

Manifest = dict[str, Any]


@dataclass(frozen=True)
class PodView:
    """One pod of a Job: its phase and what its container reported."""

    name: str
    created: str
    phase: str
    exit_code: int | None = None
    terminated_reason: str | None = None
    message: str | None = None
    waiting_reason: str | None = None
    waiting_message: str | None = None
    pod_reason: str | None = None
    unschedulable: str | None = None

    @property
    def problem(self) -> tuple[str, str] | None:
        """A reason and message when the pod is stuck or was killed by the platform."""
        if self.waiting_reason in ("CreateContainerConfigError", "CreateContainerError"):
            text = self.waiting_message or self.waiting_reason
            reason = reasons.SECRET_NOT_FOUND if "secret" in text.lower() else reasons.JOB_FAILED
            return reason, f"pod {self.name}: {text}"
        if self.waiting_reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
            return (
                reasons.IMAGE_PULL_FAILED,
                f"pod {self.name}: {self.waiting_message or ''}".strip(),
            )
        if self.unschedulable:
            return reasons.UNSCHEDULABLE, f"pod {self.name}: {self.unschedulable}"
        return None


@dataclass(frozen=True)
class JobView:
    """One Job of a ShardedModel: where it stands and, once finished, its outcome."""

    name: str
    command: str
    finished: bool
    succeeded: bool
    condition_reason: str | None
    condition_message: str
    pods: tuple[PodView, ...]

    @property
    def problem(self) -> tuple[str, str] | None:
        """Why a running Job is not making progress, if its newest pod says so."""
        latest = self.latest_pod
        return latest.problem if latest is not None else None

    @property
    def latest_pod(self) -> PodView | None:
        """The most recently created pod."""
        return max(self.pods, key=lambda p: (p.created, p.name)) if self.pods else None

    def outcome(self) -> Outcome:
        """The result of a finished Job, from its pod's termination message if it wrote one."""
        command = _command(self.command)
        terminated = sorted(
            (p for p in self.pods if p.exit_code is not None), key=lambda p: (p.created, p.name)
        )
        wanted = [p for p in terminated if (p.exit_code == 0) == self.succeeded]
        pod = wanted[-1] if wanted else None
        reported = Outcome.from_message(pod.message) if pod is not None else None
        if reported is not None:
            return reported
        if self.succeeded:
            return Outcome(command=command, ok=True, reason=_success_reason(command))
        reason, message = self._failure(pod)
        return Outcome(command=command, ok=False, reason=reason, message=message)

    def _failure(self, pod: PodView | None) -> tuple[str, str]:
        if pod is not None:
            if pod.terminated_reason == "OOMKilled":
                return reasons.OOM_KILLED, f"pod {pod.name} ran out of memory (OOMKilled)"
            by_code = reason_for_exit_code(pod.exit_code or 0)
            if by_code is not None:
                return by_code, f"pod {pod.name} exited with code {pod.exit_code}"
        evicted = next((p for p in self.pods if p.pod_reason == "Evicted"), None)
        if evicted is not None:
            return reasons.EVICTED, f"pod {evicted.name} was evicted"
        condition = {
            "DeadlineExceeded": reasons.DEADLINE_EXCEEDED,
            "BackoffLimitExceeded": reasons.BACKOFF_LIMIT_EXCEEDED,
        }.get(self.condition_reason or "", reasons.JOB_FAILED)
        detail = self.condition_message or f"Job {self.name} failed"
        if pod is not None and pod.message:
            detail = f"{detail}; last output: {pod.message.strip()[-500:]}"
        return condition, detail


def pod_view(pod: Manifest) -> PodView:
    """Summarise a Job's pod."""
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    container: Manifest = next(
        (s for s in status.get("containerStatuses") or [] if s.get("name") == CONTAINER), {}
    )
    state = container.get("state") or {}
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    scheduled: Manifest = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
    )
    unschedulable = (
        scheduled.get("message") or "unschedulable"
        if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
        else None
    )
    return PodView(
        name=str(metadata.get("name", "")),
        created=str(metadata.get("creationTimestamp", "")),
        phase=str(status.get("phase", "Pending")),
        exit_code=terminated.get("exitCode") if terminated else None,
        terminated_reason=terminated.get("reason"),
        message=terminated.get("message"),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        pod_reason=status.get("reason"),
        unschedulable=unschedulable,
    )


def job_view(job: Manifest, pods: list[PodView]) -> JobView:
    """Summarise a Job with its pods."""
    metadata, status = job.get("metadata") or {}, job.get("status") or {}
    final = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        ),
        None,
    )
    return JobView(
        name=str(metadata.get("name", "")),
        command=str((metadata.get("labels") or {}).get(LABEL_COMMAND, "")),
        finished=final is not None,
        succeeded=final is not None and final.get("type") == "Complete",
        condition_reason=final.get("reason") if final else None,
        condition_message=str(final.get("message", "")) if final else "",
        pods=tuple(pods),
    )


def _command(label: str) -> Command:
    if label == "serialize":
        return "serialize"
    if label == "delete":
        return "delete"
    return "verify"


def _success_reason(command: Command) -> str:
    return {
        "serialize": reasons.SERIALIZED,
        "verify": reasons.VERIFIED,
        "delete": reasons.DELETED,
        "fetch-config": reasons.CONFIG_FETCHED,
    }[command]
