"""Helpers tests use to talk to the local cluster: reading Jobs and their pods, waiting for them to
finish, and finishing them the way a kubelet would."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.contract import reasons
from preshard.contract.outcome import Outcome, exit_code
from preshard_devenv import nodes
from preshard_devenv.kubeconfig import api_client, plain
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm

Manifest = dict[str, Any]

GPU_NODES = nodes.GPU_NODES
MANUAL_NODE = nodes.MANUAL_NODE
RUNNER_NODE = nodes.RUNNER_NODE
GPU_RESOURCE = nodes.GPU_RESOURCE


def now() -> str:
    """The current time as Kubernetes writes it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_for(kubeconfig: Path) -> k8s.ApiClient:
    """An API client that acts as the kubeconfig's user."""
    return api_client(kubeconfig)


def job_pods(api: k8s.ApiClient, namespace: str, job: str) -> list[Any]:
    """The pods of a Job, oldest first."""
    return pods(api, namespace, f"job-name={job}")


def job_condition(api: k8s.ApiClient, namespace: str, job: str) -> str | None:
    """`Complete` or `Failed` once the Job has finished, else None."""
    return job_finished(read_job(api, namespace, job))


def wait_for_job(api: k8s.ApiClient, namespace: str, job: str, *, timeout: float = 60.0) -> str:
    """Wait until a Job has finished; returns `Complete` or `Failed`."""
    return wait_for(
        lambda: job_condition(api, namespace, job),
        timeout=timeout,
        what=f"Job {namespace}/{job} to finish",
    )


def wait_for_pod(
    api: k8s.ApiClient,
    namespace: str,
    name: str,
    check: Callable[[Any], bool],
    *,
    timeout: float = 60.0,
    what: str = "the pod",
) -> Any:
    """Poll a pod until `check(pod)` holds; returns the pod."""
    core = k8s.CoreV1Api(api)

    def current() -> Any:
        try:
            pod = core.read_namespaced_pod(name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return pod if check(pod) else None

    return wait_for(current, timeout=timeout, what=f"{what} ({namespace}/{name})")


def termination_message(pod: Any, container: str | None = None) -> str | None:
    """The termination message of a pod's container (its first one by default)."""
    for status in pod.status.container_statuses or []:
        if container is not None and status.name != container:
            continue
        terminated = status.state.terminated if status.state else None
        return terminated.message if terminated else None
    return None


def complete_pod(
    api: k8s.ApiClient,
    pod: Any,
    exit_code: int,
    message: str | None,
    reason: str | None = None,
) -> None:
    """Write a pod's terminal status as a kubelet would: every container terminated with
    `exit_code` (reason `Completed` or `Error` unless given) and `message`, phase
    Succeeded or Failed. Meant for pods on `kwok-manual-0`, which kwok leaves Running."""
    stamp = now()
    meta = pod.metadata
    started = pod.status.start_time if pod.status and pod.status.start_time else None
    started_at = started.strftime("%Y-%m-%dT%H:%M:%SZ") if started else stamp
    terminated: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started_at,
        "finishedAt": stamp,
    }
    if message is not None:
        terminated["message"] = message
    statuses = [
        {
            "name": container.name,
            "image": container.image or "",
            "imageID": "",
            "ready": False,
            "started": False,
            "restartCount": 0,
            "state": {"terminated": terminated},
        }
        for container in pod.spec.containers
    ]
    not_ready = {"status": "False", "reason": "PodCompleted", "lastTransitionTime": stamp}
    body = {
        "status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": statuses,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
                {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
                {"type": "Ready", **not_ready},
                {"type": "ContainersReady", **not_ready},
            ],
        }
    }
    # A merge patch replaces the lists whole, so no running state from kwok survives.
    k8s.CoreV1Api(api).patch_namespaced_pod_status(
        meta.name, meta.namespace, body, _content_type="application/merge-patch+json"
    )


# What the data-plane commands report, for `finish_job`: a probe that finds no set, a
# serialize or reshard that wrote one, a verification that found it complete.
MISSING: Final = Outcome(command="verify", ok=False, reason=reasons.MANIFEST_MISSING)
SERIALIZED: Final = Outcome(command="serialize", ok=True, reason=reasons.SERIALIZED)
RESHARDED: Final = Outcome(command="reshard", ok=True, reason=reasons.RESHARDED)


def verified(tp: int) -> Outcome:
    """A verification that found a complete set for TP `tp`."""
    return Outcome(command="verify", ok=True, reason=reasons.VERIFIED, tensor_parallel_size=tp)


def finish_job(api: k8s.ApiClient, namespace: str, job: dict[str, Any], outcome: Outcome) -> None:
    """End a Job's pod on `kwok-manual-0` the way its data-plane command would: the exit code
    of `outcome`'s reason and the outcome as its termination message."""
    name = job["metadata"]["name"]
    pod = wait_for(
        lambda: next(iter(job_pods(api, namespace, name)), None), what=f"a pod of Job {name}"
    )
    complete_pod(api, pod, 0 if outcome.ok else exit_code(outcome.reason), outcome.to_message())


def job_names(api: k8s.ApiClient, namespace: str) -> list[str]:
    """The names of the namespace's Jobs, sorted."""
    return [job["metadata"]["name"] for job in shm.jobs(api, namespace)]


def job_named(
    api: k8s.ApiClient, namespace: str, suffix: str, *, timeout: float = 60.0
) -> Manifest:
    """Wait for the Job whose name ends with `suffix` (`-serialize-1`)."""

    def find() -> Manifest | None:
        return next(
            (j for j in shm.jobs(api, namespace) if j["metadata"]["name"].endswith(suffix)), None
        )

    return wait_for(find, timeout=timeout, what=f"a Job named *{suffix} in {namespace}")


def job_outcome(api: k8s.ApiClient, namespace: str, job: str) -> tuple[Any, Outcome]:
    """The newest pod of a finished Job and the outcome it reported."""
    pod = pods(api, namespace, f"job-name={job}")[-1]
    message = pod.status.container_statuses[0].state.terminated.message
    outcome = Outcome.from_message(message)
    assert outcome is not None, message
    return pod, outcome


def job_finished(job: Manifest) -> str | None:
    """`Complete` or `Failed` once a Job has finished."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition["type"] in ("Complete", "Failed") and condition["status"] == "True":
            return str(condition["type"])
    return None


def pods(api: k8s.ApiClient, namespace: str, selector: str) -> list[Any]:
    """The pods matching a label selector, oldest first."""
    found = k8s.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    return sorted(found, key=lambda p: (p.metadata.creation_timestamp, p.metadata.name))


def job_exists(api: k8s.ApiClient, namespace: str, name: str) -> bool:
    """Whether a Job exists (being deleted counts as existing)."""
    try:
        k8s.BatchV1Api(api).read_namespaced_job(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def read_job(api: k8s.ApiClient, namespace: str, name: str) -> Manifest:
    """A Job as a plain dict."""
    return plain(api, k8s.BatchV1Api(api).read_namespaced_job(name, namespace))
