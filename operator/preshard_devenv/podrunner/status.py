"""What the kubelet reports: the pod status of a pod's containers, and times as Kubernetes
writes them."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from preshard_devenv.podrunner.containers import ContainerRun

TERMINAL: Final = frozenset({"Succeeded", "Failed"})


def now() -> str:
    """The current time as Kubernetes writes it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """The current time as Kubernetes writes microsecond times (a Lease's renewal)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_time(value: Any) -> str:
    """A time the client read (a `datetime`, or already text) as Kubernetes writes it."""
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


def pod_status(
    phase: str,
    initialized: bool,
    init_runs: Sequence[ContainerRun],
    runs: Sequence[ContainerRun],
    start_time: str,
) -> dict[str, Any]:
    """The pod status the kubelet would write now."""
    stamp = now()
    ready = phase == "Running" and all(r.ready for r in runs)
    unready = [r.name for r in runs if not r.ready]

    def condition(kind: str, value: bool, why: str = "", text: str = "") -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": kind,
            "status": "True" if value else "False",
            "lastTransitionTime": stamp,
        }
        if not value and why:
            entry.update(reason=why, message=text)
        return entry

    terminal = phase in TERMINAL
    not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
    not_ready_text = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
    pending_init = [r.name for r in init_runs if r.terminated is None]
    conditions = [
        condition("PodReadyToStartContainers", not terminal),
        condition(
            "Initialized",
            initialized,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(pending_init)}]",
        ),
        condition("Ready", ready, not_ready_reason, not_ready_text),
        condition("ContainersReady", ready, not_ready_reason, not_ready_text),
        condition("PodScheduled", True),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "startTime": start_time,
        "containerStatuses": [r.status() for r in runs],
    }
    if init_runs:
        status["initContainerStatuses"] = [r.status() for r in init_runs]
    return status
