"""Namespaces a test module creates and deletes afterwards, also when the operator is gone."""

from __future__ import annotations

import secrets
from typing import Any, Final, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models

SECURE_NAMESPACE_LABELS: Final = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


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
