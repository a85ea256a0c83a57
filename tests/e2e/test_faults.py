"""Faults the whole flow must survive: nothing is lost, and the resource converges or says why.

The operator is the chart's, acting as its ServiceAccount. Serializations run for real on the
runner node (the engine can be held or made to fail through the test switchboard), except
where a test plays the kubelet itself on `kwok-manual-0` to write what only a real kubelet
does (an OOM kill, an eviction).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.nodes import TEST_NODE_LABEL
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.podrunner import PodRunner
from preshard_devenv.procs import wait_for
from preshard_devenv.s3server import S3Bucket
from tests.e2e.engine import EngineControl
from tests.e2e.writegate import WriteGate
from tests.support import shardedmodels as shm
from tests.support import specs, timings
from tests.support.cluster import (
    MANUAL_NODE,
    RUNNER_NODE,
    complete_pod,
    job_exists,
    job_finished,
    job_named,
    job_names,
    now,
    pods,
    read_job,
)
from tests.support.namespaces import Namespaces
from tests.support.serving import container_flags

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

SHARED: Final = "shards"
# ShardedModel name -> the serialize Job's backoff limit, in the OOM test.
OOM_CASES: Final = {"oom": 1, "evicted": 0}
RETRY: Final = "preshard.dev/retry"


def fresh_prefix() -> str:
    """A storage prefix no other test writes to."""
    return f"faults-{secrets.token_hex(4)}"


def template_of(api: k8s.ApiClient, namespace: str, name: str = "vllm") -> Any:
    """A Deployment's pod template."""
    return shm.read_deployment(api, namespace, name)["spec"]["template"]


def annotate(api: k8s.ApiClient, namespace: str, name: str, annotations: dict[str, Any]) -> None:
    """Merge annotations into a ShardedModel."""
    shm.patch(api, namespace, name, {"metadata": {"annotations": annotations}})


def set_keys(bucket: S3Bucket, entry: dict[str, Any]) -> list[str]:
    """The object names stored under one shard set's prefix."""
    prefix = entry["uri"].split("/", 3)[3]
    return sorted(key[len(prefix) :] for key in bucket.keys(prefix))


def serialize_jobs(api: k8s.ApiClient, namespace: str) -> list[str]:
    """The names of the namespace's serialize Jobs."""
    return [n for n in job_names(api, namespace) if "-serialize-" in n]


def newest_serialize_job(api: k8s.ApiClient, namespace: str, owner: str) -> str | None:
    """The name of one ShardedModel's newest serialize Job, if it has one."""
    names = [n for n in serialize_jobs(api, namespace) if n.startswith(f"{owner}-")]
    return max(names, key=lambda n: int(n.rsplit("-", 1)[1])) if names else None


@pytest.fixture(scope="module")
def shared_set(
    kube_api: k8s.ApiClient, operator: OperatorProcess, store: specs.Store
) -> Iterator[dict[str, Any]]:
    """The shard set under the shared prefix, made (or found) once for the module, and kept
    listed by a ShardedModel for as long as the module runs."""
    namespaces = Namespaces(kube_api, "faults")
    try:
        namespace = namespaces.create("shared")
        specs.create_credentials(kube_api, namespace, store.server)
        workloads.create_sharded_model(
            kube_api, namespace, "shared", specs.spec(store, SHARED, targets=())
        )
        yield shm.only_set(shm.wait_ready(kube_api, namespace, "shared", operator=operator))
    finally:
        namespaces.delete_all()


def copy_set(bucket: S3Bucket, entry: dict[str, Any], prefix: str) -> None:
    """Copy a complete shard set to `<prefix>/<key>/` inside the store, as a set made there."""
    source = entry["uri"].split("/", 3)[3]
    for key in bucket.keys(source):
        bucket.client.copy_object(
            Bucket=bucket.name,
            Key=f"{prefix}/{entry['artifactKey']}/{key[len(source) :]}",
            CopySource={"Bucket": bucket.name, "Key": key},
        )


def manual_pods(api: k8s.ApiClient, namespace: str, job: str) -> list[Any]:
    """The pods of a Job, oldest first."""
    return pods(api, namespace, f"job-name={job}")


def evict(api: k8s.ApiClient, pod: Any) -> None:
    """Write what the kubelet writes when it evicts a pod under node pressure."""
    stamp = now()
    message = "The node was low on resource: memory."
    body = {
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": message,
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": message,
                    "lastTransitionTime": stamp,
                },
                {"type": "Ready", "status": "False", "lastTransitionTime": stamp},
            ],
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image,
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": 137,
                            "reason": "Error",
                            "startedAt": stamp,
                            "finishedAt": stamp,
                        }
                    },
                }
                for container in pod.spec.containers
            ],
        }
    }
    k8s.CoreV1Api(api).patch_namespaced_pod_status(
        pod.metadata.name,
        pod.metadata.namespace,
        body,
        _content_type="application/merge-patch+json",
    )


def last_heartbeat(api: k8s.ApiClient, node: str) -> Any:
    """When a node's kubelet last reported (its Ready condition's heartbeat)."""
    status = k8s.CoreV1Api(api).read_node(node).status
    ready = next(c for c in (status.conditions if status else None) or [] if c.type == "Ready")
    return ready.last_heartbeat_time


def restart_apiserver_between_heartbeats(api: k8s.ApiClient, cluster: LocalCluster) -> None:
    """Restart kube-apiserver just after the runner node's heartbeat, so the restart is over
    before the next one: the pod runner's heartbeat thread does not survive a heartbeat that
    meets a stopped API server (see the expected failure below)."""
    seen = last_heartbeat(api, RUNNER_NODE)
    wait_for(
        lambda: last_heartbeat(api, RUNNER_NODE) != seen,
        what="the runner's next heartbeat",
        timeout=30,
    )
    with timings.stopwatch("kube-apiserver restart"):
        cluster.restart_apiserver()


def test_operator_killed_mid_serialization_picks_the_run_up(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    engine_switchboard: EngineControl,
) -> None:
    namespace = workspace
    engine_switchboard.hold()
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    workloads.create_sharded_model(kube_api, namespace, "llama", specs.spec(store, fresh_prefix()))
    job_named(kube_api, namespace, "-serialize-1")
    wait_for(engine_switchboard.engine_waiting, what="the serialize pod to reach the engine")
    before = shm.only_set(shm.get(kube_api, namespace, "llama"))

    assert operator.alive()
    operator.kill()
    started = time.monotonic()
    operator.start(timeout=60)
    engine_switchboard.release()
    resource = shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    timings.record(
        "operator SIGKILLed mid-serialization: restart -> Ready", time.monotonic() - started
    )

    entry = shm.only_set(resource)
    assert (before["stage"], before["serializeRun"]) == ("Serializing", 1)
    assert (entry["stage"], entry["serializeRun"], entry["verifyRun"]) == ("Verified", 1, 2)
    assert serialize_jobs(kube_api, namespace) == [before["job"]]
    assert job_finished(job_named(kube_api, namespace, "-serialize-1")) == ("Complete")
    shm.forbid_tracebacks(operator)


def test_a_failing_engine_is_retried_then_failed_and_the_retry_annotation_starts_over(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    s3_bucket: S3Bucket,
    engine_switchboard: EngineControl,
) -> None:
    namespace = workspace
    engine_switchboard.fail()
    original = specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    body = specs.spec(store, fresh_prefix(), serialization={"backoffLimit": 1})
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    started = time.monotonic()
    resource = shm.wait_condition(
        kube_api,
        namespace,
        "llama",
        "Ready",
        "False",
        reasons.SERIALIZATION_FAILED,
        operator=operator,
    )
    timings.record("engine failing twice (backoffLimit 1) -> Failed", time.monotonic() - started)

    entry = shm.only_set(resource)
    assert (entry["stage"], entry["serializeRun"]) == ("Failed", 1)
    job = job_named(kube_api, namespace, "-serialize-1")
    assert job_finished(job) == "Failed"
    codes = [
        p.status.container_statuses[0].state.terminated.exit_code
        for p in manual_pods(kube_api, namespace, job["metadata"]["name"])
    ]
    assert codes == [40, 40], "one retry within the Job's backoff, each SerializationFailed"
    assert set_keys(s3_bucket, entry) == [], "nothing stored, so no manifest of a partial set"
    assert template_of(kube_api, namespace) == original["spec"]["template"]

    engine_switchboard.heal()
    started = time.monotonic()
    annotate(kube_api, namespace, "llama", {RETRY: "1"})
    resource = shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    timings.record("retry annotation after a failure -> Ready", time.monotonic() - started)
    assert serialize_jobs(kube_api, namespace)[-1].endswith("-serialize-2")
    assert "manifest.json" in set_keys(s3_bucket, shm.only_set(resource))
    shm.forbid_tracebacks(operator)


def test_oom_kills_and_evictions_use_the_backoff_then_fail_with_the_reason(
    kube_api: k8s.ApiClient, operator: OperatorProcess, workspace: str, store: specs.Store
) -> None:
    """Two serializations on the manual node at once: `oom` is OOM-killed twice with one retry
    allowed; `evicted` is evicted and then OOM-killed with none allowed."""
    namespace = workspace
    original = specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    prefix = fresh_prefix()
    for name, retries in OOM_CASES.items():
        body = specs.spec(
            store,
            prefix,
            serialize_on="manual",
            serialization={"backoffLimit": retries},
            targets=[{"name": "vllm"}] if name == "oom" else [],
        )
        workloads.create_sharded_model(kube_api, namespace, name, body)

    def both_started() -> dict[str, str] | None:
        started: dict[str, str] = {}
        for owner in OOM_CASES:
            job = newest_serialize_job(kube_api, namespace, owner)
            if job is None:
                return None
            started[owner] = job
        return started

    jobs = wait_for(both_started, what="both serializations to start")
    started = time.monotonic()

    def pod_number(job: str, count: int) -> Any:
        def running() -> Any | None:
            found = manual_pods(kube_api, namespace, job)
            fresh = [p for p in found if p.status.phase == "Running"]
            return fresh[-1] if len(found) == count and fresh else None

        return wait_for(running, what=f"pod {count} of {job} to run on {MANUAL_NODE}")

    complete_pod(kube_api, pod_number(jobs["oom"], 1), 137, None, reason="OOMKilled")
    evict(kube_api, pod_number(jobs["evicted"], 1))
    complete_pod(kube_api, pod_number(jobs["evicted"], 2), 137, None, reason="OOMKilled")
    complete_pod(kube_api, pod_number(jobs["oom"], 2), 137, None, reason="OOMKilled")
    for name in jobs:
        resource = shm.wait_condition(
            kube_api, namespace, name, "Ready", "False", reasons.OOM_KILLED, operator=operator
        )
        assert "ran out of memory" in (workloads.condition(resource, "Ready") or {})["message"]
    timings.record("OOM kills and an eviction -> Failed (OOMKilled)", time.monotonic() - started)

    for name, failed in (("oom", 2), ("evicted", 1)):
        status = read_job(kube_api, namespace, jobs[name])["status"]
        assert len(manual_pods(kube_api, namespace, jobs[name])) == 2
        assert status["failed"] == failed, "an eviction does not count against the backoff"
        reasons_ = [c["reason"] for c in status["conditions"] if c["type"] == "Failed"]
        assert reasons_ == ["BackoffLimitExceeded"]
    assert template_of(kube_api, namespace) == original["spec"]["template"]

    annotate(kube_api, namespace, "oom", {RETRY: "after-oom"})
    shm.wait_condition(
        kube_api, namespace, "oom", "Serialized", "False", reasons.SERIALIZING, operator=operator
    )
    newest = newest_serialize_job(kube_api, namespace, "oom")
    assert newest is not None
    assert newest.endswith("-serialize-2")
    shm.forbid_tracebacks(operator)


def test_more_memory_after_an_oom_kill_starts_over(
    kube_api: k8s.ApiClient, operator: OperatorProcess, workspace: str, store: specs.Store
) -> None:
    namespace = workspace
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    body = specs.spec(
        store, fresh_prefix(), serialize_on="manual", serialization={"backoffLimit": 0}
    )
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    job = job_named(kube_api, namespace, "-serialize-1")["metadata"]["name"]
    pod = wait_for(
        lambda: next(iter(manual_pods(kube_api, namespace, job)), None), what=f"a pod of {job}"
    )
    complete_pod(kube_api, pod, 137, None, reason="OOMKilled")
    shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.OOM_KILLED, operator=operator
    )

    shm.patch(kube_api, namespace, "llama", {"spec": {"serialization": {"memory": "64Gi"}}})

    def planned_again() -> dict[str, Any] | None:
        resource = shm.get(kube_api, namespace, "llama")
        return resource if resource["status"].get("observedGeneration") == 2 else None

    entry = shm.only_set(wait_for(planned_again, what="the new generation to be planned"))
    assert entry["stage"] == "Serializing"


def test_a_rank_file_deleted_after_ready_is_detected_and_nothing_is_repointed(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    s3_bucket: S3Bucket,
    shared_set: dict[str, Any],
) -> None:
    namespace = workspace
    prefix = fresh_prefix()
    copy_set(s3_bucket, shared_set, prefix)
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    body = specs.spec(store, prefix, verification={"intervalSeconds": 3})
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    entry = shm.only_set(shm.wait_ready(kube_api, namespace, "llama", operator=operator))
    assert entry["reason"] == reasons.ALREADY_SERIALIZED
    patched = shm.read_deployment(kube_api, namespace, "vllm")

    rank = entry["uri"].split("/", 3)[3] + "model-rank-001.tensors"
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=rank)
    started = time.monotonic()
    resource = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.SHARD_MISSING, operator=operator
    )
    timings.record(
        "rank file deleted -> ShardMissing (verification every 3s)", time.monotonic() - started
    )

    degraded = workloads.condition(resource, "Degraded") or {}
    assert (degraded["status"], degraded["reason"]) == ("True", reasons.SHARD_MISSING)
    assert "model-rank-001.tensors" in degraded["message"]
    assert shm.only_set(resource)["stage"] == "Failed"
    current = shm.read_deployment(kube_api, namespace, "vllm")
    assert current["metadata"]["generation"] == patched["metadata"]["generation"]
    assert current["spec"]["template"] == patched["spec"]["template"]

    started = time.monotonic()
    annotate(kube_api, namespace, "llama", {RETRY: "rebuild"})
    resource = shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    timings.record("retry annotation -> set rebuilt and Ready", time.monotonic() - started)
    assert "model-rank-001.tensors" in set_keys(s3_bucket, shm.only_set(resource))
    degraded = workloads.condition(resource, "Degraded") or {}
    assert degraded["status"] == "False"
    shm.forbid_tracebacks(operator)


def test_the_target_deployment_deleted_recreated_and_edited_by_hand(
    kube_api: k8s.ApiClient, operator: OperatorProcess, workspace: str, store: specs.Store
) -> None:
    namespace = workspace
    apps = k8s.AppsV1Api(kube_api)
    original = specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    workloads.create_sharded_model(kube_api, namespace, "llama", specs.spec(store, SHARED))
    shm.wait_ready(kube_api, namespace, "llama", operator=operator)

    args = shm.vllm_args(shm.read_deployment(kube_api, namespace, "vllm"))
    args[args.index("--tensor-parallel-size") + 1] = "8"
    args[args.index("--load-format") + 1] = "safetensors"
    apps.patch_namespaced_deployment(
        "vllm",
        namespace,
        {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": args}]}}}},
    )
    started = time.monotonic()

    def reasserted() -> bool:
        tp, load_format, _ = container_flags(shm.read_deployment(kube_api, namespace, "vllm"))
        return (tp, load_format) == (2, "tensorizer")

    wait_for(reasserted, what="the TP and load format to be re-asserted")
    timings.record("hand edit of TP and load format -> re-asserted", time.monotonic() - started)

    apps.patch_namespaced_deployment(
        "vllm",
        namespace,
        {
            "spec": {
                "template": {
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.35.0"}]}
                }
            }
        },
    )

    def image_reported() -> dict[str, Any] | None:
        targets = (shm.get(kube_api, namespace, "llama").get("status") or {}).get("targets") or []
        return next((t for t in targets if t["reason"] == reasons.TARGET_IMAGE_CHANGED), None)

    reported = wait_for(image_reported, what="the image change to be reported")
    assert "v0.35.0" in reported["message"]
    # kopf posts events from a queue: the event may land after the status write it goes with.
    warnings = wait_for(
        lambda: shm.events(kube_api, namespace, reasons.TARGET_IMAGE_CHANGED),
        what="the TargetImageChanged event",
    )
    assert {event["type"] for event in warnings} == {"Warning"}
    image = template_of(kube_api, namespace)["spec"]["containers"][0]["image"]
    assert image == "vllm/vllm-openai:v0.35.0", "the image is the user's: reported, not reverted"

    apps.delete_namespaced_deployment("vllm", namespace)
    shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_NOT_FOUND, operator=operator
    )
    started = time.monotonic()
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    timings.record("target Deployment re-created -> patched and Ready", time.monotonic() - started)
    tp, load_format, _ = container_flags(shm.read_deployment(kube_api, namespace, "vllm"))
    assert (tp, load_format) == (2, "tensorizer")
    assert (
        original["metadata"]["uid"]
        != shm.read_deployment(kube_api, namespace, "vllm")["metadata"]["uid"]
    )
    shm.forbid_tracebacks(operator)


def test_conflicting_writes_are_retried_without_duplicates(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    tmp_path: Path,
) -> None:
    """The user edits the target between the operator's read of it and its patch: the patch,
    planned from the old generation, is refused, and the operator plans again from the new one.
    The operator's patch waits at a gate while the edits land, so the conflict happens on every
    run, however busy the machine is."""
    namespace = workspace
    apps = k8s.AppsV1Api(kube_api)
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    gate = WriteGate(tmp_path)
    edits = 3
    with gate.installed(operator):
        log_start = len(operator.log())
        gate.hold(namespace, "vllm")
        workloads.create_sharded_model(kube_api, namespace, "llama", specs.spec(store, SHARED))
        held = wait_for(
            lambda: gate.held(namespace, "vllm"),
            what="the operator's patch of the target",
            timeout=120,
        )
        generation = shm.read_deployment(kube_api, namespace, "vllm")["metadata"]["generation"]
        assert held[0] == {"op": "test", "path": "/metadata/generation", "value": generation}
        for edit in range(edits):
            # A change of the pod template moves the generation on, as any edit of the spec does.
            mark = {"annotations": {"e2e/edit": str(edit)}}
            apps.patch_namespaced_deployment(
                "vllm", namespace, {"metadata": mark, "spec": {"template": {"metadata": mark}}}
            )
        gate.release(namespace, "vllm")
        wait_for(
            lambda: "changed; retrying" in operator.log()[log_start:],
            what="the operator to meet the conflicting write",
        )
        started = time.monotonic()
        shm.wait_ready(kube_api, namespace, "llama", operator=operator)
        timings.record(
            f"conflicting write ({edits} edits while the patch was held) -> Ready",
            time.monotonic() - started,
        )
        names = job_names(kube_api, namespace)
        assert len(names) == len(set(names))
        assert not any(n.endswith("-serialize-2") or n.endswith("-verify-3") for n in names), names
        deployment = shm.read_deployment(kube_api, namespace, "vllm")
        last = str(edits - 1)
        annotations = deployment["metadata"]["annotations"]
        assert annotations["e2e/edit"] == last, "the user's edits are kept"
        template = deployment["spec"]["template"]["metadata"]["annotations"]
        assert template["e2e/edit"] == last, "the patch was planned again from the edited version"
        tp, load_format, _ = container_flags(deployment)
        assert (tp, load_format) == (2, "tensorizer")
        shm.forbid_tracebacks(operator)


def test_an_api_server_restart_mid_serialization_loses_nothing(
    kube_api: k8s.ApiClient,
    cluster: LocalCluster,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    engine_switchboard: EngineControl,
) -> None:
    namespace = workspace
    engine_switchboard.hold()
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    workloads.create_sharded_model(kube_api, namespace, "llama", specs.spec(store, fresh_prefix()))
    job_named(kube_api, namespace, "-serialize-1")
    wait_for(engine_switchboard.engine_waiting, what="the serialize pod to reach the engine")

    started = time.monotonic()
    restart_apiserver_between_heartbeats(kube_api, cluster)
    engine_switchboard.release()
    resource = shm.wait_ready(kube_api, namespace, "llama", operator=operator)
    timings.record("API server restarted mid-serialization -> Ready", time.monotonic() - started)
    entry = shm.only_set(resource)
    assert (entry["serializeRun"], entry["verifyRun"]) == (1, 2)
    assert len(serialize_jobs(kube_api, namespace)) == 1
    assert operator.alive()


def test_the_runner_heartbeat_outlives_an_api_server_restart(
    kube_api: k8s.ApiClient, cluster: LocalCluster, tmp_path: Path
) -> None:
    core = k8s.CoreV1Api(kube_api)
    node = f"e2e-heartbeat-{secrets.token_hex(3)}"
    taint = k8s.V1Taint(key=TEST_NODE_LABEL, value="heartbeat", effect="NoSchedule")
    core.create_node(
        k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node), spec=k8s.V1NodeSpec(taints=[taint]))
    )
    runner = PodRunner(cluster.admin_kubeconfig, tmp_path, node_name=node, heartbeat_seconds=0.2)
    try:
        runner.start()
        restart_apiserver_between_heartbeats(kube_api, cluster)
        restarted = last_heartbeat(kube_api, node)
        # A heartbeat thread that died on the stopped server never beats again; one that lives
        # beats as soon as the restarted server answers, which on a busy machine takes a while.
        wait_for(
            lambda: last_heartbeat(kube_api, node) != restarted,
            what="a heartbeat after the restart",
        )
    finally:
        runner.stop()
        core.delete_node(node)


def test_retention_delete_removes_a_set_whose_key_is_also_used_under_another_prefix(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    s3_bucket: S3Bucket,
    shared_set: dict[str, Any],
) -> None:
    prefix = fresh_prefix()
    copy_set(s3_bucket, shared_set, prefix)
    body = specs.spec(store, prefix, targets=(), storage={"retention": "Delete"})
    workloads.create_sharded_model(kube_api, workspace, "doomed", body)
    doomed = shm.only_set(shm.wait_ready(kube_api, workspace, "doomed", operator=operator))
    assert (doomed["artifactKey"], doomed["uri"]) != (shared_set["artifactKey"], shared_set["uri"])
    assert doomed["artifactKey"] == shared_set["artifactKey"]
    shm.delete(kube_api, workspace, "doomed")
    wait_for(lambda: shm.gone(kube_api, workspace, "doomed"), what="the deletion")
    assert set_keys(s3_bucket, doomed) == []


@pytest.mark.parametrize("retention", ["Delete", "Retain"])
def test_deleting_the_resource_while_its_job_runs(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    s3_bucket: S3Bucket,
    engine_switchboard: EngineControl,
    retention: str,
) -> None:
    namespace = workspace
    original = specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    # The TP 4 set must come from a serialize Job, not a reshard of the TP 2 one.
    gpu_only = {"reshard": False}
    if retention == "Delete":
        # A key no other ShardedModel lists (see the expected failure above).
        unique = {**gpu_only, "extraEngineArgs": {"seed": str(secrets.randbelow(10**9))}}
        body = specs.spec(
            store, fresh_prefix(), storage={"retention": "Delete"}, serialization=unique
        )
    else:
        body = specs.spec(store, SHARED, storage={"retention": "Retain"}, serialization=gpu_only)
    workloads.create_sharded_model(kube_api, namespace, "llama", body)
    served = shm.only_set(shm.wait_ready(kube_api, namespace, "llama", operator=operator))
    stored = set_keys(s3_bucket, served)
    assert "manifest.json" in stored

    engine_switchboard.hold()
    shm.patch(
        kube_api,
        namespace,
        "llama",
        {
            "spec": {
                "tensorParallelSizes": [4],
                "targets": [{"name": "vllm", "tensorParallelSize": 4}],
            }
        },
    )
    wait_for(engine_switchboard.engine_waiting, what="the TP 4 serialization to run")
    (running,) = [
        j["metadata"]["name"]
        for j in shm.jobs(kube_api, namespace)
        if "-serialize-" in j["metadata"]["name"] and not job_finished(j)
    ]
    started = time.monotonic()
    shm.delete(kube_api, namespace, "llama")
    wait_for(lambda: shm.gone(kube_api, namespace, "llama"), what="the finalizer to be released")
    timings.record(
        f"ShardedModel deleted mid-serialization ({retention}) -> gone", time.monotonic() - started
    )

    wait_for(
        lambda: not job_exists(kube_api, namespace, running), what=f"Job {running} to be removed"
    )
    restored = template_of(kube_api, namespace)
    assert restored == original["spec"]["template"]
    annotations = shm.read_deployment(kube_api, namespace, "vllm")["metadata"].get("annotations")
    assert not any(k.startswith("preshard.dev/") for k in annotations or {})
    if retention == "Delete":
        assert set_keys(s3_bucket, served) == []
    else:
        assert set_keys(s3_bucket, served) == stored
    shm.forbid_tracebacks(operator)


def test_a_terminating_namespace_is_no_reason_for_a_traceback(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    store: specs.Store,
    engine_switchboard: EngineControl,
) -> None:
    """While a namespace is deleted, the objects in it go in no fixed order: here its serialize
    Job goes first, and the operator, still reconciling, may not create it again."""
    core = k8s.CoreV1Api(kube_api)
    namespace = f"e2e-doomed-{secrets.token_hex(3)}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))
    specs.create_credentials(kube_api, namespace, store.server)
    engine_switchboard.hold()
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    workloads.create_sharded_model(kube_api, namespace, "llama", specs.spec(store, fresh_prefix()))
    job = job_named(kube_api, namespace, "-serialize-1")["metadata"]["name"]
    wait_for(engine_switchboard.engine_waiting, what="the serialize pod to reach the engine")
    log_start = len(operator.log())

    core.delete_namespace(namespace, propagation_policy="Background")
    k8s.BatchV1Api(kube_api).delete_namespaced_job(job, namespace, propagation_policy="Background")

    # The operator may log nothing at all: the ShardedModel can be gone before its reconciler
    # wakes, and its cleanup has nothing to restore.
    def reacted() -> bool:
        log = operator.log()[log_start:]
        return (
            shm.TRACEBACK in log
            or "is terminating" in log
            or shm.gone(kube_api, namespace, "llama")
        )

    wait_for(
        reacted,
        what="the operator to react to the vanished Job, or the namespace to go",
        timeout=90,
    )
    log = operator.log()[log_start:]
    assert operator.alive()
    assert shm.TRACEBACK not in log, log
