"""Real vLLM at both ends: vLLM makes the shards, vLLM serves the patched Deployment.

The engine tier. `make engine-env` builds vLLM's CPU build into `.venv-engine`, without
tensorizer, like the stock `vllm/vllm-openai` image; the pod runner runs the images of this
flow from it (`preshard_devenv.engine`):

1. `kubectl apply` of a ShardedModel at TP 1 with a target Deployment written as people write
   it (`vllm serve org/tiny --port N`, a readiness probe on `/health`);
2. the serialize Job runs `preshard serialize` with the real `VllmEngine`: vLLM's own
   `tensorize_vllm_model` writes the rank file, preshard uploads it to the S3 server; the
   verify Job checks it;
3. the ShardedModel is edited (`kubectl apply` again) to TP 1 and 2, with a second Deployment
   at TP 2: the operator makes the TP 2 set with a reshard Job on CPU from the verified TP 1
   set (no serialize Job: vLLM's layout at TP 2, fused `qkv_proj` and `gate_up_proj` halved per
   rank, is written by `preshard reshard`), and verifies it;
4. the operator patches each Deployment; the runner runs its init container
   (`preshard fetch-config`, which also hands over the bundled tensorizer) and then the vLLM
   container's command line exactly as patched, as a real `vllm serve` that streams the rank
   files from S3 with tensorizer;
5. each patched server answers a temperature-0 completion with the same tokens as vLLM serving
   the original safetensors, the resharded TP 2 set included, and the ShardedModel is Ready;
6. the TP 1 set is broken under its Deployment (rank file zeroed, same size) and the pod
   replaced: vLLM refuses the file and crash-loops, and the ShardedModel turns not-Ready with
   `TargetUnavailable` and an event quoting the pod's last output.

So a wrong tensorizer URI, TP size, endpoint, a lost rank, an image that cannot import
tensorizer or a resharded tensor out of place fails here because vLLM itself refuses or answers
differently. That the resharded files are vLLM's own byte for byte is shown against vLLM's
serializations in `tests/dataplane/test_reshard.py`. What is not real: the
GPU (vLLM runs on CPU, with the fixes in `operator/preshard_devenv/vllm_cpu/`), and images
(each runs from a local virtualenv).
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard.contract.layout import S3Location
from preshard_devenv import engine, procs, workloads
from preshard_devenv.nodes import on_node
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.podrunner import PodRunner, image_repository
from preshard_devenv.procs import wait_for
from preshard_devenv.s3server import S3Bucket
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from tests.e2e.engine import EngineControl
from tests.support import shardedmodels as shm
from tests.support import specs, timings
from tests.support.cluster import job_names, job_outcome, pods
from tests.support.models import upload_model
from tests.support.serving import container_flags, serving_pod
from tests.support.tools import Tool, kubectl_apply

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow, pytest.mark.engine]

SERIALIZER_IMAGE: Final = "ghcr.io/preshard/preshard-serializer:cpu-engine"
PROMPTS: Final = ((5, 17, 33, 100), (300, 4, 77))
# A cold vLLM start on two busy cores (imports, engine, workers) takes one to three minutes.
SERVE_TIMEOUT: Final = 600.0
SERIALIZE_TIMEOUT: Final = 900.0


@pytest.fixture(scope="module")
def runner_engine(
    pod_runner: PodRunner, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineControl]:
    """This module's pods run real vLLM: the serializer and the vLLM image from the engine
    environment, and no test engine (`PRESHARD_ENGINE` unset)."""
    images = {
        image_repository(SERIALIZER_IMAGE): engine.serializer_image(),
        engine.VLLM_REPOSITORY: engine.vllm_image(),
    }
    saved_env, saved_images = dict(pod_runner.extra_env), dict(pod_runner.images)
    pod_runner.extra_env["HF_ENDPOINT"] = f"http://127.0.0.1:{procs.free_port()}"
    pod_runner.images.update(images)
    try:
        yield EngineControl(Path(tmp_path_factory.mktemp("engine")))
    finally:
        pod_runner.extra_env.clear()
        pod_runner.extra_env.update(saved_env)
        pod_runner.images.clear()
        pod_runner.images.update(saved_images)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama in a shape vLLM's CPU kernels take (untied embeddings)."""
    return make_tiny_model(
        Path(tmp_path_factory.mktemp("vllm-model")) / "tiny", **engine.TINY_LLAMA
    )


@pytest.fixture(scope="module")
def baseline(
    vllm_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, ...], engine.Completion]:
    """What vLLM answers serving the original safetensors directory (TP 1)."""
    server = engine.VllmServer.start(
        str(vllm_model.path),
        Path(tmp_path_factory.mktemp("baseline")),
        served_model_name=specs.SERVED_MODEL,
        name="vllm-baseline",
    )
    try:
        return {
            prompt: engine.complete(server.url(""), specs.SERVED_MODEL, prompt)
            for prompt in PROMPTS
        }
    finally:
        server.stop()


def vllm_target(name: str, port: int) -> dict[str, Any]:
    """A vLLM container as people write it for CPU: model, port, dtype, context, probe."""
    return specs.vllm_container(
        args=[specs.SERVED_MODEL, "--port", str(port), *engine.VLLM_CPU_ARGS],
        readinessProbe={"httpGet": {"path": "/health", "port": port}, "periodSeconds": 2},
        terminationMessagePolicy="FallbackToLogsOnError",
        resources={"limits": {"nvidia.com/gpu": "1"}},
        name=name,
    )


def patched(api: k8s.ApiClient, namespace: str, name: str) -> bool | None:
    """True once the operator has pointed the Deployment at a shard set."""
    _, load_format, _ = container_flags(shm.read_deployment(api, namespace, name))
    return True if load_format == "tensorizer" else None


def wait_pod_ready(api: k8s.ApiClient, namespace: str, deployment: str) -> Any:
    """The patched Deployment's pod once its vLLM answers the readiness probe."""

    def ready() -> Any | None:
        pod = serving_pod(api, namespace, deployment)
        conditions = {c.type: c.status for c in (pod.status.conditions or [])} if pod else {}
        return pod if conditions.get("Ready") == "True" else None

    return wait_for(ready, what=f"the patched {deployment} to serve", timeout=SERVE_TIMEOUT)


def tp2_verified(api: k8s.ApiClient, namespace: str, operator: OperatorProcess) -> Any | None:
    """The ShardedModel once its TP 2 set is verified (the operator must stay up meanwhile)."""
    assert operator.alive(), operator.log_tail()
    resource = shm.get(api, namespace, "tiny")
    sets = (resource.get("status") or {}).get("shardSets") or []
    done = any(e["tensorParallelSize"] == 2 and e["stage"] == "Verified" for e in sets)
    return resource if done else None


def test_vllm_makes_the_shards_and_serves_the_patched_deployments(
    kube_api: k8s.ApiClient,
    workspace: str,
    store: specs.Store,
    s3_bucket: S3Bucket,
    vllm_model: TinyModel,
    operator: OperatorProcess,
    pod_runner: PodRunner,
    runner_engine: EngineControl,
    baseline: dict[tuple[int, ...], engine.Completion],
    admin_kubectl: Tool,
    tmp_path: Path,
) -> None:
    namespace = workspace
    ports = dict(zip((1, 2), procs.free_ports(2), strict=True))
    for tp, port in ports.items():
        # At 0 replicas until patched: the unpatched `vllm serve org/tiny` would only crash-loop
        # (no Hub here) and take CPU from the serialization on this two-core machine.
        workloads.create_deployment(
            kube_api,
            namespace,
            f"vllm-tp{tp}",
            container=vllm_target("vllm", port),
            pod_spec=on_node("runner"),
            replicas=0,
        )
    source = upload_model(vllm_model, s3_bucket.client, s3_bucket.name, "models/tiny-vllm")
    targets = [{"name": f"vllm-tp{tp}", "tensorParallelSize": tp} for tp in ports]
    body = specs.spec(
        store,
        f"real-vllm-{secrets.token_hex(3)}",
        model={"uri": source},
        tp=(1,),
        targets=targets[:1],
        serialization={"image": SERIALIZER_IMAGE, "dtype": "float32", "maxModelLen": 256},
    )
    kubectl_apply(
        admin_kubectl, workloads.sharded_model("tiny", body, namespace=namespace), tmp_path
    )
    with timings.stopwatch("real vLLM: apply -> TP 1 set serialized"):
        serialized = shm.wait_condition(
            kube_api,
            namespace,
            "tiny",
            "Serialized",
            "True",
            operator=operator,
            timeout=SERIALIZE_TIMEOUT,
        )
    (tp1_set,) = serialized["status"]["shardSets"]

    # The edit that adds a TP size: its set is made on CPU from the TP 1 set, with no GPU Job.
    # `Serialized` turns True while the TP 1 set's verify Job runs, so the TP 2 probe may end
    # first: the set then waits for that check (WaitingForSource) instead of serializing.
    edited = {**body, "tensorParallelSizes": [1, 2], "targets": targets}
    kubectl_apply(
        admin_kubectl, workloads.sharded_model("tiny", edited, namespace=namespace), tmp_path
    )
    with timings.stopwatch("real vLLM: edit to TP 1 and 2 -> TP 2 set resharded and verified"):
        resharded = wait_for(
            lambda: tp2_verified(kube_api, namespace, operator),
            what="the TP 2 set to be resharded and verified",
            timeout=SERIALIZE_TIMEOUT,
        )
    sets = {e["tensorParallelSize"]: e for e in resharded["status"]["shardSets"]}
    assert sets[2]["reshardedFrom"] == tp1_set["artifactKey"], sets[2]
    assert sets[2]["message"].startswith(f"resharded on CPU from {tp1_set['artifactKey']}")
    assert (sets[2].get("reshardRun"), sets[2].get("serializeRun", 0)) == (1, 0), sets[2]
    # What a kept init container image must read (the verify Job reported it).
    assert sets[2]["manifestFormat"] == 2, sets[2]
    names = job_names(kube_api, namespace)
    outcomes = {name: job_outcome(kube_api, namespace, name)[1] for name in names}
    made = {n: o for n, o in outcomes.items() if "-serialize-" in n or "-reshard-" in n}
    assert sorted((o.command, o.tensor_parallel_size) for o in made.values()) == [
        ("reshard", 2),
        ("serialize", 1),
    ], made
    for outcome in made.values():
        # vLLM's own version is what both manifests record; tensorizer's wrote each set.
        assert outcome.vllm_version == "0.32.0", outcome
        assert outcome.tensorizer_version == "2.10.1", outcome
    manifest = s3_bucket.client.get_object(
        Bucket=s3_bucket.name, Key=S3Location.parse(sets[2]["uri"]).key("manifest.json")
    )["Body"].read()
    assert json.loads(manifest)["reshardedFrom"] == {
        "uri": tp1_set["uri"],
        "artifactKey": tp1_set["artifactKey"],
        "tensorParallelSize": 1,
    }

    with timings.stopwatch("real vLLM: both sets verified -> both patched servers ready"):
        apps = k8s.AppsV1Api(kube_api)
        for tp in ports:
            wait_for(
                functools.partial(patched, kube_api, namespace, f"vllm-tp{tp}"),
                what=f"vllm-tp{tp} to be patched",
                timeout=SERIALIZE_TIMEOUT,
            )
            apps.patch_namespaced_deployment_scale(
                f"vllm-tp{tp}", namespace, {"spec": {"replicas": 1}}
            )
        for tp in ports:
            wait_pod_ready(kube_api, namespace, f"vllm-tp{tp}")
    resource = shm.wait_ready(kube_api, namespace, "tiny", operator=operator, timeout=120)
    assert {t["name"]: t["tensorParallelSize"] for t in resource["status"]["targets"]} == {
        "vllm-tp1": 1,
        "vllm-tp2": 2,
    }

    for tp, port in ports.items():
        deployment = shm.read_deployment(kube_api, namespace, f"vllm-tp{tp}")
        flags_tp, load_format, _ = container_flags(deployment)
        assert (flags_tp, load_format) == (tp, "tensorizer")
        for prompt, expected in baseline.items():
            answer = engine.complete(f"http://127.0.0.1:{port}", specs.SERVED_MODEL, prompt)
            assert answer == expected, (tp, prompt)

    # The set under a serving Deployment breaks, so that vLLM itself refuses it: the TP 1 rank
    # file is overwritten with as many zero bytes (a sizes check still passes), and the pod is
    # replaced. Its vLLM fails to load and crash-loops; Ready follows the pods, not the patch.
    rank_file = S3Location.parse(tp1_set["uri"]).key("model-rank-000.tensors")
    size = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=rank_file)["ContentLength"]
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=rank_file, Body=bytes(size))
    core = k8s.CoreV1Api(kube_api)
    for pod in pods(kube_api, namespace, "app=vllm-tp1"):
        core.delete_namespaced_pod(pod.metadata.name, namespace)
    with timings.stopwatch("real vLLM: broken rank file -> TargetUnavailable"):
        failing = shm.wait_condition(
            kube_api,
            namespace,
            "tiny",
            "Ready",
            "False",
            reasons.TARGET_UNAVAILABLE,
            operator=operator,
            timeout=SERVE_TIMEOUT,
        )
    states = {t["name"]: (t["state"], t["reason"]) for t in failing["status"]["targets"]}
    assert states["vllm-tp1"] == ("Unavailable", reasons.TARGET_UNAVAILABLE), states
    assert states["vllm-tp2"][1] == reasons.PATCHED, states

    def unavailable_event() -> str | None:
        found = core.list_namespaced_event(
            namespace, field_selector=f"reason={reasons.TARGET_UNAVAILABLE}"
        ).items
        return next((e.message for e in found if "vllm-tp1" in (e.message or "")), None)

    message = wait_for(unavailable_event, what="a TargetUnavailable event naming vllm-tp1")
    # The event quotes vLLM's own last words (the pod's termination message from its log).
    assert "Not a tensorizer file" in message or "Engine core" in message, message
    shm.forbid_tracebacks(operator)
