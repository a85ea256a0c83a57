"""From `kubectl apply` to a vLLM Deployment that loads real shards, with nothing faked but the
GPU.

The chart is installed into the real control plane and its operator runs as the chart's
ServiceAccount. The serialize and verify Jobs and the patched Deployment's init container run
on the runner node as real processes: `preshard serialize` (CPU test engine) writes real
tensorizer rank files to the real S3 server, `preshard verify` checks them, `preshard
fetch-config` copies the config files into the pod's model directory. The test then reads every
rank file from the URI the patched Deployment names, with the credentials and endpoint it sets,
through tensorizer's own S3 reader, and compares the tensors with the model.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any, Final

import pytest
from kubernetes import client as k8s
from tensorizer.serialization import CryptographyError

from preshard.contract import reasons
from preshard.contract.outcome import Outcome
from preshard_devenv import workloads
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.podrunner import PodRunner
from preshard_devenv.procs import wait_for
from preshard_devenv.s3server import S3Bucket
from preshard_devenv.tinymodel import TinyModel
from tests.support import shardedmodels as shm
from tests.support import specs, timings
from tests.support.cluster import RUNNER_NODE, job_names, job_outcome
from tests.support.leaks import api_objects, leaks
from tests.support.models import assert_shards_match
from tests.support.serving import (
    MODEL_VOLUME,
    container_flags,
    load_like_vllm,
    pod_dir,
    serving_pod,
)
from tests.support.tools import Tool, kubectl_apply

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

SHARDS: Final = "shards"
KEY_SECRET: Final = "shard-key"
KEY_MOUNT: Final = "/var/run/preshard/encryption/key"


def clear_prefix(bucket: S3Bucket, prefix: str) -> None:
    """Remove every object under a prefix, so the run below really serializes."""
    for key in bucket.keys(prefix + "/"):
        bucket.client.delete_object(Bucket=bucket.name, Key=key)


def wait_serving(api: k8s.ApiClient, namespace: str, operator: OperatorProcess) -> Any:
    """The patched Deployment's Running pod, once its init container fetched the config."""

    def serving() -> Any | None:
        shm.forbid_tracebacks(operator)
        return serving_pod(api, namespace, "vllm")

    return wait_for(serving, what="a pod of the patched Deployment to serve", timeout=60)


def check_jobs_ran_for_real(
    api: k8s.ApiClient, namespace: str, runner: PodRunner
) -> dict[str, Outcome]:
    """Probe, serialize and verify each ran once, on the runner node, and reported back."""
    names = job_names(api, namespace)
    assert [name.rsplit("-", 2)[-2:] for name in names] == [
        ["serialize", "1"],
        ["verify", "1"],
        ["verify", "2"],
    ], names
    outcomes = {}
    for name in names:
        pod, outcome = job_outcome(api, namespace, name)
        assert pod.spec.node_name == RUNNER_NODE
        outcomes[name.rsplit("-", 2)[-2] + name[-2:]] = outcome
        log = runner.logs(namespace, pod.metadata.name, "preshard")
        assert outcome.to_message() in log, log[-2000:]
    assert outcomes["verify-1"].reason == reasons.MANIFEST_MISSING
    assert (outcomes["serialize-1"].reason, outcomes["serialize-1"].files) == (
        reasons.SERIALIZED,
        2 + 4,
    )
    assert outcomes["verify-2"].reason == reasons.VERIFIED
    return outcomes


def check_config_fetched(
    api: k8s.ApiClient, namespace: str, pod: Any, runner: PodRunner, model: TinyModel
) -> None:
    """The init container ran `fetch-config` and the model directory holds the config files."""
    assert pod.spec.node_name == RUNNER_NODE
    (init,) = pod.status.init_container_statuses
    outcome = Outcome.from_message(init.state.terminated.message)
    assert outcome is not None
    assert (outcome.command, outcome.reason) == ("fetch-config", reasons.CONFIG_FETCHED)
    model_dir = pod_dir(runner, namespace, pod.metadata.name) / "volumes"
    fetched = model_dir / MODEL_VOLUME
    assert sorted(p.name for p in fetched.iterdir()) == sorted(model.config_files)
    for name in model.config_files:
        assert (fetched / name).read_bytes() == (model.path / name).read_bytes(), name


def test_kubectl_apply_ends_in_a_deployment_that_loads_the_shards(
    kube_api: k8s.ApiClient,
    admin_kubectl: Tool,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    s3_bucket: S3Bucket,
    tiny_model: TinyModel,
    pod_runner: PodRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    namespace = workspace
    clear_prefix(s3_bucket, SHARDS)
    original = specs.create_vllm_deployment(kube_api, namespace)
    manifest = workloads.sharded_model("tiny", specs.spec(store, SHARDS), namespace=namespace)

    started = time.monotonic()
    applied = kubectl_apply(admin_kubectl, manifest, tmp_path)
    assert "shardedmodel.preshard.dev/tiny created" in applied
    resource = shm.wait_ready(kube_api, namespace, "tiny", operator=operator)
    ready = time.monotonic() - started
    pod = wait_serving(kube_api, namespace, operator)
    serving = time.monotonic() - started
    timings.record("kubectl apply -> Ready (probe, serialize, verify, patch), TP 2", ready)
    timings.record("kubectl apply -> patched pod serving (fetch-config done)", serving)

    entry = shm.only_set(resource)
    assert (entry["stage"], entry["reason"]) == ("Verified", reasons.VERIFIED)
    assert (entry["serializeRun"], entry["verifyRun"], entry["files"]) == (1, 2, 6)
    assert entry["uri"] == f"s3://{store.bucket}/{SHARDS}/{entry['artifactKey']}/"
    conditions = {c["type"]: (c["status"], c["reason"]) for c in resource["status"]["conditions"]}
    assert conditions == {
        "Ready": ("True", reasons.READY),
        "Serialized": ("True", reasons.SERIALIZED),
        "Verified": ("True", reasons.VERIFIED),
        "TargetsPatched": ("True", reasons.PATCHED),
        "Degraded": ("False", reasons.AS_EXPECTED),
    }
    check_jobs_ran_for_real(kube_api, namespace, pod_runner)

    stored = s3_bucket.keys(f"{SHARDS}/{entry['artifactKey']}/")
    names = sorted(key.rsplit("/", 1)[-1] for key in stored)
    assert names == sorted(
        [
            "manifest.json",
            "model-rank-000.tensors",
            "model-rank-001.tensors",
            *tiny_model.config_files,
        ]
    )
    manifest_object = s3_bucket.client.get_object(
        Bucket=s3_bucket.name, Key=f"{SHARDS}/{entry['artifactKey']}/manifest.json"
    )
    recorded = json.loads(manifest_object["Body"].read())
    assert (recorded["tensorParallelSize"], recorded["artifactKey"]) == (2, entry["artifactKey"])

    deployment = shm.read_deployment(kube_api, namespace, "vllm")
    tp, load_format, extra = container_flags(deployment)
    assert (tp, load_format) == (2, "tensorizer")
    assert extra["tensorizer_uri"] == f"{entry['uri']}model-rank-%03d.tensors"
    args = shm.vllm_args(deployment)
    assert shm.flag(args, "--served-model-name") == specs.SERVED_MODEL
    vllm = deployment["spec"]["template"]["spec"]["containers"][0]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert deployment["spec"]["replicas"] == original["spec"]["replicas"]

    check_config_fetched(kube_api, namespace, pod, pod_runner, tiny_model)
    with timings.stopwatch("load both rank files from S3 as vLLM would and compare"):
        load_like_vllm(
            kube_api, namespace, deployment, tiny_model, tmp_path / "loaded", monkeypatch
        )
    shm.forbid_tracebacks(operator)


def test_an_encrypted_set_loads_only_with_its_key_which_stays_in_its_secret(
    kube_api: k8s.ApiClient,
    admin_kubectl: Tool,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    tiny_model: TinyModel,
    pod_runner: PodRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    namespace = workspace
    key = secrets.token_bytes(32)
    specs.create_secret(kube_api, namespace, KEY_SECRET, {"key": key})
    specs.create_vllm_deployment(kube_api, namespace)
    body = specs.spec(store, SHARDS, encryption={"secretRef": {"name": KEY_SECRET, "key": "key"}})
    started = time.monotonic()
    kubectl_apply(
        admin_kubectl, workloads.sharded_model("secret", body, namespace=namespace), tmp_path
    )
    shm.wait_ready(kube_api, namespace, "secret", operator=operator)
    pod = wait_serving(kube_api, namespace, operator)
    timings.record(
        "kubectl apply -> patched pod serving, encrypted TP 2", time.monotonic() - started
    )

    deployment = shm.read_deployment(kube_api, namespace, "vllm")
    _, _, extra = container_flags(deployment)
    assert extra["encryption_keyfile"] == KEY_MOUNT
    pod_spec = deployment["spec"]["template"]["spec"]
    key_volumes = [v for v in pod_spec["volumes"] if "secret" in v]
    assert [v["secret"]["items"] for v in key_volumes] == [[{"key": "key", "path": "key"}]]
    mounted = pod_dir(pod_runner, namespace, pod.metadata.name) / "volumes"
    assert (mounted / key_volumes[0]["name"] / "key").read_bytes() == key

    paths = load_like_vllm(
        kube_api, namespace, deployment, tiny_model, tmp_path / "loaded", monkeypatch, key=key
    )
    with pytest.raises(CryptographyError):
        assert_shards_match(tiny_model, paths)
    with pytest.raises(CryptographyError):
        assert_shards_match(tiny_model, paths, key=secrets.token_bytes(32))

    texts = api_objects(kube_api, namespace) | {"operator log": operator.log()}
    assert leaks(texts, {"encryption key": key}) == []
