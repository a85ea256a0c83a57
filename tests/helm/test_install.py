"""The chart installed into the real control plane, watching the whole cluster.

The operator runs as a local process with the args and environment of the installed Deployment
and the installed ServiceAccount's token, so every API call it makes is checked by the API
server against the chart's RBAC. The module walks one release through its life: install an
earlier chart version, serve a ShardedModel, upgrade, serve another, probe what the account
may not do, uninstall, and install again.
"""

from __future__ import annotations

import json
import re
import secrets
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

import preshard
from preshard.api import models as models_api
from preshard.builders.shardset import LABEL_SHARDEDMODEL
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.chart import (
    CHART,
    CRD_NAME,
    Manifest,
    Release,
    adopt_crd,
    can_i,
    chart_operator,
    copy_chart,
    create_workload,
    forbidden_requests,
    get_sharded_model,
    is_ready,
)
from tests.support.cluster import GPU_NODES
from tests.support.namespaces import Namespaces
from tests.support.tools import Tool

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PREVIOUS_VERSION: Final = "0.0.9"
# The values this installation is managed with; the upgrade passes them again, as users do.
VALUES: Final = ("--set", "config.numReaders=4", "--set", "config.logFormat=json")
HELM_WAIT: Final = ("--wait", "--timeout", "90s")
# The operator has no permission to watch CRDs; the framework logs that and carries on.
EXPECTED_FORBIDDEN: Final = ("customresourcedefinitions",)


@dataclass(frozen=True)
class Installation:
    """The release and the namespace of the models it serves."""

    release: Release
    models: str


@dataclass(frozen=True)
class Upgrade:
    """A ShardedModel served by the earlier chart, read before and after `helm upgrade`."""

    before: Manifest
    after: Manifest
    target_before: Manifest
    target_after: Manifest


@pytest.fixture(scope="module")
def installation(
    kube_api: k8s.ApiClient,
    admin_helm: Tool,
    namespaces: Namespaces,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Installation]:
    """The chart as its earlier version 0.0.9, installed into a namespace that enforces the
    restricted Pod Security Standard."""
    release = Release(f"preshard-{secrets.token_hex(3)}", namespaces.create_secure("system"))
    installed = Installation(release, namespaces.create("models"))
    adopt_crd(kube_api, release)
    previous = copy_chart(
        tmp_path_factory.mktemp("previous") / "preshard", version=PREVIOUS_VERSION
    )
    admin_helm.run(
        "install",
        *release.of(previous),
        *VALUES,
        *HELM_WAIT,
    )
    try:
        yield installed
    finally:
        admin_helm.run(
            "uninstall", release.name, "--namespace", release.namespace, "--wait", check=False
        )


def operator_for(
    release: Release, cluster: LocalCluster, api: k8s.ApiClient, work_dir: Path
) -> OperatorProcess:
    """The operator of a release, acting with a fresh token of the release's ServiceAccount."""
    kubeconfig = cluster.service_account_kubeconfig(
        release.namespace, release.service_account, path=work_dir / "operator.kubeconfig"
    )
    return chart_operator(release.deployment(api), kubeconfig, work_dir)


@pytest.fixture(scope="module")
def upgrade(
    installation: Installation,
    cluster: LocalCluster,
    kube_api: k8s.ApiClient,
    admin_helm: Tool,
    tmp_path_factory: pytest.TempPathFactory,
) -> Upgrade:
    """A ShardedModel made Ready by the earlier release's operator, then `helm upgrade` to the
    chart in this tree."""
    release, models = installation.release, installation.models
    work_dir = tmp_path_factory.mktemp("operator-previous")
    with operator_for(release, cluster, kube_api, work_dir) as operator:
        create_workload(kube_api, models, "survivor", target="vllm-survivor", revision="abc123")
        shm.wait_ready(kube_api, models, "survivor", operator=operator)
    before = get_sharded_model(kube_api, models, "survivor")
    target_before = shm.read_deployment(kube_api, models, "vllm-survivor")
    admin_helm.run(
        "upgrade",
        *release.of(CHART),
        *VALUES,
        *HELM_WAIT,
    )
    after = get_sharded_model(kube_api, models, "survivor")
    assert before is not None
    assert after is not None
    return Upgrade(
        before, after, target_before, shm.read_deployment(kube_api, models, "vllm-survivor")
    )


def crd_annotations(api: k8s.ApiClient) -> dict[str, str]:
    """The annotations of the ShardedModel CRD."""
    crd = k8s.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME)
    return dict((crd.metadata.annotations if crd.metadata else None) or {})


@pytest.fixture(scope="module")
def account_kubectl(
    upgrade: Upgrade,
    installation: Installation,
    cluster: LocalCluster,
    kubectl: Tool,
    tmp_path_factory: pytest.TempPathFactory,
) -> Tool:
    """kubectl acting as the upgraded release's ServiceAccount."""
    release = installation.release
    kubeconfig = cluster.service_account_kubeconfig(
        release.namespace,
        release.service_account,
        path=tmp_path_factory.mktemp("account") / "kubeconfig",
    )
    return kubectl.as_user(kubeconfig)


def test_operator_pod_passes_the_restricted_pod_security_standard(
    installation: Installation, kube_api: k8s.ApiClient
) -> None:
    release = installation.release
    pods = k8s.CoreV1Api(kube_api).list_namespaced_pod(
        release.namespace, label_selector=f"app.kubernetes.io/instance={release.name}"
    )
    # `helm install --wait` saw the Deployment available: the namespace admitted its pod.
    assert [pod.status.phase if pod.status else None for pod in pods.items] == ["Running"]


def test_notes_say_how_to_start_and_the_example_is_accepted(
    installation: Installation,
    admin_helm: Tool,
    admin_kubectl: Tool,
    tmp_path: Path,
) -> None:
    release = installation.release
    notes = admin_helm.run("get", "notes", release.name, "--namespace", release.namespace).stdout
    assert "kubectl create secret generic s3-credentials" in notes
    assert "kubectl get shm -w" in notes
    assert "kubectl describe shm qwen" in notes
    match = re.search(r"<<'YAML'\n(.*?)\n\s*YAML\n", notes, re.DOTALL)
    assert match is not None, notes
    example = textwrap.dedent(match.group(1))
    example = example.replace("<bucket>", "models").replace("<region>", "us-east-1")
    path = tmp_path / "example.yaml"
    path.write_text(example)
    applied = admin_kubectl.run(
        "apply", "--dry-run=server", "--namespace", installation.models, "-f", str(path)
    )
    assert "shardedmodel.preshard.dev/qwen created (server dry run)" in applied.stdout


def test_upgrade_keeps_sharded_models_and_their_status(
    upgrade: Upgrade, installation: Installation, admin_helm: Tool
) -> None:
    release = installation.release
    history = json.loads(
        admin_helm.run(
            "history", release.name, "--namespace", release.namespace, "--output", "json"
        ).stdout
    )
    assert [(h["revision"], h["chart"], h["status"]) for h in history] == [
        (1, f"preshard-{PREVIOUS_VERSION}", "superseded"),
        (2, "preshard-0.1.0", "deployed"),
    ]
    assert upgrade.after["metadata"]["uid"] == upgrade.before["metadata"]["uid"]
    assert upgrade.after["status"] == upgrade.before["status"]
    assert is_ready(upgrade.after)
    assert (
        upgrade.target_after["metadata"]["generation"]
        == (upgrade.target_before["metadata"]["generation"])
    )


def test_chart_rbac_is_enough_to_serve_and_restore_deployments(
    upgrade: Upgrade,
    installation: Installation,
    cluster: LocalCluster,
    kube_api: k8s.ApiClient,
    tmp_path: Path,
) -> None:
    release, models = installation.release, installation.models
    custom = k8s.CustomObjectsApi(kube_api)
    with operator_for(release, cluster, kube_api, tmp_path) as operator:
        create_workload(kube_api, models, "qwen", target="vllm", revision="def456")
        shm.wait_ready(kube_api, models, "qwen", operator=operator)

        # The Deployment loads the shard set the way the chart's settings say.
        patched = shm.read_deployment(kube_api, models, "vllm")["spec"]["template"]["spec"]
        vllm = patched["containers"][0]
        assert vllm["args"][vllm["args"].index("--tensor-parallel-size") + 1] == "2"
        assert vllm["args"][vllm["args"].index("--load-format") + 1] == "tensorizer"
        extra = json.loads(vllm["args"][vllm["args"].index("--model-loader-extra-config") + 1])
        assert extra["num_readers"] == 4
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert [c["image"] for c in patched["initContainers"]] == [
            f"ghcr.io/preshard/preshard:{preshard.__version__}"
        ]

        # Its Jobs ran on the fake GPU nodes and the operator read their outcome.
        pods = k8s.CoreV1Api(kube_api).list_namespaced_pod(
            models, label_selector=f"{LABEL_SHARDEDMODEL}=qwen"
        )
        assert pods.items
        assert {pod.spec.node_name if pod.spec else None for pod in pods.items} <= set(GPU_NODES)
        events = k8s.CoreV1Api(kube_api).list_namespaced_event(
            models, field_selector="involvedObject.kind=ShardedModel,involvedObject.name=qwen"
        )
        assert events.items

        # The ShardedModel served by the earlier release is left as it was.
        survivor = get_sharded_model(kube_api, models, "survivor")
        assert is_ready(survivor)
        assert (
            shm.read_deployment(kube_api, models, "vllm-survivor")["metadata"]["generation"]
            == (upgrade.target_after["metadata"]["generation"])
        )

        # Deleting the ShardedModel restores the Deployment and releases the finalizer.
        custom.delete_namespaced_custom_object(
            models_api.GROUP, models_api.VERSION, models, models_api.PLURAL, "qwen"
        )
        wait_for(
            lambda: get_sharded_model(kube_api, models, "qwen") is None,
            what="ShardedModel qwen to be deleted",
        )
        restored = shm.read_deployment(kube_api, models, "vllm")["spec"]["template"]["spec"]
        assert restored["containers"][0]["args"] == ["org/model"]
        assert "initContainers" not in restored
    assert forbidden_requests(operator.log(), *EXPECTED_FORBIDDEN) == []


# What the ServiceAccount may do beyond that: nothing. Each row is (verb, resource, scope).
DENIED: Final = [
    ("get", "secrets", "--all-namespaces"),
    ("list", "secrets", "--all-namespaces"),
    ("watch", "secrets", "--all-namespaces"),
    ("get", "secrets", "MODELS"),
    ("list", "secrets", "MODELS"),
    ("get", "secrets", "SYSTEM"),
    ("get", "configmaps", "MODELS"),
    ("create", "deployments", "MODELS"),
    ("update", "deployments", "MODELS"),
    ("delete", "deployments", "MODELS"),
    ("deletecollection", "deployments", "MODELS"),
    ("patch", "deployments/scale", "MODELS"),
    ("create", "pods", "MODELS"),
    ("delete", "pods", "MODELS"),
    ("create", "pods/exec", "MODELS"),
    ("patch", "jobs", "MODELS"),
    ("create", "shardedmodels", "MODELS"),
    ("delete", "shardedmodels", "MODELS"),
    ("get", "nodes", "CLUSTER"),
    ("list", "nodes", "CLUSTER"),
    ("patch", "nodes", "CLUSTER"),
    ("get", "customresourcedefinitions", "CLUSTER"),
    ("create", "customresourcedefinitions", "CLUSTER"),
    ("patch", "customresourcedefinitions", "CLUSTER"),
    ("delete", "customresourcedefinitions", "CLUSTER"),
    ("list", "namespaces", "CLUSTER"),
    ("create", "serviceaccounts/token", "SYSTEM"),
    ("create", "rolebindings", "MODELS"),
    ("create", "clusterrolebindings", "CLUSTER"),
    ("impersonate", "serviceaccounts", "MODELS"),
]
ALLOWED: Final = [
    ("list", "shardedmodels.preshard.dev", "--all-namespaces"),
    ("patch", "shardedmodels.preshard.dev/status", "MODELS"),
    ("create", "jobs.batch", "MODELS"),
    ("delete", "jobs.batch", "MODELS"),
    ("watch", "pods", "--all-namespaces"),
    ("get", "pods/log", "MODELS"),
    ("patch", "deployments.apps", "MODELS"),
    ("create", "events", "MODELS"),
    ("create", "events.events.k8s.io", "MODELS"),
]


def _scope(scope: str, installation: Installation) -> list[str]:
    return {
        "MODELS": ["--namespace", installation.models],
        "SYSTEM": ["--namespace", installation.release.namespace],
        "CLUSTER": [],
    }.get(scope, [scope])


@pytest.mark.parametrize(("verb", "resource", "scope"), DENIED)
def test_service_account_cannot(
    verb: str, resource: str, scope: str, installation: Installation, account_kubectl: Tool
) -> None:
    assert not can_i(account_kubectl, verb, resource, *_scope(scope, installation))


@pytest.mark.parametrize(("verb", "resource", "scope"), ALLOWED)
def test_service_account_can(
    verb: str, resource: str, scope: str, installation: Installation, account_kubectl: Tool
) -> None:
    assert can_i(account_kubectl, verb, resource, *_scope(scope, installation))


def test_namespace_editors_may_manage_sharded_models_and_viewers_read_them(
    upgrade: Upgrade,
    installation: Installation,
    cluster: LocalCluster,
    kube_api: k8s.ApiClient,
    kubectl: Tool,
) -> None:
    models = installation.models
    rbac = k8s.RbacAuthorizationV1Api(kube_api)
    for user, role in (("editor", "edit"), ("viewer", "view")):
        rbac.create_namespaced_role_binding(
            models,
            k8s.V1RoleBinding(
                metadata=k8s.V1ObjectMeta(name=f"{user}-{role}"),
                role_ref=k8s.V1RoleRef(
                    api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role
                ),
                subjects=[k8s.RbacV1Subject(kind="User", name=user)],
            ),
        )
    editor = kubectl.as_user(cluster.user_kubeconfig("editor"))
    viewer = kubectl.as_user(cluster.user_kubeconfig("viewer"))
    scope = ("--namespace", models)
    # The aggregation controller folds the chart's roles into edit and view shortly after.
    wait_for(
        lambda: (
            can_i(editor, "create", "shardedmodels.preshard.dev", *scope)
            and can_i(viewer, "list", "shardedmodels.preshard.dev", *scope)
        ),
        what="the aggregated ClusterRoles",
    )
    assert can_i(editor, "delete", "shardedmodels.preshard.dev", *scope)
    assert not can_i(editor, "patch", "shardedmodels.preshard.dev/status", *scope)
    assert not can_i(viewer, "create", "shardedmodels.preshard.dev", *scope)
    assert not can_i(editor, "list", "shardedmodels.preshard.dev", "--all-namespaces")


def test_uninstall_keeps_the_crd_and_sharded_models_and_reinstall_adopts_them(
    upgrade: Upgrade,
    installation: Installation,
    kube_api: k8s.ApiClient,
    admin_helm: Tool,
) -> None:
    release, models = installation.release, installation.models
    admin_helm.run("uninstall", release.name, "--namespace", release.namespace, "--wait")

    with pytest.raises(ApiException) as gone:
        k8s.AppsV1Api(kube_api).read_namespaced_deployment(release.name, release.namespace)
    assert gone.value.status == 404
    with pytest.raises(ApiException) as role_gone:
        k8s.RbacAuthorizationV1Api(kube_api).read_cluster_role(release.name)
    assert role_gone.value.status == 404
    assert crd_annotations(kube_api)["helm.sh/resource-policy"] == "keep"
    survivor = get_sharded_model(kube_api, models, "survivor")
    assert survivor is not None
    assert survivor["metadata"]["uid"] == upgrade.after["metadata"]["uid"]
    assert is_ready(survivor)

    # Installing again under the same name and namespace takes the kept CRD back.
    admin_helm.run(
        "install",
        *release.of(CHART),
        *VALUES,
        *HELM_WAIT,
    )
    assert crd_annotations(kube_api)["meta.helm.sh/release-name"] == release.name
    assert get_sharded_model(kube_api, models, "survivor") is not None
