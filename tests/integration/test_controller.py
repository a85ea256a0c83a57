"""The controller against the real control plane: from `kubectl apply` to patched Deployments.

Jobs placed on `kwok-manual-0` stay Running until the test writes their pod's terminal status
and termination message, as the data plane would; Jobs on the `kwok-gpu-*` nodes are completed
by kwok with a success message.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard.contract.outcome import Outcome
from preshard_devenv import binaries, workloads
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.cluster import (
    MISSING,
    RESHARDED,
    SERIALIZED,
    finish_job,
    job_named,
    verified,
)
from tests.support.specs import kwok_spec, placement

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]


def manual_spec(**changes: Any) -> dict[str, Any]:
    """Every Job of this ShardedModel lands on the manual node, where the test finishes it."""
    manual = placement("manual")
    return kwok_spec(serialization=manual, verification=manual, **changes)


def test_lifecycle_probe_serialize_verify_patch(kube_api: k8s.ApiClient, namespace: str) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", manual_spec())

    probe = job_named(kube_api, namespace, "-verify-1")
    container = probe["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["verify", container["args"][1], "--tensor-parallel-size"]
    assert probe["metadata"]["ownerReferences"][0]["kind"] == "ShardedModel"
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "False", reasons.PROBING)
    finish_job(kube_api, namespace, probe, MISSING)

    serialize = job_named(kube_api, namespace, "-serialize-1")
    pod_spec = serialize["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert serialize["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"
    assert pod_spec["volumes"][0]["emptyDir"] == {"sizeLimit": "200Gi"}
    shm.wait_condition(kube_api, namespace, "llama", "Serialized", "False", reasons.SERIALIZING)
    finish_job(
        kube_api,
        namespace,
        serialize,
        Outcome(command="serialize", ok=True, reason=reasons.SERIALIZED, total_bytes=42),
    )

    verify = job_named(kube_api, namespace, "-verify-2")
    finish_job(
        kube_api,
        namespace,
        verify,
        Outcome(
            command="verify",
            ok=True,
            reason=reasons.VERIFIED,
            tensor_parallel_size=2,
            total_bytes=42,
            files=4,
            vllm_version="0.34.0",
            tensorizer_version="2.10.1",
        ),
    )
    resource = shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    (entry,) = resource["status"]["shardSets"]
    assert (entry["stage"], entry["totalBytes"], entry["vllmVersion"]) == ("Verified", 42, "0.34.0")
    assert resource["status"]["observedGeneration"] == 1
    # Only the finalizer of kopf's own bookkeeping is written (no record of the handled spec).
    assert resource["metadata"]["finalizers"] == ["preshard.dev/cleanup"]
    assert not any(
        key.startswith("preshard.dev/") for key in resource["metadata"].get("annotations") or {}
    )

    deployment = shm.read_deployment(kube_api, namespace, "vllm")
    args = shm.vllm_args(deployment)
    assert shm.flag(args, "--tensor-parallel-size") == "2"
    assert shm.flag(args, "--load-format") == "tensorizer"
    assert shm.flag(args, "--served-model-name") == "org/model"
    extra = json.loads(shm.flag(args, "--model-loader-extra-config") or "{}")
    assert extra["tensorizer_uri"] == f"{entry['uri']}model-rank-%03d.tensors"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["args"][:2] == ["fetch-config", entry["uri"]]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert deployment["spec"]["replicas"] == 1


def test_hand_edits_are_reasserted_and_deletion_restores(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    original = workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)

    args = shm.vllm_args(shm.read_deployment(kube_api, namespace, "vllm"))
    args[args.index("--tensor-parallel-size") + 1] = "8"
    args[args.index("--load-format") + 1] = "auto"
    k8s.AppsV1Api(kube_api).patch_namespaced_deployment(
        "vllm",
        namespace,
        {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": args}]}}}},
    )

    def reasserted() -> bool:
        current = shm.vllm_args(shm.read_deployment(kube_api, namespace, "vllm"))
        return (
            shm.flag(current, "--tensor-parallel-size") == "2"
            and shm.flag(current, "--load-format") == "tensorizer"
        )

    wait_for(reasserted, what="the hand edit to be re-asserted")

    shm.delete(kube_api, namespace, "llama")
    wait_for(lambda: shm.gone(kube_api, namespace, "llama"), what="deletion")
    restored = shm.read_deployment(kube_api, namespace, "vllm")
    assert (
        restored["spec"]["template"]["spec"]["containers"]
        == original["spec"]["template"]["spec"]["containers"]
    )
    assert "initContainers" not in restored["spec"]["template"]["spec"]
    assert not any(
        key.startswith("preshard.dev/") for key in restored["metadata"].get("annotations") or {}
    )


def test_changing_tp_switches_after_the_new_set_is_verified(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    ready = shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    (old,) = ready["status"]["shardSets"]

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

    def switched() -> dict[str, Any] | None:
        resource = shm.get(kube_api, namespace, "llama")
        sets = (resource.get("status") or {}).get("shardSets") or []
        args = shm.vllm_args(shm.read_deployment(kube_api, namespace, "vllm"))
        done = [s["tensorParallelSize"] for s in sets] == [4] and shm.flag(
            args, "--tensor-parallel-size"
        ) == "4"
        return resource if done else None

    resource = wait_for(switched, timeout=60, what="the switch to TP 4 and the old set's release")
    assert resource["status"]["shardSets"][0]["artifactKey"] != old["artifactKey"]
    assert resource["status"]["observedGeneration"] == 2
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)


def test_a_missing_target_is_picked_up_when_it_appears(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_NOT_FOUND)
    workloads.create_deployment(kube_api, namespace, "vllm")
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)


@pytest.mark.parametrize(
    ("changes", "container", "reason"),
    [
        ({"tensorParallelSizes": [16]}, None, reasons.TP_EXCEEDS_GPUS),
        (
            {"serialization": {"extraEngineArgs": {"load-format": "dummy"}}},
            None,
            reasons.INVALID_SPEC,
        ),
        (
            {},
            workloads.vllm_container(command=["/bin/sh", "-c"], args=["vllm serve x | tee log"]),
            reasons.UNSUPPORTED_COMMAND,
        ),
        ({"targets": [{"name": "vllm", "container": "nope"}]}, None, reasons.CONTAINER_NOT_FOUND),
    ],
)
def test_bad_input_becomes_a_condition_and_patches_nothing(
    kube_api: k8s.ApiClient,
    namespace: str,
    changes: dict[str, Any],
    container: dict[str, Any] | None,
    reason: str,
) -> None:
    original = workloads.create_deployment(kube_api, namespace, "vllm", container=container)
    workloads.create_sharded_model(kube_api, namespace, "bad", kwok_spec(**changes))
    shm.wait_condition(kube_api, namespace, "bad", "Ready", "False", reason)
    current = shm.read_deployment(kube_api, namespace, "vllm")
    assert current["spec"]["template"] == original["spec"]["template"]


def test_two_resources_cannot_own_one_deployment(kube_api: k8s.ApiClient, namespace: str) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "first", kwok_spec())
    shm.wait_condition(kube_api, namespace, "first", "Ready", "True", reasons.READY)
    workloads.create_sharded_model(
        kube_api, namespace, "second", kwok_spec(tensorParallelSizes=[4])
    )
    shm.wait_condition(kube_api, namespace, "second", "Ready", "False", reasons.TARGET_CONFLICT)
    args = shm.vllm_args(shm.read_deployment(kube_api, namespace, "vllm"))
    assert shm.flag(args, "--tensor-parallel-size") == "2"


@pytest.mark.parametrize(
    "status_lost", [False, True], ids=["killed", "killed-before-the-status-write"]
)
def test_restart_picks_up_a_running_job_without_a_second_one(
    kube_api: k8s.ApiClient, namespace: str, running_operator: OperatorProcess, status_lost: bool
) -> None:
    """SIGKILL while the serialize Job runs, and also in the instant between creating it and
    writing the status that names it (the status is put back as it was before that pass): the
    restarted operator takes the Job over, and no second one starts."""
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", manual_spec())
    probe = job_named(kube_api, namespace, "-verify-1")
    wait_for(
        lambda: (
            (shm.shard_set(kube_api, namespace, "llama", 2) or {}).get("job")
            == probe["metadata"]["name"]
        ),
        what="the status to name the probe",
    )
    before = shm.get(kube_api, namespace, "llama")["status"]
    finish_job(kube_api, namespace, probe, MISSING)
    job_named(kube_api, namespace, "-serialize-1")

    running_operator.kill()
    if status_lost:
        shm.replace_status(kube_api, namespace, "llama", before)
    running_operator.start()
    finish_job(kube_api, namespace, job_named(kube_api, namespace, "-serialize-1"), SERIALIZED)
    finish_job(kube_api, namespace, job_named(kube_api, namespace, "-verify-2"), verified(2))
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    names = [j["metadata"]["name"] for j in shm.jobs(kube_api, namespace)]
    assert sum(name.endswith("-serialize-1") for name in names) == 1
    assert not any("-serialize-2" in name for name in names)


def test_a_tp_size_added_while_the_first_set_is_verified_is_resharded_from_it(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    """`Serialized` turns True while the first set's verify Job runs. A TP size added then,
    whose probe ends first, waits for that check instead of starting a GPU Job; the status
    write of the verified set wakes it, and it reshards on CPU."""
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", manual_spec())
    finish_job(kube_api, namespace, job_named(kube_api, namespace, "-verify-1"), MISSING)
    finish_job(kube_api, namespace, job_named(kube_api, namespace, "-serialize-1"), SERIALIZED)
    check = job_named(kube_api, namespace, "-verify-2")
    shm.wait_condition(kube_api, namespace, "llama", "Serialized", "True", reasons.SERIALIZED)
    source = shm.artifact_key(kube_api, namespace, "llama", 2)

    shm.patch(kube_api, namespace, "llama", {"spec": {"tensorParallelSizes": [2, 4]}})
    key = shm.artifact_key(kube_api, namespace, "llama", 4)
    finish_job(kube_api, namespace, job_named(kube_api, namespace, f"{key[:8]}-verify-1"), MISSING)

    def waiting() -> dict[str, Any] | None:
        entry = shm.shard_set(kube_api, namespace, "llama", 4)
        return entry if entry and entry["reason"] == reasons.WAITING_FOR_SOURCE else None

    entry = wait_for(waiting, what="the TP 4 set to wait for the TP 2 set's verification")
    assert f"the TP 2 set {source}, being verified now" in entry["message"], entry
    wait_for(
        lambda: shm.events(kube_api, namespace, reasons.WAITING_FOR_SOURCE),
        what="the WaitingForSource event",
    )
    finish_job(kube_api, namespace, check, verified(2))
    reshard = job_named(kube_api, namespace, f"{key[:8]}-reshard-1")
    finish_job(kube_api, namespace, reshard, RESHARDED)
    finish_job(
        kube_api, namespace, job_named(kube_api, namespace, f"{key[:8]}-verify-2"), verified(4)
    )
    shm.wait_condition(kube_api, namespace, "llama", "Verified", "True", reasons.VERIFIED)
    assert (shm.shard_set(kube_api, namespace, "llama", 4) or {}).get("reshardedFrom") == source
    names = [j["metadata"]["name"] for j in shm.jobs(kube_api, namespace)]
    assert [n for n in names if "-serialize-" in n] == [f"llama-{source[:8]}-serialize-1"], names


def test_kubectl_shows_ready_reason_and_tp(
    cluster: LocalCluster, kube_api: k8s.ApiClient, namespace: str
) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    table = subprocess.run(
        [str(binaries.tool_path("kubectl")), "get", "shm", "-n", namespace, "-o", "wide"],
        env={**os.environ, "KUBECONFIG": str(cluster.admin_kubeconfig)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert table[0].split() == [
        "NAME",
        "READY",
        "REASON",
        "TP",
        "PROGRESS",
        "AGE",
        "STORAGE",
        "SHARD",
        "SETS",
    ]
    assert table[1].split()[:4] == ["llama", "True", "Ready", "[2]"]
