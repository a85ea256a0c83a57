"""Fixtures of the chart's tests: the pinned helm and kubectl, as a clean user or as the admin of
the local cluster, and namespaces that are cleaned up even when the operator is gone."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard_devenv import binaries
from preshard_devenv.controlplane import LocalCluster
from tests.helm.support import SECURE_NAMESPACE_LABELS, Tool


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


class Namespaces:
    """Creates namespaces for a module and deletes them afterwards.

    ShardedModels keep the operator's finalizer after the operator has stopped; deleting their
    namespace would then hang, so the finalizers are dropped first (as an admin would).
    """

    def __init__(self, api: k8s.ApiClient, prefix: str) -> None:
        self._core = k8s.CoreV1Api(api)
        self._custom = k8s.CustomObjectsApi(api)
        self._prefix = prefix
        self.created: list[str] = []

    def create(self, purpose: str, *, labels: dict[str, str] | None = None) -> str:
        """A new namespace `<prefix>-<purpose>-<random>`."""
        name = f"{self._prefix}-{purpose}-{secrets.token_hex(3)}"
        self._core.create_namespace(
            k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name, labels=labels))
        )
        self.created.append(name)
        return name

    def create_secure(self, purpose: str) -> str:
        """A namespace that enforces the "restricted" Pod Security Standard."""
        return self.create(purpose, labels=dict(SECURE_NAMESPACE_LABELS))

    def delete_all(self) -> None:
        """Release leftover ShardedModels and delete every namespace created here."""
        for name in self.created:
            try:
                listed = self._custom.list_namespaced_custom_object(
                    models.GROUP, models.VERSION, name, models.PLURAL
                )
                leftovers = cast(list[dict[str, Any]], cast(dict[str, Any], listed)["items"])
            except ApiException as error:
                if error.status != 404:
                    raise
                leftovers = []
            for item in leftovers:
                if item["metadata"].get("finalizers"):
                    self._custom.patch_namespaced_custom_object(
                        models.GROUP,
                        models.VERSION,
                        name,
                        models.PLURAL,
                        item["metadata"]["name"],
                        {"metadata": {"finalizers": None}},
                    )
            self._core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(scope="module")
def namespaces(kube_api: k8s.ApiClient) -> Iterator[Namespaces]:
    """Namespaces for one test module, deleted after it."""
    created = Namespaces(kube_api, "helm")
    try:
        yield created
    finally:
        created.delete_all()
