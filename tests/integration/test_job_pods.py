"""Every pod preshard creates passes the restricted Pod Security Standard, and carries what
`spec.jobPods` adds: checked by the real API server's PodSecurity admission in a namespace that
enforces `restricted`, through probe, serialize, verify, the patched Deployment's rollout and a
reshard."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.kubeconfig import plain
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.cluster import MISSING, RESHARDED, finish_job, job_named, verified
from tests.support.specs import kwok_spec, placement

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

RESTRICTED_POD: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
}
RESTRICTED_CONTAINER = workloads.vllm_container(
    securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
)
JOB_PODS: dict[str, Any] = {
    "labels": {"kueue.x-k8s.io/queue-name": "gpu-queue"},
    "annotations": {"example.com/team": "inference"},
    "env": [
        {"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"},
        {"name": "NO_PROXY", "value": ".svc,.cluster.local"},
    ],
    "affinity": {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 1,
                    "preference": {
                        "matchExpressions": [{"key": "type", "operator": "In", "values": ["kwok"]}]
                    },
                }
            ]
        }
    },
    "imagePullSecrets": [{"name": "registry"}],
}


@pytest.fixture
def restricted_namespace(kube_api: k8s.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose PodSecurity admission enforces `restricted`."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"r-{slug}-{secrets.token_hex(3)}"
    core = k8s.CoreV1Api(kube_api)
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name, labels=labels)))
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


def test_the_namespace_refuses_a_pod_that_is_not_restricted(
    kube_api: k8s.ApiClient, restricted_namespace: str
) -> None:
    """The check below means something: the admission is on and refuses a plain pod."""
    pod = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="plain"),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="c", image="busybox")]),
    )
    with pytest.raises(k8s.ApiException) as refused:
        k8s.CoreV1Api(kube_api).create_namespaced_pod(restricted_namespace, pod)
    assert refused.value.status == 403
    assert "violates PodSecurity" in str(refused.value.body)


def test_every_pod_preshard_creates_passes_the_restricted_standard(
    kube_api: k8s.ApiClient, restricted_namespace: str
) -> None:
    namespace = restricted_namespace
    workloads.create_deployment(
        kube_api, namespace, "vllm", container=RESTRICTED_CONTAINER, pod_spec=RESTRICTED_POD
    )
    # The CPU Jobs (probes, verifications, the reshard) wait on the manual node for the test
    # to report their outcome; the serialize Job runs on a kwok GPU node, which completes it.
    body = kwok_spec(
        verification=placement("manual"),
        jobPods=JOB_PODS,
    )
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    for tp in (2, 4):
        key = shm.artifact_key(kube_api, namespace, "llama", tp)
        finish_job(
            kube_api, namespace, job_named(kube_api, namespace, f"{key[:8]}-verify-1"), MISSING
        )
        if tp == 4:
            reshard = job_named(kube_api, namespace, f"{key[:8]}-reshard-1")
            finish_job(kube_api, namespace, reshard, RESHARDED)
        finish_job(
            kube_api, namespace, job_named(kube_api, namespace, f"{key[:8]}-verify-2"), verified(tp)
        )
        if tp == 2:
            shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
            # A second TP size: its set is resharded from the first by a CPU Job.
            shm.patch(kube_api, namespace, "llama", {"spec": {"tensorParallelSizes": [2, 4]}})
    wait_for(
        lambda: (shm.shard_set(kube_api, namespace, "llama", 4) or {}).get("stage") == "Verified",
        what="the TP 4 set verified",
    )

    jobs = shm.jobs(kube_api, namespace)
    kinds = sorted(j["metadata"]["labels"]["preshard.dev/command"] for j in jobs)
    assert kinds == ["reshard", "serialize", "verify", "verify", "verify", "verify"], kinds
    core = k8s.CoreV1Api(kube_api)
    listed = core.list_namespaced_pod(namespace, label_selector="preshard.dev/command")
    pods = plain(kube_api, listed)["items"]
    # Each Job made its pod: the admission let every one of them in.
    assert {p["metadata"]["labels"]["job-name"] for p in pods} == {
        j["metadata"]["name"] for j in jobs
    }
    for job in jobs:
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert job["metadata"]["annotations"]["example.com/team"] == "inference"
    for pod in pods:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["HTTPS_PROXY"] == "http://proxy.internal:3128", pod["metadata"]["name"]
        assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
        assert pod["spec"]["affinity"] == JOB_PODS["affinity"]
    # The patched Deployment's pods (with preshard's init container) were admitted too.
    served = plain(kube_api, core.list_namespaced_pod(namespace, label_selector="app=vllm"))
    assert any(
        c["name"] == "preshard-fetch-config"
        for p in served["items"]
        for c in p["spec"].get("initContainers") or []
    )
    refusals = core.list_namespaced_event(namespace, field_selector="reason=FailedCreate").items
    assert refusals == [], [e.message for e in refusals]


def test_scratch_on_a_claim_is_admitted_and_the_claim_made_with_the_pod(
    kube_api: k8s.ApiClient, restricted_namespace: str
) -> None:
    """`scratchVolume`: the serialize pod passes the restricted standard with its generic
    ephemeral volume, and the controller manager makes the pod's claim as the Job asked."""
    namespace = restricted_namespace
    body = {
        "model": {"id": "org/model", "revision": "abc123"},
        "storage": {"uri": "s3://models/shards", "endpoint": "http://s3.storage:8333"},
        "tensorParallelSizes": [2],
        "serialization": {"scratchSize": "300Gi", "scratchVolume": {"storageClassName": "nvme"}},
        "verification": placement("manual"),
    }
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    key = shm.artifact_key(kube_api, namespace, "llama", 2)
    finish_job(kube_api, namespace, job_named(kube_api, namespace, f"{key[:8]}-verify-1"), MISSING)
    serialize = job_named(kube_api, namespace, f"{key[:8]}-serialize-1")
    core = k8s.CoreV1Api(kube_api)

    def claim() -> dict[str, Any] | None:
        claims = plain(kube_api, core.list_namespaced_persistent_volume_claim(namespace))["items"]
        return claims[0] if claims else None

    made = wait_for(claim, what="the serialize pod's scratch claim")
    pod = plain(
        kube_api,
        core.list_namespaced_pod(
            namespace, label_selector=f"job-name={serialize['metadata']['name']}"
        ),
    )["items"][0]
    assert made["metadata"]["name"] == f"{pod['metadata']['name']}-scratch"
    assert [o["kind"] for o in made["metadata"]["ownerReferences"]] == ["Pod"]
    assert made["spec"]["storageClassName"] == "nvme"
    assert made["spec"]["resources"]["requests"] == {"storage": "300Gi"}
    requests = pod["spec"]["containers"][0]["resources"]["requests"]
    assert "ephemeral-storage" not in requests
    refusals = core.list_namespaced_event(namespace, field_selector="reason=FailedCreate").items
    assert refusals == [], [e.message for e in refusals]
