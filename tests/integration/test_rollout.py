"""Ready means serving: the controller follows the rollout of the template it patched.

The Deployments here run on the kwok GPU nodes, where pods become Running and Ready on their
own, except the pods of a patched template whose template carries the annotation
`devenv.preshard.dev/crash-when-patched`: kwok's `pod-crash-loop` stage puts every container
of those in CrashLoopBackOff, with the annotation's value as the last termination message, as a
vLLM that crashes while loading would be. The same Deployment before preshard patches it runs
fine. The real Deployment controller sets the rollout's status and its Progressing condition,
including `ProgressDeadlineExceeded` after a short `progressDeadlineSeconds`.
"""

from __future__ import annotations

import time
from typing import Any, Final

import pytest
from kubernetes import client as k8s

from preshard.builders.patching import INIT_CONTAINER
from preshard.contract import reasons
from preshard.controller.plan import ANNOTATION_RETRY
from preshard_devenv import workloads
from preshard_devenv.kubeconfig import plain
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.specs import kwok_spec

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

CRASH_ANNOTATION: Final = "devenv.preshard.dev/crash-when-patched"
CRASH_MESSAGE: Final = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
    "(AWS_SECRET_ACCESS_KEY=not-for-events)"
)


def spec(**target: Any) -> dict[str, Any]:
    return kwok_spec(targets=[{"name": "vllm", **target}])


def create_deployment(
    api: k8s.ApiClient,
    namespace: str,
    *,
    replicas: int = 1,
    crash: bool = False,
    deadline: int | None = None,
) -> dict[str, Any]:
    """A vLLM Deployment on the kwok GPU nodes, available before any ShardedModel exists."""
    workloads.create_deployment(
        api,
        namespace,
        replicas=replicas,
        pod_annotations={CRASH_ANNOTATION: CRASH_MESSAGE} if crash else None,
        progress_deadline=deadline,
    )
    return wait_for(
        lambda: complete(shm.read_deployment(api, namespace, "vllm")),
        timeout=60,
        what="the original Deployment to be available",
    )


def complete(deployment: dict[str, Any]) -> dict[str, Any] | None:
    """The Deployment, if its rollout is complete by the Deployment controller's own test."""
    status = deployment.get("status") or {}
    replicas = deployment["spec"]["replicas"]
    done = (
        status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
        and status.get("replicas", 0) == replicas
        and status.get("updatedReplicas", 0) == replicas
        and status.get("availableReplicas", 0) >= replicas
    )
    return deployment if done else None


def only_target(resource: dict[str, Any]) -> dict[str, Any]:
    (found,) = resource["status"]["targets"]
    entry: dict[str, Any] = found
    return entry


def patched(deployment: dict[str, Any]) -> bool:
    """Whether the template carries preshard's init container."""
    init = deployment["spec"]["template"]["spec"].get("initContainers") or []
    return any(c["name"] == INIT_CONTAINER for c in init)


def test_ready_waits_for_the_rollout_of_the_patched_template(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    create_deployment(kube_api, namespace, replicas=2)
    # Paused, the Deployment controller takes the patched template but rolls nothing out.
    apps = k8s.AppsV1Api(kube_api)
    apps.patch_namespaced_deployment("vllm", namespace, {"spec": {"paused": True}})
    workloads.create_sharded_model(kube_api, namespace, "llama", spec())

    waiting = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.ROLLING_OUT
    )
    assert workloads.condition(waiting, "TargetsPatched")["status"] == "True"  # type: ignore[index]
    deployment = shm.read_deployment(kube_api, namespace, "vllm")
    assert patched(deployment)
    assert complete(deployment) is None
    target = only_target(waiting)
    assert (target["state"], target["reason"], target["rollout"]) == (
        "RollingOut",
        reasons.ROLLING_OUT,
        "in progress",
    )

    apps.patch_namespaced_deployment("vllm", namespace, {"spec": {"paused": False}})
    ready = shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    # Once Ready, every replica runs the patched template and is available.
    done = complete(shm.read_deployment(kube_api, namespace, "vllm"))
    assert done is not None
    assert patched(done)
    target = only_target(ready)
    assert (target["state"], target["reason"], target["rollout"]) == (
        "Patched",
        reasons.PATCHED,
        "complete",
    )
    # The first transition is an event; the rollout finishing is not.
    (event,) = wait_for(
        lambda: shm.events(kube_api, namespace, reasons.ROLLING_OUT),
        timeout=30,
        what="a RollingOut event",
    )
    assert event["type"] == "Normal"
    assert shm.events(kube_api, namespace, reasons.PATCHED) == []


def test_a_crash_looping_patched_pod_turns_the_target_unavailable(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    create_deployment(kube_api, namespace, crash=True, deadline=6)
    workloads.create_sharded_model(kube_api, namespace, "llama", spec())

    failing = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_UNAVAILABLE
    )
    target = only_target(failing)
    assert target["state"] == "Unavailable"
    assert (
        "CrashLoopBackOff, exit code 1: torch.OutOfMemoryError: CUDA out of memory"
        in (target["message"])
    )
    (event,) = wait_for(
        lambda: shm.events(kube_api, namespace, reasons.TARGET_UNAVAILABLE),
        timeout=30,
        what="a TargetUnavailable event",
    )
    assert event["type"] == "Warning"
    assert "torch.OutOfMemoryError: CUDA out of memory" in event["message"]
    assert "AWS_SECRET_ACCESS_KEY=<redacted>" in event["message"]
    assert "not-for-events" not in event["message"]
    assert "not-for-events" not in str(shm.get(kube_api, namespace, "llama")["status"])

    # Past the progress deadline, the default policy keeps the patched template.
    def timed_out() -> dict[str, Any] | None:
        resource = shm.get(kube_api, namespace, "llama")
        entry = only_target(resource)
        return resource if entry.get("rollout") == "failed" else None

    resource = wait_for(timed_out, timeout=60, what="the rollout to exceed its deadline")
    target = only_target(resource)
    assert (target["state"], target["reason"]) == ("Unavailable", reasons.TARGET_UNAVAILABLE)
    assert "exceeded its progress deadline" in target["message"]
    deployment = shm.read_deployment(kube_api, namespace, "vllm")
    assert patched(deployment)

    # The kubelet restarts the container again and again; each restart is a pod event that
    # wakes the ShardedModel, and none is a write.
    time.sleep(2)
    settled = shm.get(kube_api, namespace, "llama")["metadata"]["resourceVersion"]
    core = k8s.CoreV1Api(kube_api)
    (pod,) = [
        p
        for p in (plain(kube_api, item) for item in core.list_namespaced_pod(namespace).items)
        if patched({"spec": {"template": p}})
    ]
    for restarts in (4, 5, 6):
        containers = pod["status"]["containerStatuses"]
        statuses = [{"name": c["name"], "restartCount": restarts} for c in containers]
        core.patch_namespaced_pod_status(
            pod["metadata"]["name"], namespace, {"status": {"containerStatuses": statuses}}
        )
        time.sleep(1)
    time.sleep(2)
    assert shm.get(kube_api, namespace, "llama")["metadata"]["resourceVersion"] == settled
    current = shm.read_deployment(kube_api, namespace, "vllm")
    assert current["metadata"]["generation"] == deployment["metadata"]["generation"]


def test_policy_restore_puts_the_original_back_after_the_progress_deadline(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    original = create_deployment(kube_api, namespace, crash=True, deadline=5)
    workloads.create_sharded_model(kube_api, namespace, "llama", spec(onRolloutFailure="Restore"))

    failed = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.ROLLOUT_FAILED, timeout=90
    )
    target = only_target(failed)
    assert (target["state"], target["rollout"]) == ("RolledBack", "restored")
    assert target["failedArtifactKey"] == failed["status"]["shardSets"][0]["artifactKey"]
    assert "exceeded its progress deadline" in target["message"]
    assert "torch.OutOfMemoryError" in target["message"]

    restored = wait_for(
        lambda: complete(shm.read_deployment(kube_api, namespace, "vllm")),
        timeout=60,
        what="the restored Deployment to be available again",
    )
    assert restored["spec"]["template"] == original["spec"]["template"]
    assert not any(
        key.startswith("preshard.dev/") for key in restored["metadata"].get("annotations") or {}
    )
    # Events are posted after the pass that wrote the status.
    (event,) = wait_for(
        lambda: shm.events(kube_api, namespace, reasons.ROLLOUT_FAILED),
        timeout=30,
        what="a RolloutFailed event",
    )
    assert event["type"] == "Warning"
    assert len(wait_for(lambda: shm.events(kube_api, namespace, reasons.RESTORED), timeout=30)) == 1

    # Not patched again in a loop for the same set and spec.
    generation = restored["metadata"]["generation"]
    time.sleep(5)
    assert shm.read_deployment(kube_api, namespace, "vllm")["metadata"]["generation"] == generation
    assert only_target(shm.get(kube_api, namespace, "llama"))["state"] == "RolledBack"

    # The retry annotation tries again.
    shm.patch(kube_api, namespace, "llama", {"metadata": {"annotations": {ANNOTATION_RETRY: "1"}}})
    wait_for(
        lambda: patched(shm.read_deployment(kube_api, namespace, "vllm")),
        timeout=30,
        what="the Deployment to be patched again",
    )
