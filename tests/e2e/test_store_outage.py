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
from preshard_devenv import workloads
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from preshard_devenv.s3server import S3Bucket, create_bucket, start_s3_server
from preshard_devenv.tinymodel import TinyModel
from tests.e2e.engine import EngineControl
from tests.support import shardedmodels as shm
from tests.support import specs, timings
from tests.support.cluster import RUNNER_NODE, job_finished, job_named, job_outcome, pods
from tests.support.models import upload_model
from tests.support.serving import INIT_CONTAINER, container_flags, serving_pod

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
def private_store(private_bucket: S3Bucket) -> Iterator[specs.Store]:
    """The private server as a store; it is running again after each test."""
    store = specs.Store(
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
def outage_workspace(kube_api: k8s.ApiClient, namespace: str, private_store: specs.Store) -> str:
    """A namespace with the credentials of the private server."""
    specs.create_credentials(kube_api, namespace, private_store.server)
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
    private_store: specs.Store,
    private_bucket: S3Bucket,
    engine_switchboard: EngineControl,
    cordon: Any,
) -> None:
    namespace = outage_workspace
    original = specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    body = specs.spec(
        private_store, f"cut-{secrets.token_hex(3)}", serialization={"backoffLimit": 0}
    )
    engine_switchboard.hold()
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    wait_for(engine_switchboard.engine_waiting, what="the model to be downloaded")

    cordon(True)
    with timings.stopwatch("S3 server stop"):
        private_store.server.stop()
    engine_switchboard.release()
    started = time.monotonic()

    def cut_off() -> dict[str, Any] | None:
        resource = shm.get(kube_api, namespace, "llama")
        entry = shm.only_set(resource)
        return entry if entry.get("serializeRun") == 2 else None

    wait_for(cut_off, what="the cut-off upload to fail and a second run to be planned")
    failed = job_named(kube_api, namespace, "-serialize-1")
    assert job_finished(failed) == "Failed"
    _, outcome = job_outcome(kube_api, namespace, failed["metadata"]["name"])
    assert outcome.reason == reasons.UNREACHABLE
    timings.record("S3 server stopped during upload -> Unreachable", time.monotonic() - started)
    assert (
        shm.read_deployment(kube_api, namespace, "vllm")["spec"]["template"]
        == (original["spec"]["template"])
    )

    with timings.stopwatch("S3 server restart"):
        private_store.server.restart()
    entry = shm.only_set(shm.get(kube_api, namespace, "llama"))
    assert "manifest.json" not in set_objects(private_bucket, entry)
    started = time.monotonic()
    cordon(False)
    resource = shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    timings.record("S3 server back -> second serialization -> Ready", time.monotonic() - started)
    entry = shm.only_set(resource)
    assert (entry["serializeRun"], entry["stage"]) == (2, "Verified")
    assert "manifest.json" in set_objects(private_bucket, entry)
    shm.forbid_tracebacks(operator)


def init_restarts(pod: Any) -> int:
    """How often a pod's fetch-config init container has been restarted."""
    for status in pod.status.init_container_statuses or []:
        if status.name == INIT_CONTAINER:
            return int(status.restart_count)
    return 0


def test_the_store_down_while_a_set_is_verified_and_loaded(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    outage_workspace: str,
    private_store: specs.Store,
) -> None:
    namespace = outage_workspace
    specs.create_vllm_deployment(kube_api, namespace)
    body = specs.spec(
        private_store, f"down-{secrets.token_hex(3)}", verification={"intervalSeconds": 3}
    )
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    serving = wait_for(
        lambda: serving_pod(kube_api, namespace, "vllm"), what="the patched pod to serve"
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
    timings.record(
        "S3 server stopping -> periodic verify reports Unreachable", time.monotonic() - started
    )
    assert (workloads.condition(resource, "Verified") or {})["status"] == "True", "the set is whole"

    def failing_init() -> Any | None:
        for pod in pods(kube_api, namespace, "app=vllm"):
            if pod.metadata.name != serving.metadata.name and init_restarts(pod) >= 1:
                return pod
        return None

    restarting = wait_for(failing_init, what="fetch-config to fail and be restarted")
    assert restarting.status.phase == "Pending"
    still_serving = serving_pod(kube_api, namespace, "vllm")
    assert still_serving is not None
    assert still_serving.metadata.name == serving.metadata.name, "the old pod keeps serving"
    # The restarted template is not rolled out, and its pod's fetch-config fails: the target
    # is unavailable (`Ready` False), in the init container's words.
    unavailable = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_UNAVAILABLE
    )
    (target,) = unavailable["status"]["targets"]
    assert f"container {INIT_CONTAINER}" in target["message"], target["message"]

    started = time.monotonic()
    private_store.server.restart()
    shm.wait_condition(kube_api, namespace, "llama", "Degraded", "False", operator=operator)

    def new_pod_serving() -> Any | None:
        pod = serving_pod(kube_api, namespace, "vllm")
        return pod if pod is not None and pod.metadata.name == restarting.metadata.name else None

    wait_for(new_pod_serving, what="the restarted pod to fetch its config and serve")
    timings.record(
        "S3 server restarting -> verified again and the new pod serving", time.monotonic() - started
    )
    shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    current = shm.read_deployment(kube_api, namespace, "vllm")
    assert container_flags(current) == container_flags(patched)
    shm.forbid_tracebacks(operator)
