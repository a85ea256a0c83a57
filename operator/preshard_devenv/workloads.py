"""What the tests, the benchmarks and the local examples put into a cluster, as users write it:
vLLM Deployments and ShardedModels, as manifests and created through the API server.

There is one builder per object: whoever needs a vLLM Deployment starts from `vllm_deployment`
(and `vllm_container`) and says through their parameters how theirs differs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypedDict, Unpack

from kubernetes import client as k8s

from preshard.api import models
from preshard_devenv.kubeconfig import plain

Manifest = dict[str, Any]

VLLM_IMAGE: Final = "vllm/vllm-openai:v0.34.0"
MODEL_ID: Final = "org/model"
VLLM_PORT: Final = 8000


def vllm_container(
    model: str = MODEL_ID,
    *,
    image: str = VLLM_IMAGE,
    command: Sequence[str] | None = ("vllm", "serve"),
    port: int | None = VLLM_PORT,
    extra_args: Sequence[str] = (),
    **fields: Any,
) -> Manifest:
    """A vLLM server container as people write it: `vllm serve <model> --port <port>` on one
    GPU.

    `command=None` leaves the image's entrypoint to take the args, `port=None` leaves vLLM's
    default port; `fields` adds or replaces any other field of the container (`resources`,
    `env`, `readinessProbe`, even `args`).
    """
    container: Manifest = {"name": "vllm", "image": image}
    if command is not None:
        container["command"] = list(command)
    container["args"] = [model, *(["--port", str(port)] if port is not None else []), *extra_args]
    container.update(copy.deepcopy(fields))
    container.setdefault("resources", {"limits": {"nvidia.com/gpu": "1"}})
    return container


class DeploymentShape(TypedDict, total=False):
    """How a vLLM Deployment differs from the plain one (see `vllm_deployment`); None is the
    plain one's."""

    container: Manifest | None
    labels: Mapping[str, str] | None
    replicas: int
    pod_spec: Mapping[str, Any] | None
    pod_annotations: Mapping[str, str] | None
    progress_deadline: int | None


def vllm_deployment(
    name: str = "vllm", *, namespace: str | None = None, **shape: Unpack[DeploymentShape]
) -> Manifest:
    """A Deployment of one vLLM container (`vllm_container()` unless `container`), one replica
    unless `replicas`, whose pods carry the label `app: <name>` it selects them by.

    `labels` go on the Deployment beside `app`; `pod_spec` adds to (or replaces, `containers`
    too) the fields of the pod template's spec, such as the placement on a test node;
    `pod_annotations` annotate the pod template; `progress_deadline` is the rollout's
    `progressDeadlineSeconds`.
    """
    selector = {"app": name}
    metadata: Manifest = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    metadata["labels"] = {**selector, **(shape.get("labels") or {})}
    template: Manifest = {"labels": dict(selector)}
    annotations = shape.get("pod_annotations")
    if annotations is not None:
        template["annotations"] = dict(annotations)
    container = shape.get("container") or vllm_container()
    spec: Manifest = {
        "replicas": shape.get("replicas", 1),
        "selector": {"matchLabels": selector},
        "template": {
            "metadata": template,
            "spec": {"containers": [copy.deepcopy(container)], **(shape.get("pod_spec") or {})},
        },
    }
    deadline = shape.get("progress_deadline")
    if deadline is not None:
        spec["progressDeadlineSeconds"] = deadline
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": spec}


def create_deployment(
    api: k8s.ApiClient,
    namespace: str,
    name: str = "vllm",
    *,
    field_manager: str | None = None,
    **shape: Unpack[DeploymentShape],
) -> Manifest:
    """Create a `vllm_deployment` (its pods go to the kwok GPU nodes unless `pod_spec` places
    them); returns it as the API server stored it."""
    body = k8s.V1Deployment.model_validate(vllm_deployment(name, namespace=namespace, **shape))
    created = k8s.AppsV1Api(api).create_namespaced_deployment(
        namespace, body, field_manager=field_manager
    )
    return plain(api, created)


def sharded_model(name: str, spec: Manifest, *, namespace: str | None = None) -> Manifest:
    """A whole ShardedModel object."""
    metadata: Manifest = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": f"{models.GROUP}/{models.VERSION}",
        "kind": models.KIND,
        "metadata": metadata,
        "spec": spec,
    }


def create_sharded_model(api: k8s.ApiClient, namespace: str, name: str, spec: Manifest) -> Manifest:
    """Create a ShardedModel; returns it as the API server stored it."""
    created = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        models.GROUP,
        models.VERSION,
        namespace,
        models.PLURAL,
        sharded_model(name, spec, namespace=namespace),
    )
    return plain(api, created)


def condition(resource: Manifest, type_: str) -> Manifest | None:
    """One condition of a ShardedModel's status."""
    for item in (resource.get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            found: Manifest = item
            return found
    return None
