"""The S3 server goes away and comes back: during an upload, during verification, during
`fetch-config`. Nothing incomplete is ever committed or loaded, and everything recovers.

These tests stop a server of their own (the session's stays up for every other test). The
runner node is cordoned where a test must keep the next serialization from starting before the
server is back, as an operator of a real cluster might.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any, Final

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv.s3server import start_s3_server
from tests.e2e import support
from tests.e2e.engine import EngineControl
from tests.support import shardedmodels as shm
from tests.support.cluster import RUNNER_NODE
from tests.support.models import TinyModel, upload_model
from tests.support.operator import OperatorProcess
from tests.support.s3 import S3Bucket, create_bucket

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

BUCKET: Final = "outage"


@pytest.fixture(scope="module")
def private_bucket(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: TinyModel
) -> Iterator[S3Bucket]:
    """An S3 server these tests may stop, with a bucket and the tiny model in it."""
    server = start_s3_server(tmp_path_factory.mktemp("outage-s3"))
    try:
        bucket = create_bucket(server, BUCKET)
        upload_model(tiny_model, bucket.client, bucket.name, "models/tiny")
        yield bucket
    finally:
        server.stop()


@pytest.fixture
def private_store(private_bucket: S3Bucket) -> Iterator[support.Store]:
    """The private server as a store; it is running again after each test."""
    store = support.Store(
        server=private_bucket.server,
        bucket=private_bucket.name,
        model_uri=f"s3://{private_bucket.name}/models/tiny/",
    )
    try:
        yield store
    finally:
        if not store.server.process.alive():
            store.server.restart()


@pytest.fixture
def outage_workspace(kube_api: k8s.ApiClient, namespace: str, private_store: support.Store) -> str:
    """A namespace with the credentials of the private server."""
    support.create_credentials(kube_api, namespace, private_store.server)
    return namespace


@pytest.fixture
def cordon(kube_api: k8s.ApiClient) -> Iterator[Any]:
    """Marks the runner node unschedulable on request; always schedulable again afterwards."""
    core = k8s.CoreV1Api(kube_api)

    def set_unschedulable(value: bool) -> None:
        core.patch_node(RUNNER_NODE, {"spec": {"unschedulable": value}})

    try:
        yield set_unschedulable
    finally:
        set_unschedulable(False)


def set_objects(bucket: S3Bucket, entry: dict[str, Any]) -> list[str]:
    """The object names under one shard set's prefix."""
    prefix = entry["uri"].split("/", 3)[3]
    return sorted(key[len(prefix) :] for key in bucket.keys(prefix))


def test_the_store_cut_off_during_upload(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    outage_workspace: str,
    private_store: support.Store,
    private_bucket: S3Bucket,
    engine_switchboard: EngineControl,
    cordon: Any,
) -> None:
    namespace = outage_workspace
    original = support.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    body = support.spec(
        private_store, f"cut-{secrets.token_hex(3)}", serialization={"backoffLimit": 0}
    )
    engine_switchboard.hold()
    shm.create(kube_api, namespace, "llama", body)
    support.until(engine_switchboard.engine_waiting, "the model to be downloaded")

    cordon(True)
    with support.stopwatch("S3 server stop"):
        private_store.server.stop()
    engine_switchboard.release()
    started = time.monotonic()

    def cut_off() -> dict[str, Any] | None:
        resource = shm.get(kube_api, namespace, "llama")
        entry = support.only_set(resource)
        return entry if entry.get("serializeRun") == 2 else None

    support.until(cut_off, "the cut-off upload to fail and a second run to be planned")
    failed = support.job_named(kube_api, namespace, "-serialize-1")
    assert support.job_finished(failed) == "Failed"
    _, outcome = support.job_outcome(kube_api, namespace, failed["metadata"]["name"])
    assert outcome.reason == reasons.UNREACHABLE
    support.record("S3 server stopped during upload -> Unreachable", time.monotonic() - started)
    assert (
        shm.read_deployment(kube_api, namespace, "vllm")["spec"]["template"]
        == (original["spec"]["template"])
    )

    with support.stopwatch("S3 server restart"):
        private_store.server.restart()
    entry = support.only_set(shm.get(kube_api, namespace, "llama"))
    assert "manifest.json" not in set_objects(private_bucket, entry)
    started = time.monotonic()
    cordon(False)
    resource = shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    support.record("S3 server back -> second serialization -> Ready", time.monotonic() - started)
    entry = support.only_set(resource)
    assert (entry["serializeRun"], entry["stage"]) == (2, "Verified")
    assert "manifest.json" in set_objects(private_bucket, entry)
    support.forbid_tracebacks(operator)


def init_restarts(pod: Any) -> int:
    """How often a pod's fetch-config init container has been restarted."""
    for status in pod.status.init_container_statuses or []:
        if status.name == support.INIT_CONTAINER:
            return int(status.restart_count)
    return 0


def test_the_store_down_while_a_set_is_verified_and_loaded(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    outage_workspace: str,
    private_store: support.Store,
) -> None:
    namespace = outage_workspace
    support.create_vllm_deployment(kube_api, namespace)
    body = support.spec(
        private_store, f"down-{secrets.token_hex(3)}", verification={"intervalSeconds": 3}
    )
    shm.create(kube_api, namespace, "llama", body)
    shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    serving = support.until(
        lambda: support.serving_pod(kube_api, namespace, "vllm"), "the patched pod to serve"
    )
    patched = shm.read_deployment(kube_api, namespace, "vllm")

    started = time.monotonic()
    private_store.server.stop()
    k8s.AppsV1Api(kube_api).patch_namespaced_deployment(
        "vllm",
        namespace,
        {"spec": {"template": {"metadata": {"annotations": {"e2e/restarted": str(started)}}}}},
    )
    resource = shm.wait_condition(
        kube_api, namespace, "llama", "Degraded", "True", reasons.UNREACHABLE, operator=operator
    )
    support.record(
        "S3 server stopping -> periodic verify reports Unreachable", time.monotonic() - started
    )
    assert (shm.condition(resource, "Verified") or {})["status"] == "True", "the set is whole"

    def failing_init() -> Any | None:
        for pod in support.pods(kube_api, namespace, "app=vllm"):
            if pod.metadata.name != serving.metadata.name and init_restarts(pod) >= 1:
                return pod
        return None

    restarting = support.until(failing_init, "fetch-config to fail and be restarted")
    assert restarting.status.phase == "Pending"
    still_serving = support.serving_pod(kube_api, namespace, "vllm")
    assert still_serving is not None
    assert still_serving.metadata.name == serving.metadata.name, "the old pod keeps serving"
    # The restarted template is not rolled out, and its pod's fetch-config fails: the target
    # is unavailable (`Ready` False), in the init container's words.
    unavailable = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_UNAVAILABLE
    )
    (target,) = unavailable["status"]["targets"]
    assert f"container {support.INIT_CONTAINER}" in target["message"], target["message"]

    started = time.monotonic()
    private_store.server.restart()
    shm.wait_condition(kube_api, namespace, "llama", "Degraded", "False", operator=operator)

    def new_pod_serving() -> Any | None:
        pod = support.serving_pod(kube_api, namespace, "vllm")
        return pod if pod is not None and pod.metadata.name == restarting.metadata.name else None

    support.until(new_pod_serving, "the restarted pod to fetch its config and serve")
    support.record(
        "S3 server restarting -> verified again and the new pod serving", time.monotonic() - started
    )
    shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    current = shm.read_deployment(kube_api, namespace, "vllm")
    assert support.container_flags(current) == support.container_flags(patched)
    support.forbid_tracebacks(operator)
