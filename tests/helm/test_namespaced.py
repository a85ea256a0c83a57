"""The chart installed to watch two namespaces only, next to a CRD that is managed elsewhere.

The operator runs with the release's ServiceAccount, which holds a Role in each watched
namespace and nothing cluster-wide: it serves ShardedModels there, ignores the ones outside,
and the API server refuses it everything beyond its namespaces.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.chart import (
    CHART,
    CRD_NAME,
    CRD_SOURCE,
    Release,
    can_i,
    chart_operator,
    create_workload,
    forbidden_requests,
    get_sharded_model,
)
from tests.support.namespaces import Namespaces
from tests.support.tools import Tool

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Without permission to list namespaces or CRDs, the operator framework logs that, retries for
# a while, and falls back to the namespaces it was given.
EXPECTED_FORBIDDEN: Final = ("customresourcedefinitions", "namespaces")
# That fallback waits out the framework's retries (about a minute) before watching starts.
READY_TIMEOUT: Final = 120.0


@dataclass(frozen=True)
class Installation:
    """A namespaced release, the namespaces it watches and one it does not."""

    release: Release
    watched: tuple[str, str]
    outside: str


def _crd_established(api: k8s.ApiClient) -> bool:
    try:
        crd = k8s.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    conditions = (crd.status.conditions if crd.status else None) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


@pytest.fixture(scope="module")
def crd(kube_api: k8s.ApiClient, admin_kubectl: Tool) -> None:
    """The ShardedModel CRD applied from crds/, as GitOps would, unless it exists already."""
    if not _crd_established(kube_api):
        admin_kubectl.run("apply", "--server-side", "-f", str(CRD_SOURCE))
        wait_for(lambda: _crd_established(kube_api), what="the CRD to be served")


@pytest.fixture(scope="module")
def installation(crd: None, admin_helm: Tool, namespaces: Namespaces) -> Iterator[Installation]:
    """The chart installed with `watchNamespaces` and `crds.enabled=false`."""
    release = Release(f"preshard-{secrets.token_hex(3)}", namespaces.create_secure("operator"))
    watched = (namespaces.create("team-a"), namespaces.create("team-b"))
    installed = Installation(release, watched, namespaces.create("outside"))
    admin_helm.run(
        "install",
        *release.of(CHART),
        "--set",
        f"watchNamespaces={{{','.join(watched)}}}",
        "--set",
        "crds.enabled=false",
        "--wait",
        "--timeout",
        "90s",
    )
    try:
        yield installed
    finally:
        admin_helm.run(
            "uninstall", release.name, "--namespace", release.namespace, "--wait", check=False
        )


@pytest.fixture(scope="module")
def account_kubectl(
    installation: Installation,
    cluster: LocalCluster,
    kubectl: Tool,
    tmp_path_factory: pytest.TempPathFactory,
) -> Tool:
    """kubectl acting as the release's ServiceAccount."""
    release = installation.release
    kubeconfig = cluster.service_account_kubeconfig(
        release.namespace,
        release.service_account,
        path=tmp_path_factory.mktemp("account") / "kubeconfig",
    )
    return kubectl.as_user(kubeconfig)


def test_roles_exist_only_in_the_watched_namespaces(
    installation: Installation, kube_api: k8s.ApiClient
) -> None:
    rbac = k8s.RbacAuthorizationV1Api(kube_api)
    name = installation.release.name
    for namespace in installation.watched:
        assert rbac.read_namespaced_role(name, namespace).rules
        binding = rbac.read_namespaced_role_binding(name, namespace)
        assert [(s.kind, s.name, s.namespace) for s in binding.subjects or []] == [
            ("ServiceAccount", name, installation.release.namespace)
        ]
    for namespace in (installation.outside, installation.release.namespace):
        assert not rbac.list_namespaced_role(namespace).items
    for read in (rbac.read_cluster_role, rbac.read_cluster_role_binding):
        with pytest.raises(ApiException) as missing:
            read(name)
        assert missing.value.status == 404


def test_operator_serves_only_the_watched_namespaces(
    installation: Installation,
    cluster: LocalCluster,
    kube_api: k8s.ApiClient,
    tmp_path: Path,
) -> None:
    release = installation.release
    team_a, outside = installation.watched[0], installation.outside
    kubeconfig = cluster.service_account_kubeconfig(
        release.namespace, release.service_account, path=tmp_path / "operator.kubeconfig"
    )
    with chart_operator(release.deployment(kube_api), kubeconfig, tmp_path) as operator:
        create_workload(kube_api, outside, "ignored", target="vllm", revision="abc123")
        create_workload(kube_api, team_a, "served", target="vllm", revision="abc123")
        shm.wait_ready(kube_api, team_a, "served", operator=operator, timeout=READY_TIMEOUT)
        ignored = get_sharded_model(kube_api, outside, "ignored")
        assert ignored is not None
        assert "finalizers" not in ignored["metadata"]
        assert "status" not in ignored
    assert forbidden_requests(operator.log(), *EXPECTED_FORBIDDEN) == []


@pytest.mark.parametrize(
    ("verb", "resource", "where", "allowed"),
    [
        ("list", "deployments.apps", "team-a", True),
        ("patch", "deployments.apps", "team-b", True),
        ("watch", "shardedmodels.preshard.dev", "team-b", True),
        ("list", "deployments.apps", "outside", False),
        ("patch", "deployments.apps", "outside", False),
        ("list", "deployments.apps", "everywhere", False),
        ("list", "shardedmodels.preshard.dev", "outside", False),
        ("list", "shardedmodels.preshard.dev", "everywhere", False),
        ("create", "jobs.batch", "outside", False),
        ("list", "pods", "operator", False),
        ("get", "secrets", "team-a", False),
        ("list", "secrets", "everywhere", False),
        ("delete", "deployments.apps", "team-a", False),
        ("create", "pods", "team-a", False),
        ("list", "namespaces", "cluster", False),
        ("list", "nodes", "cluster", False),
        ("list", "customresourcedefinitions", "cluster", False),
    ],
)
def test_service_account_is_confined_to_the_watched_namespaces(
    verb: str,
    resource: str,
    where: str,
    allowed: bool,
    installation: Installation,
    account_kubectl: Tool,
) -> None:
    scope = {
        "team-a": ["--namespace", installation.watched[0]],
        "team-b": ["--namespace", installation.watched[1]],
        "outside": ["--namespace", installation.outside],
        "operator": ["--namespace", installation.release.namespace],
        "everywhere": ["--all-namespaces"],
        "cluster": [],
    }[where]
    assert can_i(account_kubectl, verb, resource, *scope) is allowed
