"""The user's Deployment on the real API server: what the patch replaces is reported, a restore
keeps the user's edits, and a Deployment another controller owns is left alone."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.kubeconfig import plain
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.specs import kwok_spec

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

CONTAINER = workloads.vllm_container(extra_args=["-tp", "1"])
OVERRIDE = "changed in the vLLM command line: replaced -tp 1 with 2 (the shard set's TP size)"


def vllm_container(deployment: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return found


def test_restore_keeps_the_users_edits_and_drops_preshards_changes(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    original = workloads.create_deployment(kube_api, namespace, "vllm", container=CONTAINER)
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    ready = shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    (target,) = ready["status"]["targets"]
    assert target["message"].endswith("\n" + OVERRIDE)
    (announced,) = wait_for(
        lambda: shm.events(kube_api, namespace, reasons.ARGS_OVERRIDDEN),
        what="the ArgsOverridden event",
    )
    assert announced["message"] == f"Deployment vllm: {OVERRIDE}"

    # The user edits the patched Deployment: one more flag and an env var of their own.
    patched = shm.read_deployment(kube_api, namespace, "vllm")
    args = [*vllm_container(patched)["args"], "--max-num-seqs", "8"]
    k8s.AppsV1Api(kube_api).patch_namespaced_deployment(
        "vllm",
        namespace,
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "vllm",
                                "args": args,
                                "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                            }
                        ]
                    }
                }
            }
        },
    )

    shm.delete(kube_api, namespace, "llama")
    wait_for(lambda: shm.gone(kube_api, namespace, "llama"), what="deletion")
    restored = shm.read_deployment(kube_api, namespace, "vllm")

    expected = copy.deepcopy(vllm_container(original))
    expected["args"] = [*CONTAINER["args"], "--max-num-seqs", "8"]
    expected["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    assert vllm_container(restored) == expected
    pod = restored["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert "volumes" not in pod
    assert not any(
        key.startswith("preshard.dev/") for key in restored["metadata"].get("annotations") or {}
    )
    (restore_event,) = wait_for(
        lambda: shm.events(kube_api, namespace, reasons.RESTORED), what="the Restored event"
    )
    assert restore_event["message"] == "Deployment vllm restored"


def test_a_deployment_another_controller_owns_is_patched_only_when_allowed(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(kube_api)
    owner = plain(
        kube_api,
        core.create_namespaced_config_map(
            namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="owner"))
        ),
    )
    workloads.create_deployment(kube_api, namespace, "vllm")
    k8s.AppsV1Api(kube_api).patch_namespaced_deployment(
        "vllm",
        namespace,
        {
            "metadata": {
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "name": "owner",
                        "uid": owner["metadata"]["uid"],
                        "controller": True,
                    }
                ]
            }
        },
    )
    before = shm.read_deployment(kube_api, namespace, "vllm")

    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    refused = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_MANAGED_BY_CONTROLLER
    )
    (target,) = refused["status"]["targets"]
    assert target["state"] == "Refused"
    assert target["message"].startswith(
        "Deployment vllm is controlled by ConfigMap owner (its ownerReference with "
        "controller: true)"
    )
    assert shm.read_deployment(kube_api, namespace, "vllm")["spec"] == before["spec"]

    shm.patch(
        kube_api,
        namespace,
        "llama",
        {"spec": {"targets": [{"name": "vllm", "allowControllerOwned": True}]}},
    )
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    args = shm.vllm_args(shm.read_deployment(kube_api, namespace, "vllm"))
    assert shm.flag(args, "--load-format") == "tensorizer"
