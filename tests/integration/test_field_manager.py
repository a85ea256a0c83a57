"""Every write of the operator carries the field manager `preshard`, as the API server records it.

A GitOps tool tells the fields it owns from the operator's by `metadata.managedFields`. The
Deployment here is created as `gitops` would create it; the operator's patch, its Jobs and the
ShardedModel's status must be recorded under `preshard`, never under the Python client's
User-Agent (`OpenAPI-Generator`).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.kubeconfig import plain
from tests.support import shardedmodels as shm
from tests.support.specs import kwok_spec

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

GITOPS = "gitops"
CLIENT_DEFAULT = "OpenAPI-Generator"


def create_deployment_as_gitops(api: k8s.ApiClient, namespace: str) -> None:
    workloads.create_deployment(api, namespace, field_manager=GITOPS)


def entries(obj: dict[str, Any], manager: str) -> list[dict[str, Any]]:
    return [e for e in obj["metadata"].get("managedFields") or [] if e["manager"] == manager]


def test_writes_are_recorded_under_the_field_manager_preshard(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    create_deployment_as_gitops(kube_api, namespace)
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    resource = shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)

    deployment = shm.read_deployment(kube_api, namespace, "vllm")
    assert shm.flag(shm.vllm_args(deployment), "--load-format") == "tensorizer"
    (patched,) = entries(deployment, "preshard")
    assert patched["operation"] == "Update"
    assert "subresource" not in patched
    fields = patched["fieldsV1"]
    assert "f:preshard.dev/owner" in fields["f:metadata"]["f:annotations"]
    assert "f:initContainers" in fields["f:spec"]["f:template"]["f:spec"]
    assert entries(deployment, GITOPS)
    assert not entries(deployment, CLIENT_DEFAULT)

    jobs = shm.jobs(kube_api, namespace)
    assert jobs
    for job in jobs:
        (created,) = entries(job, "preshard")
        assert (created["operation"], created.get("subresource")) == ("Update", None)
        assert "f:template" in created["fieldsV1"]["f:spec"]
        assert not entries(job, CLIENT_DEFAULT), job["metadata"]["name"]

    (status,) = entries(resource, "preshard")
    assert (status["operation"], status["subresource"]) == ("Update", "status")
    assert "f:conditions" in status["fieldsV1"]["f:status"]
    # The test itself created the ShardedModel with the client's default manager.
    assert [e.get("subresource") for e in entries(resource, CLIENT_DEFAULT)] == [None]


def test_the_client_default_would_be_recorded_otherwise(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    """What the API server records for a write without a field manager, this client's."""
    created = k8s.CoreV1Api(kube_api).create_namespaced_config_map(
        namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="plain"), data={"k": "v"})
    )
    (entry,) = plain(kube_api, created)["metadata"]["managedFields"]
    assert entry["manager"] == CLIENT_DEFAULT
