"""Scanning for secrets: every way a secret could be spelled, and every text a reader of a
namespace or of the pods' output could see."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from typing import Any, cast

from kubernetes import client as k8s

from preshard.api import models
from preshard_devenv.kubeconfig import plain
from preshard_devenv.podrunner import PodRunner

Manifest = dict[str, Any]


def encodings(secret: bytes | str) -> list[str]:
    """The ways a secret could be spelled in text: as is, inside a JSON string, base64, urlsafe
    base64, hex."""
    raw = secret.encode() if isinstance(secret, str) else secret
    spelled = {
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
    }
    if isinstance(secret, str):
        spelled.add(secret)
        spelled.add(json.dumps(secret)[1:-1])
    return sorted(s for s in spelled if len(s) >= 8)


def leaks(texts: Mapping[str, str], secrets: Mapping[str, bytes | str]) -> list[str]:
    """`<where>: <which secret>` for every text that holds one of the secrets."""
    found = []
    for where, text in texts.items():
        for which, secret in secrets.items():
            if any(spelled in text for spelled in encodings(secret)):
                found.append(f"{where}: {which}")
    return found


def api_objects(api: k8s.ApiClient, namespace: str) -> dict[str, str]:
    """Everything the API server holds in a namespace that a reader of it could see, as JSON
    text by object: ShardedModels (spec, status, annotations), Jobs, pods, Deployments,
    ReplicaSets and events. Secrets themselves are left out."""
    core, apps, batch = k8s.CoreV1Api(api), k8s.AppsV1Api(api), k8s.BatchV1Api(api)
    custom = k8s.CustomObjectsApi(api)
    texts: dict[str, str] = {}
    listed: dict[str, Iterable[Any]] = {
        "pod": core.list_namespaced_pod(namespace).items,
        "event": core.list_namespaced_event(namespace).items,
        "job": batch.list_namespaced_job(namespace).items,
        "deployment": apps.list_namespaced_deployment(namespace).items,
        "replicaset": apps.list_namespaced_replica_set(namespace).items,
    }
    for kind, items in listed.items():
        for item in items:
            found = plain(api, item)
            texts[f"{kind}/{found['metadata']['name']}"] = json.dumps(found)
    resources = cast(
        Manifest,
        custom.list_namespaced_custom_object(
            models.GROUP, models.VERSION, namespace, models.PLURAL
        ),
    )
    for item in resources["items"]:
        texts[f"shardedmodel/{item['metadata']['name']}"] = json.dumps(item)
    return texts


def runner_logs(runner: PodRunner, namespace: str) -> dict[str, str]:
    """Every container log the runner kept for a namespace's pods, by pod and container."""
    return {
        f"log {path.parent.parent.name}/{path.stem}": path.read_text(errors="replace")
        for path in sorted((runner.work_dir / namespace).glob("*/logs/*.log"))
    }
