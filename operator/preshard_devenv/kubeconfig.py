"""Self-contained kubeconfig files (certificates embedded) for the local cluster's users, and
API clients that act as them."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from preshard_devenv.pki import KeyPair, write_private


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def render(
    *,
    server: str,
    ca_pem: bytes,
    user: str,
    client: KeyPair | None = None,
    token: str | None = None,
    cluster_name: str = "preshard-local",
) -> dict[str, Any]:
    """A kubeconfig with one cluster, one user (client certificate or bearer token), one context."""
    if (client is None) == (token is None):
        raise ValueError("a kubeconfig user needs exactly one of a client certificate or a token")
    credentials: dict[str, str]
    if client is not None:
        credentials = {
            "client-certificate-data": _b64(client.cert_pem),
            "client-key-data": _b64(client.key_pem),
        }
    else:
        credentials = {"token": token or ""}
    context = f"{user}@{cluster_name}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster_name,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": context, "context": {"cluster": cluster_name, "user": user}}],
        "current-context": context,
        "preferences": {},
    }


def api_client(path: Path) -> k8s.ApiClient:
    """A Kubernetes API client acting as the kubeconfig's user."""
    configuration = k8s.Configuration()
    # The kubeconfig loader has no type annotations.
    k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(path), client_configuration=configuration
    )
    return k8s.ApiClient(configuration=configuration)


def plain(api: k8s.ApiClient, obj: object) -> dict[str, Any]:
    """An API object (a client model or a custom object) as the plain dict the API server sends."""
    # The client's serializer has no type annotations; for any model or mapping it returns a dict.
    found = api.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
    if not isinstance(found, dict):
        raise TypeError(f"{type(obj).__name__} does not serialize to an object")
    return found


def write(path: Path, config: dict[str, Any]) -> Path:
    """Write a kubeconfig readable only by its owner (it holds a private key or a token)."""
    write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
    return path
