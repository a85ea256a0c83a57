"""Fixtures of the chart's tests: the pinned helm and kubectl, as a clean user or as the admin of
the local cluster, and namespaces that are cleaned up even when the operator is gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from preshard_devenv import binaries
from preshard_devenv.controlplane import LocalCluster
from tests.support.namespaces import Namespaces
from tests.support.tools import Tool


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Tool:
    """The pinned helm, with a private configuration and no cluster."""
    return Tool(binaries.tool_path("helm"), Path(tmp_path_factory.mktemp("helm-home")))


@pytest.fixture(scope="session")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Tool:
    """The pinned kubectl, with a private configuration and no cluster."""
    return Tool(binaries.tool_path("kubectl"), Path(tmp_path_factory.mktemp("kubectl-home")))


@pytest.fixture(scope="session")
def admin_helm(helm: Tool, cluster: LocalCluster) -> Tool:
    """helm acting as the local cluster's admin."""
    return helm.as_user(cluster.admin_kubeconfig)


@pytest.fixture(scope="session")
def admin_kubectl(kubectl: Tool, cluster: LocalCluster) -> Tool:
    """kubectl acting as the local cluster's admin."""
    return kubectl.as_user(cluster.admin_kubeconfig)


@pytest.fixture(scope="module")
def namespaces(kube_api: k8s.ApiClient) -> Iterator[Namespaces]:
    """Namespaces for one test module, deleted after it."""
    created = Namespaces(kube_api, "helm")
    try:
        yield created
    finally:
        created.delete_all()
