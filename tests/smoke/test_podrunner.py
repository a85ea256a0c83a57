"""The test pod runner plays a kubelet: real processes, real statuses, real Job results."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard import __version__
from preshard_devenv.nodes import on_node
from preshard_devenv.podrunner import PathMap, PodRunner, expand
from preshard_devenv.procs import wait_for
from tests.support.cluster import (
    RUNNER_NODE,
    job_pods,
    termination_message,
    wait_for_job,
    wait_for_pod,
)

pytestmark = pytest.mark.cluster


def _job(name: str, container: dict[str, Any], **spec: Any) -> k8s.V1Job:
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    **on_node("runner"),
                    "containers": [{"name": "main", "image": "preshard:test", **container}],
                    **spec,
                }
            },
        },
    }
    return k8s.V1Job.model_validate(body)


def _pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> k8s.V1Pod:
    body = {
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", **on_node("runner"), "containers": containers, **spec},
    }
    return k8s.V1Pod.model_validate(body)


def _terminated(pod: Any) -> bool:
    return pod.status.phase in ("Succeeded", "Failed")


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "x", "B": "y"}
    assert expand("$(A)/$(B)", env) == "x/y"
    assert expand("$$(A) $(MISSING) $ $(", env) == "$(A) $(MISSING) $ $("


def test_path_map_rewrites_whole_paths_only() -> None:
    paths = PathMap({"/models": "/tmp/m", "/models/cache": "/tmp/c"})
    assert paths("--dir=/models/x --cache /models/cache/y") == "--dir=/tmp/m/x --cache /tmp/c/y"
    assert paths("/models-extra /data/models /models") == "/models-extra /data/models /tmp/m"


def test_a_job_runs_the_preshard_entrypoint(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    job = _job("version", {"command": ["preshard"], "args": ["--version"]})
    k8s.BatchV1Api(kube_api).create_namespaced_job(namespace, job)
    assert wait_for_job(kube_api, namespace, "version") == "Complete"
    (pod,) = job_pods(kube_api, namespace, "version")
    assert pod.spec.node_name == RUNNER_NODE
    assert pod.status.phase == "Succeeded"
    terminated = pod.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (0, "Completed")
    assert f"preshard {__version__}" in pod_runner.logs(namespace, pod.metadata.name, "main")


def test_a_missing_secret_is_a_create_container_config_error(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(kube_api)
    container = {
        "name": "main",
        "image": "preshard:test",
        "command": ["sh", "-c", 'printf "%s" "$TOKEN" > "$PRESHARD_TERMINATION_LOG"'],
        "env": [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}
        ],
    }
    core.create_namespaced_pod(namespace, _pod("needs-secret", [container]))

    def config_error(pod: Any) -> bool:
        statuses = pod.status.container_statuses or []
        return (
            bool(statuses)
            and statuses[0].state.waiting is not None
            and (statuses[0].state.waiting.reason == "CreateContainerConfigError")
        )

    pod = wait_for_pod(kube_api, namespace, "needs-secret", config_error, what="config error")
    assert pod.status.phase == "Pending"
    assert pod.status.container_statuses[0].state.waiting.message == 'secret "creds" not found'
    core.create_namespaced_secret(
        namespace,
        k8s.V1Secret.model_validate(
            {"metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t"}}
        ),
    )
    pod = wait_for_pod(kube_api, namespace, "needs-secret", _terminated, what="the pod to end")
    assert pod.status.phase == "Succeeded"
    assert termination_message(pod) == "s3cr3t"


def test_env_volumes_and_termination_message(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(kube_api)
    core.create_namespaced_secret(
        namespace,
        k8s.V1Secret.model_validate(
            {
                "metadata": {"name": "creds"},
                "stringData": {"id": "AKID", "secret": "shh", "unused": "x"},
            }
        ),
    )
    core.create_namespaced_config_map(
        namespace,
        k8s.V1ConfigMap.model_validate(
            {
                "metadata": {"name": "settings"},
                "data": {"REGION": "local", "file.txt": "hello"},
            }
        ),
    )
    script = (
        'test "$(stat -c %a /creds/key)" = 600 || exit 3; '
        "test ! -e /creds/unused || exit 4; "
        "cp /settings/file.txt /scratch/copied; "
        'printf \'{"id":"%s","secret":"%s","region":"%s","pod":"%s","url":"%s","scratch":"%s"}\' '
        '"$AWS_ACCESS_KEY_ID" "$(cat /creds/key)" "$CFG_REGION" "$POD" "$URL" '
        '"$(cat /scratch/copied)" > /dev/termination-log'
    )
    container = {
        "name": "main",
        "image": "preshard:test",
        "command": ["sh", "-c", script],
        "env": [
            {
                "name": "AWS_ACCESS_KEY_ID",
                "valueFrom": {"secretKeyRef": {"name": "creds", "key": "id"}},
            },
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "HOST", "value": "s3.local"},
            {"name": "URL", "value": "https://$(HOST)/$(POD)"},
            {
                "name": "OPTIONAL",
                "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": True}},
            },
        ],
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "volumeMounts": [
            {"name": "creds", "mountPath": "/creds", "readOnly": True},
            {"name": "settings", "mountPath": "/settings"},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
    }
    volumes = [
        {
            "name": "creds",
            "secret": {"secretName": "creds", "items": [{"key": "secret", "path": "key"}]},
        },
        {"name": "settings", "configMap": {"name": "settings"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    core.create_namespaced_pod(namespace, _pod("wired", [container], volumes=volumes))
    pod = wait_for_pod(kube_api, namespace, "wired", _terminated, what="the pod to end")
    assert pod.status.phase == "Succeeded", pod.status.container_statuses
    assert json.loads(termination_message(pod) or "") == {
        "id": "AKID",
        "secret": "shh",
        "region": "local",
        "pod": "wired",
        "url": "https://s3.local/wired",
        "scratch": "hello",
    }


def test_the_api_serves_a_runner_pods_log(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    """`kubectl logs` (and the operator's progress reads) reach the runner's containers."""
    main = {
        "name": "main",
        "image": "preshard:test",
        "command": ["sh", "-c", "for i in 1 2 3 4 5; do echo line $i; done"],
    }
    k8s.CoreV1Api(kube_api).create_namespaced_pod(namespace, _pod("talks", [main]))
    wait_for_pod(kube_api, namespace, "talks", _terminated, what="the pod to end")
    core = k8s.CoreV1Api(kube_api)
    assert core.read_namespaced_pod_log("talks", namespace, container="main") == "".join(
        f"line {i}\n" for i in range(1, 6)
    )
    assert core.read_namespaced_pod_log("talks", namespace, tail_lines=2) == "line 4\nline 5\n"
    assert core.read_namespaced_pod_log("talks", namespace, limit_bytes=8) == "line 1\nl"


def test_a_failing_init_container_fails_the_pod(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    init = {"name": "init", "image": "preshard:test", "command": ["sh", "-c", "exit 7"]}
    main = {"name": "main", "image": "preshard:test", "command": ["true"]}
    pod = _pod("init-fails", [main], initContainers=[init])
    k8s.CoreV1Api(kube_api).create_namespaced_pod(namespace, pod)
    pod = wait_for_pod(kube_api, namespace, "init-fails", _terminated, what="the pod to end")
    assert pod.status.phase == "Failed"
    init_state = pod.status.init_container_statuses[0].state.terminated
    assert (init_state.exit_code, init_state.reason) == (7, "Error")
    assert pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"


def test_unknown_programs_are_servers_and_deletion_kills_processes(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(kube_api)
    containers = [
        {"name": "vllm", "image": "vllm:test", "command": ["vllm"], "args": ["serve", "/m"]},
        {
            "name": "sleeper",
            "image": "preshard:test",
            # Kubernetes turns `$$` into `$`, so the shell sees `echo $$`.
            "command": ["sh", "-c", "echo $$$$; exec sleep 300"],
        },
    ]
    core.create_namespaced_pod(namespace, _pod("server", containers, restartPolicy="Always"))

    def ready(pod: Any) -> bool:
        return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

    pod = wait_for_pod(kube_api, namespace, "server", ready, what="the pod to be Ready")
    assert pod.status.phase == "Running"
    assert all(s.state.running is not None for s in pod.status.container_statuses)
    pid = int(
        wait_for(lambda: pod_runner.logs(namespace, "server", "sleeper").strip(), what="the pid")
    )
    os.kill(pid, 0)
    core.delete_namespaced_pod("server", namespace)
    wait_for(
        lambda: not core.list_namespaced_pod(namespace).items,
        what="the pod to be removed",
    )
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_on_failure_restarts_the_container_until_it_succeeds(
    pod_runner: PodRunner, kube_api: k8s.ApiClient, namespace: str
) -> None:
    flaky = {
        "name": "main",
        "image": "preshard:test",
        "command": ["sh", "-c", "test -e /scratch/tried || { touch /scratch/tried; exit 1; }"],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    }
    pod = _pod(
        "flaky",
        [flaky],
        restartPolicy="OnFailure",
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    k8s.CoreV1Api(kube_api).create_namespaced_pod(namespace, pod)
    pod = wait_for_pod(kube_api, namespace, "flaky", _terminated, what="the pod to end")
    assert pod.status.phase == "Succeeded"
    (status,) = pod.status.container_statuses
    assert status.restart_count == 1
    assert status.last_state.terminated.exit_code == 1
    assert status.state.terminated.exit_code == 0
