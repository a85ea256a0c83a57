"""The local control plane is real: schemas, RBAC, scheduling and Jobs behave as in a cluster."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.contract import reasons
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.nodes import on_node
from preshard_devenv.procs import wait_for
from tests.support.cluster import (
    GPU_NODES,
    GPU_RESOURCE,
    MANUAL_NODE,
    api_for,
    complete_pod,
    job_pods,
    termination_message,
    wait_for_job,
    wait_for_pod,
)

pytestmark = pytest.mark.cluster


def _job(
    name: str,
    *,
    gpus: int,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    node_kind: str = "auto",
) -> k8s.V1Job:
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels or {}, "annotations": annotations or {}},
                "spec": {
                    "restartPolicy": "Never",
                    **on_node(node_kind),
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/preshard:test",
                            "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                        }
                    ],
                },
            },
        },
    }
    return k8s.V1Job.model_validate(body)


def test_nodes_advertise_gpus(kube_api: k8s.ApiClient) -> None:
    node = k8s.CoreV1Api(kube_api).read_node(GPU_NODES[0])
    assert node.status is not None, "the node has no status"
    assert (node.status.capacity or {})[GPU_RESOURCE] == "8"
    assert (node.status.allocatable or {})[GPU_RESOURCE] == "8"
    assert node.metadata is not None, "the node has no metadata"
    assert (node.metadata.labels or {})["type"] == "kwok"


def test_crd_schema_is_enforced(kube_api: k8s.ApiClient, namespace: str) -> None:
    group = f"smoke{secrets.token_hex(3)}.preshard.dev"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["size"],
                                    "properties": {"size": {"type": "integer", "minimum": 1}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    extensions = k8s.ApiextensionsV1Api(kube_api)
    extensions.create_custom_resource_definition(k8s.V1CustomResourceDefinition.model_validate(crd))

    def established() -> bool:
        # The API server may not have written the status of a CRD it just created.
        status = extensions.read_custom_resource_definition(f"widgets.{group}").status
        return any(
            c.type == "Established" and c.status == "True"
            for c in ((status.conditions or []) if status else [])
        )

    try:
        wait_for(established, what="the CRD to be established")
        objects = k8s.CustomObjectsApi(kube_api)

        def create(size: object) -> Any:
            body = {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": f"w-{secrets.token_hex(3)}"},
                "spec": {"size": size},
            }
            return objects.create_namespaced_custom_object(group, "v1", namespace, "widgets", body)

        # A freshly established CRD can answer 404 for a moment while discovery catches up.
        created = wait_for(lambda: _or_none(lambda: create(3)), what="the CRD to serve")
        assert created["spec"]["size"] == 3
        with pytest.raises(ApiException) as bad:
            create(0)
        assert bad.value.status == 422
        assert "spec.size" in str(bad.value.body)
    finally:
        extensions.delete_custom_resource_definition(f"widgets.{group}")


def _or_none(call: Any) -> Any:
    try:
        return call()
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def test_rbac_is_enforced_for_a_service_account(
    cluster: LocalCluster, kube_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(kube_api)
    rbac = k8s.RbacAuthorizationV1Api(kube_api)
    core.create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount.model_validate({"metadata": {"name": "reader"}})
    )
    core.create_namespaced_config_map(
        namespace,
        k8s.V1ConfigMap.model_validate({"metadata": {"name": "settings"}, "data": {"a": "1"}}),
    )
    core.create_namespaced_secret(
        namespace,
        k8s.V1Secret.model_validate({"metadata": {"name": "hidden"}, "stringData": {"k": "v"}}),
    )
    rbac.create_namespaced_role(
        namespace,
        k8s.V1Role.model_validate(
            {
                "metadata": {"name": "configmap-getter"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
            }
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        k8s.V1RoleBinding.model_validate(
            {
                "metadata": {"name": "reader"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "configmap-getter",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
            }
        ),
    )
    with api_for(cluster.service_account_kubeconfig(namespace, "reader")) as api:
        as_reader = k8s.CoreV1Api(api)
        assert as_reader.read_namespaced_config_map("settings", namespace).data == {"a": "1"}
        for denied in (
            lambda: as_reader.list_namespaced_pod(namespace),
            lambda: as_reader.read_namespaced_secret("hidden", namespace),
            lambda: as_reader.list_namespaced_config_map(namespace),
        ):
            with pytest.raises(ApiException) as forbidden:
                denied()
            assert forbidden.value.status == 403
            assert forbidden.value.body is not None, "the 403 has no Status body"
            reason = json.loads(forbidden.value.body)["message"]
            assert f'User "system:serviceaccount:{namespace}:reader" cannot' in reason


def test_client_certificate_users_are_authenticated(cluster: LocalCluster, namespace: str) -> None:
    kubeconfig = cluster.user_kubeconfig("alice", ["team-a"])
    with api_for(kubeconfig) as api, pytest.raises(ApiException) as forbidden:
        k8s.CoreV1Api(api).list_namespaced_pod(namespace)
    assert forbidden.value.status == 403
    assert forbidden.value.body is not None, "the 403 has no Status body"
    assert 'User "alice" cannot list' in json.loads(forbidden.value.body)["message"]


def test_gpu_job_is_scheduled_to_a_fake_gpu_node_and_completes(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    k8s.BatchV1Api(kube_api).create_namespaced_job(namespace, _job("gpu", gpus=2))
    assert wait_for_job(kube_api, namespace, "gpu") == "Complete"
    (pod,) = job_pods(kube_api, namespace, "gpu")
    assert pod.spec.node_name in GPU_NODES
    assert pod.status.phase == "Succeeded"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0
    assert termination_message(pod) is None


def test_a_pod_asking_for_too_many_gpus_stays_pending(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(kube_api)
    core.create_namespaced_pod(
        namespace,
        k8s.V1Pod.model_validate(
            {
                "metadata": {"name": "greedy"},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/x",
                            "resources": {"limits": {GPU_RESOURCE: "9"}},
                        }
                    ]
                },
            }
        ),
    )

    def unschedulable(pod: Any) -> bool:
        return any(
            c.type == "PodScheduled" and c.reason == "Unschedulable"
            for c in pod.status.conditions or []
        )

    pod = wait_for_pod(kube_api, namespace, "greedy", unschedulable, what="Unschedulable")
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    assert "Insufficient nvidia.com/gpu" in next(
        c.message for c in pod.status.conditions if c.type == "PodScheduled"
    )


@pytest.mark.parametrize(
    ("command", "annotations", "expected"),
    [
        (
            "verify",
            {"preshard.dev/tensor-parallel-size": "2"},
            {"command": "verify", "ok": True, "reason": reasons.VERIFIED, "tensorParallelSize": 2},
        ),
        (
            "serialize",
            {"preshard.dev/tensor-parallel-size": "4"},
            {
                "command": "serialize",
                "ok": True,
                "reason": reasons.SERIALIZED,
                "tensorParallelSize": 4,
            },
        ),
        ("delete", {}, {"command": "delete", "ok": True, "reason": reasons.DELETED}),
    ],
)
def test_kwok_completes_data_plane_jobs_with_their_outcome(
    kube_api: k8s.ApiClient,
    namespace: str,
    command: str,
    annotations: dict[str, str],
    expected: dict[str, object],
) -> None:
    job = _job(
        "dataplane", gpus=0, labels={"preshard.dev/command": command}, annotations=annotations
    )
    k8s.BatchV1Api(kube_api).create_namespaced_job(namespace, job)
    assert wait_for_job(kube_api, namespace, "dataplane") == "Complete"
    (pod,) = job_pods(kube_api, namespace, "dataplane")
    message = termination_message(pod)
    assert message is not None
    assert json.loads(message) == expected


def test_pods_on_the_manual_node_wait_for_the_test(kube_api: k8s.ApiClient, namespace: str) -> None:
    job = _job("manual", gpus=1, labels={"preshard.dev/command": "verify"}, node_kind="manual")
    k8s.BatchV1Api(kube_api).create_namespaced_job(namespace, job)
    pod = wait_for(
        lambda: [p for p in job_pods(kube_api, namespace, "manual") if p.status.phase == "Running"],
        what="the Job's pod to run",
    )[0]
    assert pod.spec.node_name == MANUAL_NODE
    outcome = '{"command":"verify","ok":false,"reason":"ShardMissing"}'
    complete_pod(kube_api, pod, 11, outcome)
    assert wait_for_job(kube_api, namespace, "manual") == "Failed"
    # kwok completes its pods a second after they run: watch for twice that long that it
    # leaves the status the test wrote alone.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        (pod,) = job_pods(kube_api, namespace, "manual")
        assert pod.status.phase == "Failed"
        state = pod.status.container_statuses[0].state
        assert state.running is None
        assert state.terminated.exit_code == 11
        assert state.terminated.message == outcome
        time.sleep(0.25)


def test_deployment_pods_stay_running_and_ready(kube_api: k8s.ApiClient, namespace: str) -> None:
    labels = {"app": "server"}
    k8s.AppsV1Api(kube_api).create_namespaced_deployment(
        namespace,
        k8s.V1Deployment.model_validate(
            {
                "metadata": {"name": "server"},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "containers": [
                                {
                                    "name": "vllm",
                                    "image": "registry.invalid/vllm",
                                    "resources": {"limits": {GPU_RESOURCE: "1"}},
                                }
                            ]
                        },
                    },
                },
            }
        ),
    )

    def available() -> bool:
        status = (
            k8s.AppsV1Api(kube_api).read_namespaced_deployment_status("server", namespace).status
        )
        # A Deployment the controller has not seen yet may have no status.
        return status is not None and (status.available_replicas or 0) == 1

    wait_for(available, what="the Deployment to be available")
    (pod,) = k8s.CoreV1Api(kube_api).list_namespaced_pod(namespace).items
    assert pod.status is not None, "the pod has no status"
    assert pod.status.phase == "Running"
    assert pod.spec is not None, "the pod has no spec"
    assert pod.spec.node_name in GPU_NODES


def test_restart_apiserver_keeps_the_data(cluster: LocalCluster, namespace: str) -> None:
    with cluster.api_client() as api:
        k8s.CoreV1Api(api).create_namespaced_config_map(
            namespace,
            k8s.V1ConfigMap.model_validate({"metadata": {"name": "kept"}, "data": {"k": "v"}}),
        )
    port = cluster.server
    cluster.restart_apiserver()
    assert cluster.server == port
    with cluster.api_client() as api:
        assert k8s.CoreV1Api(api).read_namespaced_config_map("kept", namespace).data == {"k": "v"}
