"""The reconciler does not repeat a write its indexes do not show yet.

Under load the operator's indexes lag behind its own writes; a pass planned from a stale index
would create the same Job again (409) or patch the same Deployment again (422, then a read to
tell a failed `test` from a bad patch), and would retry a patch refused as stale from the same
stale version. These tests run the reconciler's executor against the real API server with plans
made from a stale view, and count the requests it sends.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.api.status import ShardedModelStatus
from preshard.builders import Manifest, patching
from preshard.controller import kube
from preshard.controller.plan import DeploymentPatch, Event, Plan
from preshard.controller.reconciler import RECENT_WRITE_SECONDS, Reconciler, object_log
from preshard.settings import Settings

pytestmark = pytest.mark.cluster


def _counted(reconciler: Reconciler, method: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    real: Callable[..., Any] = getattr(reconciler.kube, method)

    def counting(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(reconciler.kube, method, counting)
    return calls


def _deployment(reconciler: Reconciler, api: k8s.ApiClient, namespace: str) -> Manifest:
    k8s.AppsV1Api(api).create_namespaced_deployment(
        namespace,
        k8s.V1Deployment.model_validate(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "vllm"},
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": {"app": "vllm"}},
                    "template": {
                        "metadata": {"labels": {"app": "vllm"}},
                        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
                    },
                },
            }
        ),
    )
    return reconciler.kube.get_deployment(namespace, "vllm")


def _patch_plan(seen: Manifest, value: str) -> Plan:
    desired = copy.deepcopy(seen)
    container = desired["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "MARK", "value": value}]
    return Plan(
        status=ShardedModelStatus(),
        patches=[
            DeploymentPatch(
                name="vllm",
                patch=patching.deployment_patch(seen, desired),
                planned_from=patching.identity_of(seen),
            )
        ],
        events=[Event("Normal", "Patched", "Deployment vllm: loads the shards", "vllm")],
    )


def test_a_deployment_is_not_patched_twice_from_the_same_version(
    kube_api: k8s.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reconciler = Reconciler(kube.Kube(kube_api), Settings())
    log = object_log(namespace, "llama")
    stale = _deployment(reconciler, kube_api, namespace)
    patches = _counted(reconciler, "patch_deployment", monkeypatch)
    reads = _counted(reconciler, "get_deployment", monkeypatch)

    first = _patch_plan(stale, "one")
    assert reconciler.execute(first, namespace, log) is None
    assert len(patches) == 1
    assert [e.reason for e in first.events] == ["Patched"]

    again = _patch_plan(stale, "one")
    assert reconciler.execute(again, namespace, log) == RECENT_WRITE_SECONDS
    assert (len(patches), len(reads)) == (1, 0), "the stale plan sent a request"
    assert again.events == [], "an event for a patch that was not sent"

    current = reconciler.kube.get_deployment(namespace, "vllm")
    assert current["metadata"]["generation"] == stale["metadata"]["generation"] + 1
    newer = _patch_plan(current, "two")
    assert reconciler.execute(newer, namespace, log) is None
    assert len(patches) == 2
    env = reconciler.kube.get_deployment(namespace, "vllm")["spec"]["template"]["spec"]
    assert env["containers"][0]["env"] == [{"name": "MARK", "value": "two"}]


def test_a_patch_refused_as_stale_is_not_retried_from_the_same_version(
    kube_api: k8s.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reconciler = Reconciler(kube.Kube(kube_api), Settings())
    log = object_log(namespace, "llama")
    stale = _deployment(reconciler, kube_api, namespace)
    k8s.AppsV1Api(kube_api).patch_namespaced_deployment(
        "vllm", namespace, {"spec": {"template": {"metadata": {"labels": {"edited": "yes"}}}}}
    )
    patches = _counted(reconciler, "patch_deployment", monkeypatch)
    reads = _counted(reconciler, "get_deployment", monkeypatch)

    # Events that announce other changes stay, whatever names they mention.
    others = [
        Event("Normal", "Patched", "Deployment vllm-canary: loads the shards", "vllm-canary"),
        Event("Normal", "Verified", "TP 2 shard set 0123abcd: Verified (for vllm)"),
    ]
    for _ in range(3):
        refused = _patch_plan(stale, "one")
        refused.events += others
        assert reconciler.execute(refused, namespace, log) == RECENT_WRITE_SECONDS
        assert refused.events == others, "an event for a refused patch, or one lost with it"
    assert (len(patches), len(reads)) == (1, 1), "the refusal was retried from the same version"

    current = reconciler.kube.get_deployment(namespace, "vllm")
    assert reconciler.execute(_patch_plan(current, "two"), namespace, log) is None
    assert len(patches) == 2
    labels = reconciler.kube.get_deployment(namespace, "vllm")["spec"]["template"]["metadata"]
    assert labels["labels"]["edited"] == "yes"


def test_a_job_is_not_created_twice_while_the_index_catches_up(
    kube_api: k8s.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reconciler = Reconciler(kube.Kube(kube_api), Settings())
    log = object_log(namespace, "llama")
    creates = _counted(reconciler, "create_job", monkeypatch)
    job: Manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "verify", "namespace": namespace},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "verify", "image": "preshard:test"}],
                }
            }
        },
    }
    for _ in range(3):
        reconciler.execute(Plan(status=ShardedModelStatus(), create_jobs=[job]), namespace, log)
    assert len(creates) == 1
    assert k8s.BatchV1Api(kube_api).read_namespaced_job("verify", namespace).metadata is not None
