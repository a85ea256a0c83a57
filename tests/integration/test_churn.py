"""Quick edits in any order converge: whatever sequence of tensor-parallel sizes a ShardedModel
is edited through, and however fast, it ends Ready at its last spec within a bounded time, with
no Job left running and no status entry pointing at a Job that does not exist."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
from kubernetes import client as k8s

from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support.specs import kwok_spec

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

EDITS = 30
CONVERGE_SECONDS = 120.0


def spec(sizes: list[int], target_tp: int) -> dict[str, Any]:
    return kwok_spec(
        tensorParallelSizes=sizes, targets=[{"name": "vllm", "tensorParallelSize": target_tp}]
    )


def edits(seed: int) -> list[tuple[list[int], int]]:
    """EDITS specs: one to three TP sizes out of 1, 2, 4 and 8, and the target's among them."""
    rng = random.Random(seed)  # noqa: S311 - test data, not secrets
    chosen = []
    for _ in range(EDITS):
        sizes = sorted(rng.sample([1, 2, 4, 8], k=rng.randint(1, 3)))
        chosen.append((sizes, rng.choice(sizes)))
    return chosen


def converged(
    api: k8s.ApiClient, namespace: str, sizes: list[int], target_tp: int, generation: int
) -> dict[str, Any] | None:
    resource = shm.get(api, namespace, "llama")
    status = resource.get("status") or {}
    ready = workloads.condition(resource, "Ready") or {}
    if (status.get("observedGeneration"), ready.get("status")) != (generation, "True"):
        return None
    sets = status.get("shardSets") or []
    if sorted(s["tensorParallelSize"] for s in sets) != sizes:
        return None
    args = shm.vllm_args(shm.read_deployment(api, namespace, "vllm"))
    if shm.flag(args, "--tensor-parallel-size") != str(target_tp):
        return None
    running = [j for j in shm.jobs(api, namespace) if not _finished(j)]
    return resource if not running else None


def _finished(job: dict[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


@pytest.mark.parametrize("seed", [7, 1234])
def test_quick_edits_in_any_order_converge_to_the_last_spec(
    kube_api: k8s.ApiClient, namespace: str, seed: int
) -> None:
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", spec([2], 2))
    shm.wait_condition(kube_api, namespace, "llama", "Ready", "True", reasons.READY)
    rng = random.Random(seed)  # noqa: S311 - test data, not secrets
    plan = edits(seed)
    for sizes, target_tp in plan:
        body = spec(sizes, target_tp)
        shm.patch(
            kube_api,
            namespace,
            "llama",
            {
                "spec": {
                    "tensorParallelSizes": body["tensorParallelSizes"],
                    "targets": body["targets"],
                }
            },
        )
        time.sleep(rng.uniform(0.0, 0.1))
    generation = shm.get(kube_api, namespace, "llama")["metadata"]["generation"]
    sizes, target_tp = plan[-1]
    try:
        resource = wait_for(
            lambda: converged(kube_api, namespace, sizes, target_tp, generation),
            timeout=CONVERGE_SECONDS,
            what=f"convergence to TP {sizes} (target at {target_tp}) after {EDITS} edits",
        )
    except TimeoutError as error:
        status = shm.get(kube_api, namespace, "llama").get("status")
        jobs = [(j["metadata"]["name"], _finished(j)) for j in shm.jobs(kube_api, namespace)]
        raise AssertionError(
            f"{error} (seed {seed})\nstatus: {json.dumps(status, indent=1)}\njobs: {jobs}"
        ) from None
    names = {j["metadata"]["name"] for j in shm.jobs(kube_api, namespace)}
    for entry in resource["status"]["shardSets"]:
        assert entry["stage"] == "Verified", entry
        assert entry.get("job") in (None, *names), entry
