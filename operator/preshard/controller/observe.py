"""What the controller observes, reduced to what it decides on.

The operator keeps in-memory indexes of its Jobs, their pods and the Deployments of watched
namespaces (kopf indexes fed by watch streams), so a reconcile reads no API at all. These pure
functions turn raw objects into the small summaries the indexes hold and the planner reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from preshard.builders.jobs import CONTAINER
from preshard.builders.patching import INIT_CONTAINER
from preshard.builders.rollout import container_digest
from preshard.builders.shardset import LABEL_COMMAND
from preshard.contract import reasons
from preshard.contract.outcome import Command, Outcome, reason_for_exit_code

Manifest = dict[str, Any]

# Why a container of a patched pod does not run: the kubelet's waiting reasons that need a
# change to go away (not `ContainerCreating` or `PodInitializing`, which pass on their own).
FAILING_WAITING: Final = frozenset(
    {
        "CrashLoopBackOff",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "PreStartHookError",
        "PostStartHookError",
    }
)
# How much of a container's termination message a pod view keeps: its end, where a crash says why.
QUOTE_LIMIT: Final = 400
POD_TEMPLATE_HASH: Final = "pod-template-hash"
# `NAME=value`, `"name": "value"` and `--name value` spellings of credentials, and AWS access
# key ids, are masked in the quoted text: a crashing program may print its environment.
_SECRET_NAME: Final = (
    r"[A-Za-z0-9_.-]*(?:secret|token|password|passwd|api[-_]?key|access[-_]?key)"  # noqa: S105
    r"(?:[_-][A-Za-z0-9_-]*)?"
)
_SECRET_PATTERNS: Final = (
    re.compile(rf"(?i)(['\"]?\b{_SECRET_NAME}['\"]?\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s,}}]+)"),
    re.compile(rf"(?i)(--{_SECRET_NAME}[= ])(\S+)"),
    re.compile(r"()\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
)


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
    deleting: bool = False
    """It has a deletion timestamp: it keeps its name until it is gone, but will not finish."""

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
        deleting=bool(metadata.get("deletionTimestamp")),
    )


def _command(label: str) -> Command:
    if label == "serialize":
        return "serialize"
    if label == "reshard":
        return "reshard"
    if label == "delete":
        return "delete"
    return "verify"


def _success_reason(command: Command) -> str:
    return {
        "serialize": reasons.SERIALIZED,
        "reshard": reasons.RESHARDED,
        "verify": reasons.VERIFIED,
        "delete": reasons.DELETED,
        "fetch-config": reasons.CONFIG_FETCHED,
    }[command]


@dataclass(frozen=True)
class ContainerProblem:
    """Why one container of a patched pod is not running."""

    container: str
    reason: str
    message: str
    exit_code: int | None = None

    def describe(self, pod: str) -> str:
        """One line for a condition or an event."""
        code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
        text = f"pod {pod} container {self.container}: {self.reason}{code}"
        return f"{text}: {self.message}" if self.message else text


@dataclass(frozen=True)
class TargetPodView:
    """A pod of a Deployment preshard patched: what it runs and what, if anything, fails.

    Only pods with preshard's init container are kept (pods of a patched template); what they
    run is kept as digests (`builders.rollout.container_digest`), never the spec's text.
    """

    name: str
    created: str
    deployment: str
    init_digest: str
    digests: tuple[tuple[str, str], ...]
    problems: tuple[ContainerProblem, ...] = ()

    def runs(self, init_digest: str, container: str | None, digest: str) -> bool:
        """Whether this pod runs the template these digests come from."""
        return self.init_digest == init_digest and (container, digest) in self.digests

    def problem(self, container: str | None) -> ContainerProblem | None:
        """The first problem of preshard's init container or the named container."""
        return next((p for p in self.problems if p.container in (INIT_CONTAINER, container)), None)


def target_pod_view(pod: Manifest) -> TargetPodView | None:
    """Summarise a pod of a patched Deployment; None for any other pod."""
    metadata, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    init = next(
        (c for c in spec.get("initContainers") or [] if c.get("name") == INIT_CONTAINER), None
    )
    deployment = _deployment_of(metadata)
    if init is None or deployment is None:
        return None
    status = pod.get("status") or {}
    statuses = [
        *(s for s in status.get("initContainerStatuses") or [] if s.get("name") == INIT_CONTAINER),
        *(status.get("containerStatuses") or []),
    ]
    problems = tuple(p for p in map(_container_problem, statuses) if p is not None)
    return TargetPodView(
        name=str(metadata.get("name", "")),
        created=str(metadata.get("creationTimestamp", "")),
        deployment=deployment,
        init_digest=container_digest(init),
        digests=tuple(
            (str(c.get("name")), container_digest(c)) for c in spec.get("containers") or []
        ),
        problems=problems,
    )


def quote(text: str | None) -> str:
    """A container's own words, fit for a condition or an event: its end, credentials masked."""
    cleaned = " ".join((text or "").split())
    for pattern in _SECRET_PATTERNS:
        cleaned = pattern.sub(lambda m: f"{m.group(1)}<redacted>", cleaned)
    if len(cleaned) > QUOTE_LIMIT:
        cleaned = "..." + cleaned[-(QUOTE_LIMIT - 3) :]
    return cleaned


def _deployment_of(metadata: Manifest) -> str | None:
    """The Deployment a pod belongs to: its ReplicaSet is named `<deployment>-<template hash>`."""
    template_hash = (metadata.get("labels") or {}).get(POD_TEMPLATE_HASH)
    owner = next(
        (
            o
            for o in metadata.get("ownerReferences") or []
            if o.get("kind") == "ReplicaSet" and o.get("controller")
        ),
        None,
    )
    if not template_hash or owner is None:
        return None
    name = str(owner.get("name", ""))
    suffix = f"-{template_hash}"
    return name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else None


def _container_problem(status: Manifest) -> ContainerProblem | None:
    """Why a container is not running, if it crashed or cannot start; None while it is ready,
    starting, or running without having crashed."""
    if status.get("ready"):
        return None
    name = str(status.get("name", ""))
    state = status.get("state") or {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    if waiting.get("reason") in FAILING_WAITING:
        # Between restarts the last termination says why it crashed; else the kubelet's words.
        said = last.get("message") or waiting.get("message") or ""
        code = last.get("exitCode") if last else None
        return ContainerProblem(name, str(waiting["reason"]), quote(said), code)
    failed = terminated if terminated.get("exitCode") not in (None, 0) else None
    if failed is None and int(status.get("restartCount") or 0) > 0:
        # Running again after a crash but not ready: still crash-looping.
        failed = last if last.get("exitCode") not in (None, 0) else None
    if failed is None:
        return None
    return ContainerProblem(
        name,
        str(failed.get("reason") or "Error"),
        quote(failed.get("message")),
        failed.get("exitCode"),
    )
