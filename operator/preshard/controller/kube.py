"""Every Kubernetes API call the controller makes, in one small module.

Writes are idempotent: creating what exists and deleting what is gone count as done, and each
carries the field manager `preshard`. The controller never reads Secrets and has no API for it
here.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from preshard.api import models

Manifest = dict[str, Any]

# The field manager of every write, as `metadata.managedFields` shows it: GitOps tools (Argo CD,
# Flux) tell preshard's fields from their own by it. Without it the client's User-Agent,
# `OpenAPI-Generator`, would be recorded.
FIELD_MANAGER: Final = "preshard"
MERGE_PATCH: Final = "application/merge-patch+json"
JSON_PATCH: Final = "application/json-patch+json"
log = logging.getLogger(__name__)


class ConflictError(Exception):
    """The object changed since it was read (HTTP 409); read it again and retry."""


class NotFoundError(Exception):
    """The object does not exist (HTTP 404)."""


class NamespaceTerminatingError(Exception):
    """The namespace is being deleted: nothing new can be created in it."""


def load_configuration() -> client.ApiClient:
    """An API client from the kubeconfig (KUBECONFIG, ~/.kube/config) or the in-cluster account."""
    try:
        config.load_kube_config()  # type: ignore[no-untyped-call] # the loaders are untyped
    except config.ConfigException:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


class Kube:
    """The controller's view of the API server."""

    def __init__(self, api: client.ApiClient) -> None:
        self._batch = client.BatchV1Api(api)
        self._apps = client.AppsV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._core = client.CoreV1Api(api)

    def create_job(self, manifest: Manifest) -> bool:
        """Create a Job; False when one of that name exists already."""
        try:
            self._batch.create_namespaced_job(
                manifest["metadata"]["namespace"],
                client.V1Job.model_validate(manifest),
                field_manager=FIELD_MANAGER,
            )
        except ApiException as error:
            if error.status == 409:
                return False
            if error.status == 403 and "being terminated" in str(error.body or ""):
                raise NamespaceTerminatingError(manifest["metadata"]["namespace"]) from None
            raise
        return True

    def read_log_tail(
        self, namespace: str, pod: str, container: str, *, lines: int, limit_bytes: int
    ) -> str:
        """The last `lines` lines (at most `limit_bytes`) of a container's log."""
        text = self._core.read_namespaced_pod_log(
            pod,
            namespace,
            container=container,
            tail_lines=lines,
            limit_bytes=limit_bytes,
            _request_timeout=10,
        )
        return str(text)

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete a Job and its pods (in the background); a missing Job is fine."""
        try:
            self._batch.delete_namespaced_job(
                name, namespace, propagation_policy="Background", grace_period_seconds=0
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def get_deployment(self, namespace: str, name: str) -> Manifest:
        """The current Deployment, as a plain dict."""
        try:
            result = self._apps.api_client.sanitize_for_serialization(
                self._apps.read_namespaced_deployment(name, namespace)
            )
        except ApiException as error:
            if error.status == 404:
                raise NotFoundError(f"Deployment {namespace}/{name}") from None
            raise
        deployment: Manifest = result
        return deployment

    def patch_deployment(self, namespace: str, name: str, patch: list[Manifest]) -> None:
        """Apply a JSON patch; `ConflictError` when its `test` of the generation fails."""
        try:
            self._apps.patch_namespaced_deployment(
                name, namespace, patch, field_manager=FIELD_MANAGER, _content_type=JSON_PATCH
            )
        except ApiException as error:
            if error.status == 409 or (
                error.status == 422 and self._test_failed(namespace, name, patch)
            ):
                raise ConflictError(f"Deployment {namespace}/{name} changed; retrying") from None
            if error.status == 404:
                raise NotFoundError(f"Deployment {namespace}/{name}") from None
            raise

    def _test_failed(self, namespace: str, name: str, patch: list[Manifest]) -> bool:
        # The API server answers a failed `test` operation with a bare 422 (Invalid), as it
        # does an invalid patch: tell them apart by whether the tested value has changed.
        tests = [op for op in patch if op.get("op") == "test"]
        if not tests:
            return False
        try:
            current = self.get_deployment(namespace, name)
        except NotFoundError:
            return True
        return any(_pointer(current, op["path"]) != op["value"] for op in tests)

    def patch_status(self, namespace: str, name: str, status: Manifest) -> None:
        """Replace the ShardedModel's status (top-level fields are written whole)."""
        try:
            self._custom.patch_namespaced_custom_object_status(
                models.GROUP,
                models.VERSION,
                namespace,
                models.PLURAL,
                name,
                {"status": status},
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
            )
        except ApiException as error:
            if error.status != 404:
                raise


def _pointer(document: Any, path: str) -> Any:
    """The value at a JSON pointer, or None where the path does not exist."""
    node = document
    for part in path.split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node
