"""On the real API server: a server on another vLLM release is not patched, an operator
upgrade (a new tools image) writes no patched Deployment, and a patch a GitOps tool keeps
reverting is given up with TargetReverted until the retry annotation asks again."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.builders.patching import INIT_CONTAINER
from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from tests.integration.conftest import OPERATOR_ENV
from tests.support import shardedmodels as shm
from tests.support.specs import kwok_spec

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

JSON_PATCH = "application/json-patch+json"


def init_image(deployment: dict[str, Any]) -> str | None:
    pod = deployment["spec"]["template"]["spec"]
    return next(
        (c["image"] for c in pod.get("initContainers") or [] if c["name"] == INIT_CONTAINER), None
    )


def loads_shards(api: k8s.ApiClient, namespace: str, name: str = "vllm") -> dict[str, Any] | None:
    deployment = shm.read_deployment(api, namespace, name)
    if shm.flag(shm.vllm_args(deployment), "--load-format") == "tensorizer":
        return deployment
    return None


def test_a_server_on_another_vllm_release_is_refused_until_allowed(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    container = workloads.vllm_container(image="vllm/vllm-openai:v0.11.0")
    before = workloads.create_deployment(kube_api, namespace, "vllm", container=container)
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    refused = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.VLLM_VERSION_MISMATCH
    )
    (target,) = refused["status"]["targets"]
    assert target["state"] == "Refused"
    assert target["message"].startswith(
        "container vllm runs vLLM 0.11.0 (read from its image vllm/vllm-openai:v0.11.0) but "
        f"shard set {refused['status']['shardSets'][0]['artifactKey']} was written by vLLM 0.34.0"
    )
    assert shm.read_deployment(kube_api, namespace, "vllm")["spec"] == before["spec"]

    shm.patch(
        kube_api,
        namespace,
        "llama",
        {"spec": {"targets": [{"name": "vllm", "allowVllmVersionMismatch": True}]}},
    )
    ready = shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    assert ready["status"]["targets"][0]["message"].endswith(
        "was written by vLLM 0.34.0: patched anyway (allowVllmVersionMismatch)"
    )
    assert loads_shards(kube_api, namespace) is not None


def test_an_operator_upgrade_does_not_write_patched_deployments(
    kube_api: k8s.ApiClient, namespace: str, running_operator: OperatorProcess
) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(
        kube_api, namespace, "llama", kwok_spec(targets=[{"name": "vllm"}, {"name": "vllm-late"}])
    )
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_NOT_FOUND)
    patched = wait_for(lambda: loads_shards(kube_api, namespace), what="the patch")
    assert init_image(patched) == OPERATOR_ENV["PRESHARD_TOOLS_IMAGE"]

    running_operator.stop()
    running_operator.extra_env["PRESHARD_TOOLS_IMAGE"] = "preshard:next"
    try:
        running_operator.start()
        # The upgraded operator patches a Deployment that appears now with its own image...
        workloads.create_deployment(kube_api, namespace, "vllm-late")
        shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
        late = shm.read_deployment(kube_api, namespace, "vllm-late")
        assert init_image(late) == "preshard:next"
        # ... and leaves the one patched before as it was: no write, no rollout.
        after = shm.read_deployment(kube_api, namespace, "vllm")
        assert after["metadata"]["generation"] == patched["metadata"]["generation"]
        assert after["spec"] == patched["spec"]
        assert init_image(after) == OPERATOR_ENV["PRESHARD_TOOLS_IMAGE"]
    finally:
        running_operator.stop()
        running_operator.extra_env["PRESHARD_TOOLS_IMAGE"] = OPERATOR_ENV["PRESHARD_TOOLS_IMAGE"]
        running_operator.start()


def revert(api: k8s.ApiClient, namespace: str, template: dict[str, Any]) -> None:
    """Argo CD's self-heal: the template from Git put back (annotations not in Git stay)."""
    k8s.AppsV1Api(api).patch_namespaced_deployment(
        "vllm",
        namespace,
        [{"op": "replace", "path": "/spec/template", "value": copy.deepcopy(template)}],
        field_manager="argocd-controller",
        _content_type=JSON_PATCH,
    )


def test_a_patch_reverted_again_and_again_is_given_up_until_retried(
    kube_api: k8s.ApiClient, namespace: str
) -> None:
    original = workloads.create_deployment(kube_api, namespace, "vllm")["spec"]["template"]
    workloads.create_sharded_model(kube_api, namespace, "llama", kwok_spec())
    generation = 0
    for _ in range(3):

        def repatched(after: int = generation) -> dict[str, Any] | None:
            found = loads_shards(kube_api, namespace)
            return found if found and found["metadata"]["generation"] > after else None

        patched = wait_for(repatched, what="the patch")
        generation = patched["metadata"]["generation"]
        revert(kube_api, namespace, original)

    given_up = shm.wait_condition(
        kube_api, namespace, "llama", "Ready", "False", reasons.TARGET_REVERTED
    )
    (target,) = given_up["status"]["targets"]
    assert target["state"] == "Refused"
    assert target["message"].startswith("the patch of Deployment vllm was undone 3 times")
    reverted = shm.read_deployment(kube_api, namespace, "vllm")
    time.sleep(3)  # a few passes: none of them writes
    assert (
        shm.read_deployment(kube_api, namespace, "vllm")["metadata"]["generation"]
        == (reverted["metadata"]["generation"])
    )
    assert loads_shards(kube_api, namespace) is None

    shm.patch(
        kube_api, namespace, "llama", {"metadata": {"annotations": {"preshard.dev/retry": "1"}}}
    )
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    assert loads_shards(kube_api, namespace) is not None
