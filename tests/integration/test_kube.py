"""Every call of the controller's API layer against the real API server, answers and errors.

`preshard.controller.kube` sends its requests through the Kubernetes client's request building
and connection pool, not its generated API classes, so what those classes did (the path, the
query, the content type, the field manager, an `ApiException` for a refusal) is checked here
against kube-apiserver itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.controller import kube
from preshard_devenv import workloads
from tests.support import shardedmodels as shm
from tests.support.specs import kwok_spec

pytestmark = pytest.mark.cluster

HOLD: Final = "preshard.dev/test-hold"


def job(name: str, namespace: str) -> dict[str, Any]:
    """A suspended Job: it starts no pod."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "suspend": True,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "preshard", "image": "preshard:test"}],
                }
            },
        },
    }


def managers(obj: Any) -> set[str]:
    return {entry.manager for entry in obj.metadata.managed_fields or []}


@pytest.fixture
def api(kube_api: k8s.ApiClient) -> kube.Kube:
    return kube.Kube(kube_api)


def test_a_job_is_created_once_and_deleted_with_its_field_manager(
    api: kube.Kube, kube_api: k8s.ApiClient, namespace: str
) -> None:
    batch = k8s.BatchV1Api(kube_api)

    assert api.create_job(job("probe", namespace)) is True
    assert api.create_job(job("probe", namespace)) is False
    assert kube.FIELD_MANAGER in managers(batch.read_namespaced_job("probe", namespace))

    api.delete_job(namespace, "probe")
    api.delete_job(namespace, "probe")
    with pytest.raises(ApiException) as gone:
        batch.read_namespaced_job("probe", namespace)
    assert gone.value.status == 404


def test_a_deployment_is_read_and_patched_and_a_stale_patch_is_a_conflict(
    api: kube.Kube, kube_api: k8s.ApiClient, namespace: str
) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm", replicas=0)
    seen = api.get_deployment(namespace, "vllm")
    generation = seen["metadata"]["generation"]
    guarded = [
        {"op": "test", "path": "/metadata/generation", "value": generation},
        {"op": "add", "path": "/metadata/annotations", "value": {"preshard.dev/mark": "one"}},
    ]

    api.patch_deployment(namespace, "vllm", guarded)

    patched = api.get_deployment(namespace, "vllm")
    assert patched["metadata"]["annotations"] == {"preshard.dev/mark": "one"}
    assert kube.FIELD_MANAGER in {m["manager"] for m in patched["metadata"]["managedFields"]}
    bumped = [{"op": "replace", "path": "/spec/replicas", "value": 1}]
    api.patch_deployment(namespace, "vllm", bumped)
    with pytest.raises(kube.ConflictError):
        api.patch_deployment(namespace, "vllm", guarded)
    invalid = [{"op": "replace", "path": "/spec/replicas", "value": "many"}]
    with pytest.raises(ApiException) as refused:
        api.patch_deployment(namespace, "vllm", invalid)
    assert refused.value.status == 422
    with pytest.raises(kube.NotFoundError):
        api.get_deployment(namespace, "missing")
    with pytest.raises(kube.NotFoundError):
        api.patch_deployment(namespace, "missing", bumped)


@pytest.mark.usefixtures("crd")
def test_the_status_is_merged_into_the_status_subresource_only(
    api: kube.Kube, kube_api: k8s.ApiClient, namespace: str
) -> None:
    created = workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    first = [{"name": "vllm", "tensorParallelSize": 2, "state": "Waiting"}]
    api.patch_status(namespace, "llama", {"observedGeneration": 1, "targets": first})
    api.patch_status(namespace, "llama", {"targets": []})
    api.patch_status(namespace, "missing", {"observedGeneration": 1})

    resource = shm.get(kube_api, namespace, "llama")
    assert resource["status"] == {"observedGeneration": 1, "targets": []}
    assert resource["spec"] == created["spec"]
    assert resource["metadata"]["generation"] == created["metadata"]["generation"]


def test_a_log_of_a_missing_pod_is_a_404(api: kube.Kube, namespace: str) -> None:
    with pytest.raises(ApiException) as missing:
        api.read_log_tail(namespace, "gone", "preshard", lines=10, limit_bytes=1024)
    assert missing.value.status == 404


@pytest.fixture
def terminating(kube_api: k8s.ApiClient, namespace: str) -> Iterator[str]:
    """The namespace, held in deletion by a ConfigMap's finalizer until the test ends."""
    core = k8s.CoreV1Api(kube_api)
    held = k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="held", finalizers=[HOLD]))
    core.create_namespaced_config_map(namespace, held)
    core.delete_namespace(namespace)
    try:
        yield namespace
    finally:
        core.patch_namespaced_config_map("held", namespace, {"metadata": {"finalizers": None}})


def test_a_job_in_a_namespace_being_deleted_is_refused_as_such(
    api: kube.Kube, terminating: str
) -> None:
    with pytest.raises(kube.NamespaceTerminatingError):
        api.create_job(job("late", terminating))
