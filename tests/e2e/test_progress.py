"""Progress in status: while a serialization runs, `kubectl get shm` shows how far it is.

The chart's operator (its RBAC, `pods/log` included) reads the last lines of the running
serialize Job's log through the API server, which fetches them from the runner node's log
endpoint; the serialization runs for real on that node, with the engine held at the
switchboard so that the test can look while it works.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from tests.e2e.engine import EngineControl
from tests.support import shardedmodels as shm
from tests.support import specs
from tests.support.tools import Tool

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

ENGINE_STEP = "engine: vLLM is writing the rank files"


def progress_of(api: k8s.ApiClient, namespace: str) -> str | None:
    sets = (shm.get(api, namespace, "llama").get("status") or {}).get("shardSets") or []
    found: Any = sets[0].get("progress") if sets else None
    return found if isinstance(found, str) else None


def test_a_running_serialization_shows_its_progress(
    kube_api: k8s.ApiClient,
    operator: OperatorProcess,
    workspace: str,
    store: specs.Store,
    engine_switchboard: EngineControl,
    admin_kubectl: Tool,
) -> None:
    namespace = workspace
    specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
    engine_switchboard.hold()
    workloads.create_sharded_model(
        kube_api, namespace, "llama", specs.spec(store, f"progress-{secrets.token_hex(3)}")
    )
    wait_for(engine_switchboard.engine_waiting, what="the serialization to reach the engine")
    # The engine's heartbeat is in the log within seconds; the operator reads it at the next
    # poll (config.progressSeconds, 15 s by default).
    wait_for(
        lambda: progress_of(kube_api, namespace) == ENGINE_STEP,
        what="the engine step in status.shardSets[].progress",
        timeout=90,
    )
    table = admin_kubectl.run("get", "shm", "llama", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    assert "PROGRESS" in header.split()
    assert ENGINE_STEP in row
    engine_switchboard.release()
    ready = shm.wait_ready(kube_api, namespace, "llama", operator=operator, timeout=120)
    assert "progress" not in shm.only_set(ready), "a finished Job has no progress"
    assert (workloads.condition(ready, "Ready") or {}).get("reason") == reasons.READY
