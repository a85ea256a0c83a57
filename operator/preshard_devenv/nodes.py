"""The local cluster's nodes: fake GPU nodes played by kwok, and one node the test runner plays.

- `kwok-gpu-0`, `kwok-gpu-1`: kwok runs their pods; Job pods complete about a second after
  they start (with the JSON outcome as termination message when the pod carries the
  `preshard.dev/command` label), other pods stay Running and Ready.
- `kwok-manual-0` (tainted): kwok starts its pods and leaves them Running, so a test can write
  the terminal status itself.
- `preshard-runner` (tainted, not kwok's): the test pod runner plays its kubelet and runs the
  containers as local processes. Nothing keeps it Ready unless the runner is running.
"""

from __future__ import annotations

from typing import Any, Final

TEST_NODE_LABEL: Final = "preshard.dev/test-node"
KWOK_LABEL_SELECTOR: Final = "type=kwok"

GPU_NODES: Final = ("kwok-gpu-0", "kwok-gpu-1")
MANUAL_NODE: Final = "kwok-manual-0"
RUNNER_NODE: Final = "preshard-runner"

GPU_RESOURCE: Final = "nvidia.com/gpu"
GPUS_PER_NODE: Final = 8

CAPACITY: Final = {
    GPU_RESOURCE: str(GPUS_PER_NODE),
    "cpu": "64",
    "memory": "512Gi",
    "pods": "110",
    "ephemeral-storage": "2Ti",
}


def _node(name: str, labels: dict[str, str], taint_value: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if taint_value is not None:
        spec["taints"] = [{"key": TEST_NODE_LABEL, "value": taint_value, "effect": "NoSchedule"}]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **labels,
            },
        },
        "spec": spec,
        "status": {"capacity": dict(CAPACITY), "allocatable": dict(CAPACITY)},
    }


def manifests() -> list[dict[str, Any]]:
    """Every test node, as the objects to create."""
    kwok = {"type": "kwok"}
    return [
        *(_node(n, {**kwok, TEST_NODE_LABEL: "auto"}, None) for n in GPU_NODES),
        _node(MANUAL_NODE, {**kwok, TEST_NODE_LABEL: "manual"}, "manual"),
        _node(RUNNER_NODE, {TEST_NODE_LABEL: "runner"}, "runner"),
    ]


def toleration(node_kind: str) -> dict[str, str]:
    """The toleration for a tainted test node (`manual` or `runner`)."""
    return {
        "key": TEST_NODE_LABEL,
        "operator": "Equal",
        "value": node_kind,
        "effect": "NoSchedule",
    }


def on_node(node_kind: str) -> dict[str, Any]:
    """Pod spec fields that place a pod on a test node kind (`auto`, `manual` or `runner`)."""
    spec: dict[str, Any] = {"nodeSelector": {TEST_NODE_LABEL: node_kind}}
    if node_kind != "auto":
        spec["tolerations"] = [toleration(node_kind)]
    return spec
