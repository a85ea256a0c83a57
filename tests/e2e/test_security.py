"""Secrets stay in their Secrets, and a ShardedModel reaches nothing outside its namespace.

The operator runs as the chart's ServiceAccount, whose RBAC has no access to Secrets at all
(`tests/helm/test_install.py::test_service_account_cannot` proves the API server refuses it
every Secret verb); here its log shows that it never even asked. It logs JSON here
(`config.logFormat: json`), so its Jobs and init containers do too, and the scan reads JSON
lines.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from kubernetes import client as k8s

from preshard.builders.jobs import CONTAINER
from preshard.builders.patching import INIT_CONTAINER
from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.kubeconfig import plain
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.podrunner import PodRunner
from preshard_devenv.procs import wait_for
from tests.e2e import engine
from tests.support import shardedmodels as shm
from tests.support import specs
from tests.support.chart import Release, chart_operator, forbidden_requests
from tests.support.cluster import job_finished, job_names, job_outcome, pods, read_job
from tests.support.leaks import api_objects, leaks, runner_logs
from tests.support.namespaces import Namespaces
from tests.support.serving import container_flags, serving_pod
from tests.support.tools import Tool, ToolError, kubectl_apply

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

HF_SECRET: Final = "hf-token"
KEY_SECRET: Final = "shard-key"
# The operator has no permission to watch CRDs; the framework logs that and carries on.
EXPECTED_FORBIDDEN: Final = ("customresourcedefinitions",)


@pytest.fixture(scope="module")
def operator(
    release: Release,
    cluster: LocalCluster,
    kube_api: k8s.ApiClient,
    runner_engine: engine.EngineControl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    """The installed operator, as the conftest's runs it, but logging JSON: the chart's
    `config.logFormat: json`, which the operator passes on to its Jobs and init containers."""
    work_dir = tmp_path_factory.mktemp("operator")
    kubeconfig = cluster.service_account_kubeconfig(
        release.namespace, release.service_account, path=work_dir / "operator.kubeconfig"
    )
    process = chart_operator(release.deployment(kube_api), kubeconfig, work_dir)
    process.extra_env["PRESHARD_LOG_FORMAT"] = "json"
    process.start(timeout=60)
    try:
        yield process
    finally:
        process.stop()


def preshard_logs(texts: dict[str, str]) -> dict[str, str]:
    """The logs of preshard's own containers: the Jobs' and the init containers'."""
    return {
        where: text
        for where, text in texts.items()
        if where.startswith("log ") and where.rsplit("/", 1)[-1] in (CONTAINER, INIT_CONTAINER)
    }


def json_lines(text: str) -> list[dict[str, Any]]:
    """The complete lines of a log, each parsed as a JSON object (a line that is not fails)."""
    parsed = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]
    assert all(isinstance(line, dict) for line in parsed), text
    return parsed


def secret_texts(api: k8s.ApiClient, namespace: str) -> dict[str, str]:
    """The namespace's Secrets as the API server returns them (base64 data)."""
    found = [
        plain(api, item) for item in k8s.CoreV1Api(api).list_namespaced_secret(namespace).items
    ]
    return {f"secret/{item['metadata']['name']}": json.dumps(item) for item in found}


def test_no_secret_value_appears_in_logs_args_status_events_or_annotations(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    pod_runner: PodRunner,
) -> None:
    namespace = workspace
    hf_token = "hf_" + secrets.token_urlsafe(24)
    key = secrets.token_bytes(32)
    specs.create_secret(kube_api, namespace, HF_SECRET, {"HF_TOKEN": hf_token.encode()})
    specs.create_secret(kube_api, namespace, KEY_SECRET, {"key": key})
    watched: dict[str, bytes | str] = {
        "S3 secret key": store.server.credentials.secret_access_key,
        "HF token": hf_token,
        "encryption key": key,
    }
    specs.create_vllm_deployment(kube_api, namespace)
    specs.create_vllm_deployment(kube_api, namespace, "gated", node_kind="auto")
    prefix = f"security-{secrets.token_hex(3)}"
    encrypted = specs.spec(
        store, prefix, encryption={"secretRef": {"name": KEY_SECRET, "key": "key"}}
    )
    gated = specs.spec(
        store, prefix, targets=[{"name": "gated"}], serialization={"backoffLimit": 0}
    )
    gated["model"] = {
        "id": "example-org/gated-model",
        "revision": "main",
        "tokenSecretRef": {"name": HF_SECRET},
    }
    workloads.create_sharded_model(kube_api, namespace, "encrypted", encrypted)
    workloads.create_sharded_model(kube_api, namespace, "gated", gated)

    shm.wait_ready(kube_api, namespace, "encrypted", operator=operator)
    wait_for(
        lambda: serving_pod(kube_api, namespace, "vllm"), what="the encrypted set to be served"
    )

    def gated_serialization() -> str | None:
        names = job_names(kube_api, namespace)
        return next((n for n in names if n.startswith("gated-") and "-serialize-" in n), None)

    first = wait_for(gated_serialization, what="the gated model's serialization to start")
    wait_for(
        lambda: job_finished(read_job(kube_api, namespace, first)) == "Failed",
        what="the gated model's serialization to fail (the Hub is out of reach)",
    )
    _, outcome = job_outcome(kube_api, namespace, first)
    assert outcome.reason == reasons.UNREACHABLE, outcome
    (pod,) = pods(kube_api, namespace, f"job-name={first}")
    env = {e.name: e for e in pod.spec.containers[0].env}
    assert env["HF_TOKEN"].value_from.secret_key_ref.name == HF_SECRET, "the token went in"

    texts = {
        **api_objects(kube_api, namespace),
        **runner_logs(pod_runner, namespace),
        "operator log": operator.log(),
    }
    assert any("serialize" in where and where.startswith("log ") for where in texts)
    # Every line preshard's containers wrote is JSON: the log lines (stderr) and the outcome
    # (stdout), nothing else; the serialize Jobs and the init container did log.
    logs = {where: json_lines(text) for where, text in preshard_logs(texts).items()}
    logged = [where for where, lines in logs.items() if any("level" in line for line in lines)]
    assert any("-serialize-" in where for where in logged), sorted(logs)
    assert any(where.endswith(f"/{INIT_CONTAINER}") for where in logged), sorted(logs)
    assert any(line.startswith("{") for line in operator.log().splitlines()), "no JSON log"
    assert leaks(texts, watched) == []
    # The scan finds each secret where it does belong: the test's own Secrets.
    found = leaks(secret_texts(kube_api, namespace), watched)
    assert sorted(found) == sorted(
        [
            f"secret/{specs.CREDENTIALS}: S3 secret key",
            f"secret/{HF_SECRET}: HF token",
            f"secret/{KEY_SECRET}: encryption key",
        ]
    )
    assert forbidden_requests(operator.log(), *EXPECTED_FORBIDDEN) == []
    shm.forbid_tracebacks(operator)


@pytest.fixture
def neighbour(kube_api: k8s.ApiClient) -> Any:
    """Another namespace with a same-named Deployment and Secrets of its own."""
    namespaces = Namespaces(kube_api, "neighbour")
    try:
        yield namespaces.create("other")
    finally:
        namespaces.delete_all()


def test_nothing_in_another_namespace_can_be_targeted_or_referenced(
    kube_api: k8s.ApiClient,
    admin_kubectl: Tool,
    operator: OperatorProcess,
    workspace: str,
    neighbour: str,
    store: specs.Store,
    tmp_path: Path,
) -> None:
    namespace = workspace
    theirs = specs.create_vllm_deployment(kube_api, neighbour, node_kind="auto")
    specs.create_credentials(kube_api, neighbour, store.server)

    attempts: dict[str, dict[str, Any]] = {
        "spec.targets[0].name": {"targets": [{"name": f"{neighbour}/vllm"}]},
        "spec.storage.credentialsSecretRef.name": {
            "storage": store.storage("shards", credentialsSecretRef={"name": f"{neighbour}/s3"})
        },
        "spec.encryption.secretRef.name": {
            "encryption": {"secretRef": {"name": f"{neighbour}/key", "key": "key"}}
        },
        'unknown field "spec.targets[0].namespace"': {
            "targets": [{"name": "vllm", "namespace": neighbour}]
        },
        'unknown field "spec.storage.credentialsSecretRef.namespace"': {
            "storage": store.storage(
                "shards", credentialsSecretRef={"name": "s3", "namespace": neighbour}
            )
        },
    }
    for field, change in attempts.items():
        body = workloads.sharded_model(
            "reach", {**specs.spec(store, "shards"), **change}, namespace=namespace
        )
        with pytest.raises(ToolError) as refused:
            kubectl_apply(admin_kubectl, body, tmp_path)
        assert field in str(refused.value), str(refused.value)
        assert shm.gone(kube_api, namespace, "reach")

    workloads.create_sharded_model(kube_api, namespace, "reach", specs.spec(store, "shards"))
    shm.wait_condition(
        kube_api, namespace, "reach", "Ready", "False", reasons.TARGET_NOT_FOUND, operator=operator
    )
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    shm.wait_ready(kube_api, namespace, "reach", operator=operator)
    ours = shm.read_deployment(kube_api, namespace, "vllm")
    assert container_flags(ours)[1] == "tensorizer"
    after = shm.read_deployment(kube_api, neighbour, "vllm")
    assert after["metadata"]["generation"] == theirs["metadata"]["generation"]
    assert after["spec"]["template"] == theirs["spec"]["template"]
    assert not [k for k in after["metadata"].get("annotations") or {} if k.startswith("preshard")]
    assert job_names(kube_api, neighbour) == []
