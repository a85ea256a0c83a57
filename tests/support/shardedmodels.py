"""Helpers for tests that drive ShardedModels through the real API server (they are created
with `preshard_devenv.workloads`): reading, editing and deleting them, waiting on their
conditions with the operator watched, and the checks every test makes of them."""

from __future__ import annotations

import json
import re
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard.contract import reasons
from preshard_devenv.kubeconfig import plain
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from preshard_devenv.workloads import condition

Manifest = dict[str, Any]

TRACEBACK: Final = "Traceback (most recent call last)"


def get(api: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """Read a ShardedModel as a dict."""
    found = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
        models.GROUP, models.VERSION, namespace, models.PLURAL, name
    )
    return plain(api, found)


def patch(api: k8s.ApiClient, namespace: str, name: str, body: dict[str, Any]) -> None:
    """Merge-patch a ShardedModel."""
    k8s.CustomObjectsApi(api).patch_namespaced_custom_object(
        models.GROUP,
        models.VERSION,
        namespace,
        models.PLURAL,
        name,
        body,
        _content_type="application/merge-patch+json",
    )


def replace_status(api: k8s.ApiClient, namespace: str, name: str, status: Manifest) -> None:
    """Put a ShardedModel's whole status back as it was (what an operator that stopped before
    its status write leaves behind)."""
    current = get(api, namespace, name)
    k8s.CustomObjectsApi(api).replace_namespaced_custom_object_status(
        models.GROUP,
        models.VERSION,
        namespace,
        models.PLURAL,
        name,
        {**current, "status": status},
    )


def delete(api: k8s.ApiClient, namespace: str, name: str) -> None:
    """Delete a ShardedModel (its finalizer runs the cleanup)."""
    k8s.CustomObjectsApi(api).delete_namespaced_custom_object(
        models.GROUP, models.VERSION, namespace, models.PLURAL, name
    )


def gone(api: k8s.ApiClient, namespace: str, name: str) -> bool:
    """Whether the ShardedModel no longer exists."""
    try:
        get(api, namespace, name)
    except ApiException as error:
        if error.status == 404:
            return True
        raise
    return False


def events(api: k8s.ApiClient, namespace: str, reason: str) -> list[Manifest]:
    """The events of the namespace's ShardedModels with this reason."""
    found = k8s.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.kind=ShardedModel,reason={reason}"
    )
    return [plain(api, item) for item in found.items]


def wait_condition(
    api: k8s.ApiClient,
    namespace: str,
    name: str,
    type_: str,
    status: str,
    reason: str | None = None,
    *,
    operator: OperatorProcess | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Wait until a condition has a status (and reason); returns the whole resource.

    With `operator`, it must stay up meanwhile. A timeout shows the status, the namespace's
    Jobs and the end of the operator's log.
    """

    def check() -> dict[str, Any] | None:
        if operator is not None and not operator.alive():
            raise AssertionError(f"the operator exited; its log:\n{operator.log_tail()}")
        resource = get(api, namespace, name)
        found = condition(resource, type_) or {}
        matches = found.get("status") == status and reason in (None, found.get("reason"))
        return resource if matches else None

    try:
        return wait_for(
            check, timeout=timeout, interval=0.25, what=f"{name}: {type_}={status} ({reason})"
        )
    except TimeoutError as error:
        current = get(api, namespace, name).get("status")
        job_states = [
            (j["metadata"]["name"], j.get("status", {}).get("conditions"))
            for j in jobs(api, namespace)
        ]
        log = f"\noperator log:\n{operator.log_tail(60)}" if operator is not None else ""
        raise AssertionError(
            f"{error}\nstatus: {json.dumps(current, indent=1)}\njobs: {job_states}{log}"
        ) from None


def wait_ready(
    api: k8s.ApiClient,
    namespace: str,
    name: str,
    *,
    operator: OperatorProcess | None = None,
    timeout: float = 90.0,
) -> dict[str, Any]:
    """Wait for Ready=True (see `wait_condition`)."""
    return wait_condition(api, namespace, name, "Ready", "True", operator=operator, timeout=timeout)


def read_deployment(api: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """A Deployment as a dict."""
    return plain(api, k8s.AppsV1Api(api).read_namespaced_deployment(name, namespace))


def vllm_args(deployment: dict[str, Any], container: str = "vllm") -> list[str]:
    """The args of a Deployment's container."""
    for item in deployment["spec"]["template"]["spec"]["containers"]:
        if item["name"] == container:
            args: list[str] = item.get("args") or []
            return args
    raise KeyError(container)


def flag(args: list[str], name: str) -> str | None:
    """The value after a flag in an argument list."""
    return args[args.index(name) + 1] if name in args else None


def jobs(api: k8s.ApiClient, namespace: str) -> list[dict[str, Any]]:
    """The namespace's Jobs as dicts, by name."""
    items = k8s.BatchV1Api(api).list_namespaced_job(namespace).items
    return sorted(
        (plain(api, item) for item in items),
        key=lambda j: str(j["metadata"]["name"]),
    )


def only_set(resource: Manifest) -> Manifest:
    """The one shard set entry of a ShardedModel's status."""
    (entry,) = resource["status"]["shardSets"]
    found: Manifest = entry
    return found


def shard_set(api: k8s.ApiClient, namespace: str, name: str, tp: int) -> Manifest | None:
    """The status entry of a ShardedModel's set at one TP size, if the status has one."""
    sets = (get(api, namespace, name).get("status") or {}).get("shardSets") or []
    return next((s for s in sets if s["tensorParallelSize"] == tp), None)


def artifact_key(api: k8s.ApiClient, namespace: str, name: str, tp: int) -> str:
    """The key of a ShardedModel's set at one TP size, once the status names that set."""
    entry = wait_for(
        lambda: shard_set(api, namespace, name, tp), what=f"a TP {tp} set in {name}'s status"
    )
    return str(entry["artifactKey"])


def forbid_tracebacks(operator: OperatorProcess) -> None:
    """Fail when the operator is down or has logged a traceback."""
    assert operator.alive(), f"the operator exited:\n{operator.log_tail()}"
    log = operator.log()
    at = log.find(TRACEBACK)
    assert at < 0, log[max(0, at - 2000) : at + 4000]


def is_camel_case(reason: str) -> bool:
    """Whether a condition reason follows the API conventions (`TPExceedsGPUs` counts)."""
    return re.fullmatch(r"[A-Z][A-Za-z0-9]*", reason) is not None


KNOWN_REASONS: Final = frozenset(
    value for name, value in vars(reasons).items() if name.isupper() and isinstance(value, str)
)
