"""Every Kubernetes API call the controller makes, in one small module.

Writes are idempotent: creating what exists and deleting what is gone count as done, and each
carries the field manager `preshard`. The controller never reads Secrets and has no API for it
here.
"""

from __future__ import annotations

import json
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
_WRITES: Final = frozenset({"POST", "PUT", "PATCH"})
# The paths the controller calls; `param_serialize` fills in and quotes the names.
JOBS: Final = "/apis/batch/v1/namespaces/{namespace}/jobs"
JOB: Final = JOBS + "/{name}"
POD_LOG: Final = "/api/v1/namespaces/{namespace}/pods/{name}/log"
DEPLOYMENT: Final = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
SHARDEDMODEL_STATUS: Final = (
    f"/apis/{models.GROUP}/{models.VERSION}/namespaces/{{namespace}}"
    f"/{models.PLURAL}/{{name}}/status"
)


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
    """The controller's view of the API server.

    Requests go through the client's own request building, authentication and connection pool
    (`param_serialize`, `call_api`), not its generated API classes: those validate every argument
    and build a model of every response, and importing the four the controller would need holds
    about 90 MiB. Bodies are sent and read as the plain dicts the controller works with.
    """

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api

    def create_job(self, manifest: Manifest) -> bool:
        """Create a Job; False when one of that name exists already."""
        namespace = manifest["metadata"]["namespace"]
        try:
            self._call(
                "POST",
                JOBS,
                {"namespace": namespace},
                body=manifest,
            )
        except ApiException as error:
            if error.status == 409:
                return False
            if error.status == 403 and "being terminated" in str(error.body or ""):
                raise NamespaceTerminatingError(namespace) from None
            raise
        return True

    def read_log_tail(
        self, namespace: str, pod: str, container: str, *, lines: int, limit_bytes: int
    ) -> str:
        """The last `lines` lines (at most `limit_bytes`) of a container's log."""
        return self._call(
            "GET",
            POD_LOG,
            {"namespace": namespace, "name": pod},
            query=[("container", container), ("tailLines", lines), ("limitBytes", limit_bytes)],
            timeout=10,
        ).decode(errors="replace")

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete a Job and its pods (in the background); a missing Job is fine."""
        try:
            self._call(
                "DELETE",
                JOB,
                {"namespace": namespace, "name": name},
                query=[("gracePeriodSeconds", 0), ("propagationPolicy", "Background")],
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def get_deployment(self, namespace: str, name: str) -> Manifest:
        """The current Deployment, as a plain dict."""
        try:
            data = self._call("GET", DEPLOYMENT, {"namespace": namespace, "name": name})
        except ApiException as error:
            if error.status == 404:
                raise NotFoundError(f"Deployment {namespace}/{name}") from None
            raise
        deployment: Manifest = json.loads(data)
        return deployment

    def patch_deployment(self, namespace: str, name: str, patch: list[Manifest]) -> None:
        """Apply a JSON patch; `ConflictError` when its `test` of the generation fails."""
        try:
            self._call(
                "PATCH",
                DEPLOYMENT,
                {"namespace": namespace, "name": name},
                body=patch,
                content_type=JSON_PATCH,
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
            self._call(
                "PATCH",
                SHARDEDMODEL_STATUS,
                {"namespace": namespace, "name": name},
                body={"status": status},
                content_type=MERGE_PATCH,
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def _call(
        self,
        method: str,
        path: str,
        path_params: dict[str, str],
        *,
        query: list[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> bytes:
        """One request; the response body. Every write names preshard as its field manager. A
        status outside 2xx raises `ApiException` (or its subclass for the status), with the
        response text as its body, as the generated API methods do."""
        if method in _WRITES:
            query = [*(query or ()), ("fieldManager", FIELD_MANAGER)]
        request = self._api.param_serialize(
            method=method,
            resource_path=path,
            path_params=path_params,
            query_params=query,
            # What the generated methods send: the API server answers JSON errors, and a log as
            # its text, to this Accept.
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(*request, _request_timeout=timeout)
        data: bytes = response.read()  # type: ignore[no-untyped-call] # the REST layer is untyped
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(
                http_resp=response, body=data.decode(errors="replace"), data=None
            )
        return data


def _pointer(document: Any, path: str) -> Any:
    """The value at a JSON pointer, or None where the path does not exist."""
    node = document
    for part in path.split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node
