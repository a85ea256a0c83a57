"""The runner node's side of the node contract: its Ready heartbeat, its Lease in
`kube-node-lease`, and waiting until the scheduler may use it."""

from __future__ import annotations

import os
from typing import Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard_devenv.podrunner.status import format_time, micro_now, now
from preshard_devenv.procs import wait_for

_LEASE_SECONDS: Final = 40


def heartbeat(api: k8s.ApiClient, node_name: str, log_port: int) -> None:
    """Post the node's Ready status (and where its kubelet serves logs), and renew its Lease."""
    stamp = now()
    core = k8s.CoreV1Api(api)
    node = core.read_node(node_name)
    conditions = [
        ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "enough PIDs"),
    ]
    previous = {c.type: c for c in (node.status.conditions if node.status else None) or []}
    body = {
        "status": {
            "conditions": [
                {
                    "type": kind,
                    "status": value,
                    "reason": reason,
                    "message": text,
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": (
                        format_time(previous[kind].last_transition_time)
                        if kind in previous and previous[kind].status == value
                        else stamp
                    ),
                }
                for kind, value, reason, text in conditions
            ],
            # The API server reaches a node's kubelet (logs) at its first address of the
            # preferred types, Hostname first: with none, at this one, on loopback.
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": log_port}},
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "preshard-runner",
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "preshard-runner://local-processes",
                "kernelVersion": os.uname().release,
                "osImage": "local processes",
                "bootID": "",
                "machineID": "",
                "systemUUID": "",
            },
        }
    }
    core.patch_node_status(node_name, body)
    renew_lease(api, node_name, node.metadata.uid if node.metadata else None)


def renew_lease(api: k8s.ApiClient, node_name: str, node_uid: str | None) -> None:
    """Renew the node's Lease, creating it the first time."""
    leases = k8s.CoordinationV1Api(api)
    spec = {
        "holderIdentity": node_name,
        "leaseDurationSeconds": _LEASE_SECONDS,
        "renewTime": micro_now(),
    }
    try:
        leases.patch_namespaced_lease(node_name, "kube-node-lease", {"spec": spec})
    except ApiException as error:
        if error.status != 404:
            raise
        owner = k8s.V1OwnerReference(
            api_version="v1", kind="Node", name=node_name, uid=node_uid or ""
        )
        lease = k8s.V1Lease(
            metadata=k8s.V1ObjectMeta(name=node_name, owner_references=[owner]),
            spec=k8s.V1LeaseSpec(holder_identity=node_name, lease_duration_seconds=_LEASE_SECONDS),
        )
        leases.create_namespaced_lease("kube-node-lease", lease)
        # The renewal time goes in as Kubernetes spells microsecond times.
        leases.patch_namespaced_lease(node_name, "kube-node-lease", {"spec": spec})


def wait_schedulable(api: k8s.ApiClient, node_name: str, timeout: float) -> None:
    """Wait until the node has none of the taints that keep the scheduler away."""
    # The node lifecycle controller removes its not-ready taint a few seconds after the
    # first Ready heartbeat; until then the scheduler would skip the node.
    core = k8s.CoreV1Api(api)
    taints: list[str] = []

    def untainted() -> bool:
        node = core.read_node(node_name)
        taints[:] = [
            t.key
            for t in (node.spec.taints if node.spec else None) or []
            if t.key.startswith("node.kubernetes.io/")
        ]
        return not taints

    try:
        wait_for(untainted, timeout=timeout, what=f"node {node_name} to be schedulable")
    except TimeoutError:
        raise TimeoutError(
            f"node {node_name} still has taints {taints} after {timeout:.0f}s"
        ) from None
