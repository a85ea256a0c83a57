"""Reading a patched Deployment's rollout and its pods, by exact equality."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import kopf
import pytest

from preshard.builders.patching import INIT_CONTAINER
from preshard.builders.rollout import Rollout, container_digest, rollout_of, template_digests
from preshard.controller import handlers
from preshard.controller.handlers import Wakeups
from preshard.controller.observe import ContainerProblem, quote, target_pod_view

INIT = {"name": INIT_CONTAINER, "image": "preshard:1", "command": ["preshard"], "args": ["x"]}
VLLM = {"name": "vllm", "image": "vllm:1", "command": ["vllm", "serve"], "args": ["/m"]}
SIDECAR = {"name": "proxy", "image": "envoy:1"}


def deployment(wanted: int = 2, generation: int = 3, **status: Any) -> dict[str, Any]:
    """A patched Deployment that wants `wanted` replicas, with this status."""
    return {
        "metadata": {"name": "vllm", "generation": generation},
        "spec": {
            "replicas": wanted,
            "template": {"spec": {"initContainers": [INIT], "containers": [VLLM]}},
        },
        "status": status,
    }


def deadline(status: str = "False", reason: str = "ProgressDeadlineExceeded") -> dict[str, Any]:
    return {
        "type": "Progressing",
        "status": status,
        "reason": reason,
        "message": 'ReplicaSet "vllm-7c9b" has timed out progressing.',
    }


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (
            deployment(observedGeneration=2, replicas=2, updatedReplicas=2, availableReplicas=2),
            Rollout("Progressing", "the Deployment controller has not seen the template yet"),
        ),
        (
            deployment(observedGeneration=3, replicas=2, updatedReplicas=2, availableReplicas=2),
            Rollout("Complete", "2 replica(s) updated and available"),
        ),
        # Old pods are still counted: the available ones may be old.
        (
            deployment(observedGeneration=3, replicas=3, updatedReplicas=2, availableReplicas=2),
            Rollout("Progressing", ""),
        ),
        (
            deployment(observedGeneration=3, replicas=2, updatedReplicas=2, availableReplicas=1),
            Rollout("Progressing", ""),
        ),
        (
            deployment(wanted=0, observedGeneration=3),
            Rollout("ScaledToZero", "scaled to zero replicas"),
        ),
        # Scaled to zero, one pod still going.
        (deployment(wanted=0, observedGeneration=3, replicas=1), Rollout("Progressing", "")),
        (
            deployment(
                observedGeneration=3, replicas=3, updatedReplicas=1, conditions=[deadline()]
            ),
            Rollout("DeadlineExceeded", 'ReplicaSet "vllm-7c9b" has timed out progressing.'),
        ),
        # A deadline passed once, then every replica became available: complete.
        (
            deployment(
                observedGeneration=3,
                replicas=2,
                updatedReplicas=2,
                availableReplicas=2,
                conditions=[deadline()],
            ),
            Rollout("Complete", "2 replica(s) updated and available"),
        ),
        (
            deployment(observedGeneration=3, conditions=[deadline("True", "ReplicaSetUpdated")]),
            Rollout("Progressing", 'ReplicaSet "vllm-7c9b" has timed out progressing.'),
        ),
    ],
)
def test_the_rollout_of_the_current_template(item: dict[str, Any], expected: Rollout) -> None:
    assert rollout_of(item) == expected


def test_a_paused_deployment_says_so() -> None:
    item = deployment(observedGeneration=3, replicas=2)
    item["spec"]["paused"] = True
    assert rollout_of(item) == Rollout("Progressing", "the Deployment is paused")
    assert rollout_of(item).summary == "in progress"


def test_replicas_default_to_one() -> None:
    item = deployment(observedGeneration=3, replicas=1, updatedReplicas=1, availableReplicas=1)
    del item["spec"]["replicas"]
    assert "replicas" not in item["spec"]
    assert rollout_of(item).phase == "Complete"


def pod(
    statuses: list[dict[str, Any]],
    init_statuses: list[dict[str, Any]] | None = None,
    *,
    containers: list[dict[str, Any]] | None = None,
    init: bool = True,
    owner: str = "vllm-7c9b",
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "vllm-7c9b-abcde",
            "creationTimestamp": "2026-12-01T12:00:00Z",
            "labels": {"pod-template-hash": "7c9b"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": owner, "controller": True}],
        },
        "spec": {
            "initContainers": [INIT] if init else [],
            "containers": containers or [VLLM, SIDECAR],
        },
        "status": {"containerStatuses": statuses, "initContainerStatuses": init_statuses or []},
    }


def crash_loop(name: str = "vllm", message: str | None = "CUDA out of memory") -> dict[str, Any]:
    last: dict[str, Any] = {"exitCode": 1, "reason": "Error"}
    if message is not None:
        last["message"] = message
    return {
        "name": name,
        "ready": False,
        "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
        "lastState": {"terminated": last},
    }


def test_a_pod_of_a_patched_template_is_summarised_with_digests_not_text() -> None:
    ready = {"name": "vllm", "ready": True, "restartCount": 0, "state": {"running": {}}}
    view = target_pod_view(pod([ready]))
    assert view is not None
    assert (view.name, view.deployment, view.problems) == ("vllm-7c9b-abcde", "vllm", ())
    assert view.init_digest == container_digest(INIT)
    assert view.digests == (("vllm", container_digest(VLLM)), ("proxy", container_digest(SIDECAR)))
    digests = template_digests(deployment(), "vllm")
    assert digests is not None
    assert view.runs(digests[0], "vllm", digests[1])
    assert not view.runs(digests[0], "proxy", digests[1])
    other = deployment()
    other["spec"]["template"]["spec"]["containers"][0] = {**VLLM, "args": ["/m", "-tp", "4"]}
    assert template_digests(other, "vllm") != digests


@pytest.mark.parametrize(
    "item",
    [
        pod([], init=False),
        pod([], owner="vllm-other"),
        {"metadata": {"name": "bare"}, "spec": {"initContainers": [INIT]}},
    ],
    ids=["not patched", "not named by its template hash", "not from a ReplicaSet"],
)
def test_other_pods_are_not_kept(item: dict[str, Any]) -> None:
    assert target_pod_view(item) is None


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (crash_loop(), ContainerProblem("vllm", "CrashLoopBackOff", "CUDA out of memory", 1)),
        (crash_loop(message=None), ContainerProblem("vllm", "CrashLoopBackOff", "back-off 20s", 1)),
        (
            {
                "name": "vllm",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}},
            },
            ContainerProblem("vllm", "ImagePullBackOff", "not found"),
        ),
        (
            {
                "name": "vllm",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
            },
            ContainerProblem("vllm", "OOMKilled", "", 137),
        ),
        # Running again after a crash, not ready yet: still crash-looping (no flapping).
        (
            {
                "name": "vllm",
                "ready": False,
                "restartCount": 3,
                "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 1, "message": "boom"}},
            },
            ContainerProblem("vllm", "Error", "boom", 1),
        ),
        # Starting for the first time, or ready after a crash: no problem.
        ({"name": "vllm", "ready": False, "restartCount": 0, "state": {"running": {}}}, None),
        (
            {
                "name": "vllm",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": "ContainerCreating"}},
            },
            None,
        ),
        ({**crash_loop(), "ready": True, "state": {"running": {}}}, None),
    ],
)
def test_what_counts_as_a_failing_container(
    status: dict[str, Any], expected: ContainerProblem | None
) -> None:
    view = target_pod_view(pod([status]))
    assert view is not None
    assert view.problem("vllm") == expected


def test_the_init_container_counts_and_other_containers_do_not() -> None:
    view = target_pod_view(pod([crash_loop("proxy")], [crash_loop(INIT_CONTAINER, "denied")]))
    assert view is not None
    assert view.problem("vllm") == ContainerProblem(INIT_CONTAINER, "CrashLoopBackOff", "denied", 1)
    sidecar_only = target_pod_view(pod([crash_loop("proxy")]))
    assert sidecar_only is not None
    assert sidecar_only.problem("vllm") is None
    (problem,) = sidecar_only.problems
    assert (
        problem.describe("p")
        == "pod p container proxy: CrashLoopBackOff, exit code 1: CUDA out of memory"
    )


def test_quoted_text_is_clipped_from_the_end_and_masks_credentials() -> None:
    assert quote("a\n  b\tc") == "a b c"
    long = "x" * 1000 + " the end"
    assert quote(long) == "..." + long[-397:]
    assert len(quote(long)) == 400
    assert quote(
        "AWS_SECRET_ACCESS_KEY=abc {'api_key': 'sk-1'} --hf-token hf_x HF_TOKEN: \"a b\" "
        "AKIAABCDEFGHIJKLMNOP max_tokens=5 tokenizer: ok"
    ) == (
        "AWS_SECRET_ACCESS_KEY=<redacted> {'api_key': <redacted>} --hf-token <redacted> "
        "HF_TOKEN: <redacted> <redacted> max_tokens=5 tokenizer: ok"
    )


def test_a_failing_pod_wakes_the_shardedmodel_that_patched_its_deployment() -> None:
    async def scenario() -> list[bool]:
        wakeups = Wakeups()
        mine = wakeups.register(("ns", "llama"))
        other = wakeups.register(("ns", "other"))
        patched = kopf.Body({"metadata": {"annotations": {"preshard.dev/owner": "llama"}}})
        wakeups.wake_for_deployment("ns", "vllm", patched)
        mine.clear()
        other.clear()
        wakeups.wake_for_pod("ns", "vllm")
        woken = [mine.is_set(), other.is_set()]
        mine.clear()
        wakeups.wake_for_deployment("ns", "vllm", patched, deleted=True)
        mine.clear()
        other.clear()
        wakeups.wake_for_pod("ns", "vllm")
        wakeups.wake_for_pod("ns", "unknown")
        return [*woken, mine.is_set(), other.is_set()]

    assert asyncio.run(scenario()) == [True, False, False, False]


def test_a_stopping_daemon_leaves_the_event_of_its_successor_in_place() -> None:
    async def scenario() -> list[bool]:
        wakeups = Wakeups()
        old = wakeups.register(("ns", "llama"))
        new = wakeups.register(("ns", "llama"))
        wakeups.unregister(("ns", "llama"), old)
        wakeups.wake(("ns", "llama"))
        woken = [old.is_set(), new.is_set()]
        wakeups.unregister(("ns", "llama"), new)
        new.clear()
        wakeups.wake(("ns", "llama"))
        return [*woken, new.is_set()]

    assert asyncio.run(scenario()) == [False, True, False]


def test_every_handler_that_wakes_a_reconciler_runs_on_the_event_loop() -> None:
    # kopf runs a plain function in its thread pool, where setting a daemon's asyncio event is
    # not safe and wakes no sleeping loop.
    wakers = {
        "owned_changed": handlers.owned_changed,
        "deployment_changed": handlers.deployment_changed,
        "target_pod_failing": handlers.target_pod_failing,
        "resource_changed": handlers.resource_changed,
    }
    assert [name for name, f in wakers.items() if not inspect.iscoroutinefunction(f)] == []
