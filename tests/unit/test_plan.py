"""The reconcile decision, step by step through a shard set's lifecycle and its targets.

Each test feeds `plan` an observation (Jobs with their pods' termination messages, Deployments)
and checks the actions and the status it decides. `World` plays the cluster: it applies a plan
(creates Jobs, applies Deployment patches, stores the status) so that a test can walk through
several passes the way the controller does.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from preshard.api.models import parse_spec
from preshard.api.status import ShardedModelStatus
from preshard.builders.patching import ANNOTATION_OWNER
from preshard.builders.shardset import Owner
from preshard.contract import reasons
from preshard.contract.outcome import Outcome, exit_code
from preshard.controller import conditions
from preshard.controller.observe import JobView, PodView, TargetPodView, target_pod_view
from preshard.controller.plan import Event, Observed, Plan, Resource, plan
from preshard.settings import Settings

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SETTINGS = Settings(serializer_image="serializer:1", tools_image="tools:1", max_gpus_per_job=8)

BASE_SPEC: dict[str, Any] = {
    "model": {"id": "org/model", "revision": "abc123"},
    "storage": {"uri": "s3://bucket/shards", "credentialsSecretRef": {"name": "s3"}},
    "tensorParallelSizes": [2],
    "targets": [{"name": "vllm"}],
}


def deployment(name: str = "vllm", args: list[str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": "1",
            "generation": 1,
            "labels": {"app": name},
        },
        "spec": {
            "replicas": 2,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.34.0",
                            "command": ["vllm", "serve"],
                            "args": args or ["org/model", "--tensor-parallel-size", "1"],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ]
                },
            },
        },
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "availableReplicas": 2,
            "conditions": [progressing("True", "NewReplicaSetAvailable")],
        },
    }


# The line a patched target's message gives to the `--tensor-parallel-size 1` of `deployment()`.
OVERRIDDEN = (
    "\nchanged in the vLLM command line: replaced --tensor-parallel-size 1 with 2 "
    "(the shard set's TP size)"
)


def progressing(status: str, reason: str) -> dict[str, Any]:
    """The Deployment controller's Progressing condition."""
    messages = {
        "NewReplicaSetAvailable": 'ReplicaSet "vllm-5d8f" has successfully progressed.',
        "ReplicaSetUpdated": 'ReplicaSet "vllm-7c9b" is progressing.',
        "ProgressDeadlineExceeded": 'ReplicaSet "vllm-7c9b" has timed out progressing.',
    }
    return {"type": "Progressing", "status": status, "reason": reason, "message": messages[reason]}


class World:
    """A tiny stand-in for the API server: just enough state to run passes of `plan`."""

    def __init__(self, spec: dict[str, Any] = BASE_SPEC, **deployments: dict[str, Any]) -> None:
        self.spec = copy.deepcopy(spec)
        self.annotations: dict[str, str] = {}
        self.status = ShardedModelStatus()
        self.jobs: dict[str, JobView] = {}
        self.deployments = deployments or {"vllm": deployment()}
        self.pods: dict[str, tuple[TargetPodView, ...]] = {}
        self.now = NOW
        self.generation = 1
        self.last: Plan | None = None

    def step(self, **overrides: Any) -> Plan:
        observed = Observed(
            jobs=dict(self.jobs),
            deployments=copy.deepcopy(self.deployments),
            now=self.now,
            **{"target_pods": dict(self.pods), **overrides},
        )
        resource = Resource(
            owner=Owner(name="llama", namespace="ns", uid="uid-1"),
            generation=self.generation,
            annotations=self.annotations,
            spec=parse_spec(self.spec),
            status=self.status,
        )
        result = plan(resource, observed, SETTINGS)
        for manifest in result.create_jobs:
            name = manifest["metadata"]["name"]
            command = manifest["metadata"]["labels"]["preshard.dev/command"]
            self.jobs.setdefault(name, running(name, command))
        for name in result.delete_jobs:
            self.jobs.pop(name, None)
        for patch in result.patches:
            current = self.deployments[patch.name]
            updated = apply_json_patch(current, patch.patch)
            updated["metadata"]["resourceVersion"] = str(
                int(current["metadata"]["resourceVersion"]) + 1
            )
            updated["metadata"]["generation"] = current["metadata"]["generation"] + 1
            self.deployments[patch.name] = updated
        self.status = result.status
        self.last = result
        return result

    def finish(self, name: str, outcome: Outcome | None, *, exit_code_: int | None = None) -> None:
        job = self.jobs[name]
        ok = outcome.ok if outcome else exit_code_ == 0
        code = exit_code_ if exit_code_ is not None else (0 if ok else exit_code(outcome.reason))  # type: ignore[union-attr]
        pod = PodView(
            name=f"{name}-pod",
            created="2026-12-01T12:00:00Z",
            phase="Succeeded" if ok else "Failed",
            exit_code=code,
            message=outcome.to_message() if outcome else None,
        )
        self.jobs[name] = JobView(
            name=name,
            command=job.command,
            finished=True,
            succeeded=ok,
            condition_reason=None if ok else "BackoffLimitExceeded",
            condition_message="" if ok else "Job has reached the specified backoff limit",
            pods=(pod,),
        )

    def roll_out(self) -> None:
        """The Deployment controller finishes every rollout: every replica updated, available."""
        for item in self.deployments.values():
            replicas = item["spec"]["replicas"]
            item["status"] = {
                "observedGeneration": item["metadata"]["generation"],
                "replicas": replicas,
                "updatedReplicas": replicas,
                "availableReplicas": replicas,
                "conditions": [progressing("True", "NewReplicaSetAvailable")],
            }

    def start_rollout(self, name: str = "vllm") -> None:
        """The Deployment controller saw the new template: one new pod, not available yet, beside
        the old ones."""
        item = self.deployments[name]
        replicas = item["spec"]["replicas"]
        item["status"] = {
            "observedGeneration": item["metadata"]["generation"],
            "replicas": replicas + 1,
            "updatedReplicas": 1,
            "availableReplicas": replicas,
            "conditions": [progressing("True", "ReplicaSetUpdated")],
        }

    def exceed_deadline(self, name: str = "vllm") -> None:
        """The new pods never became available within `progressDeadlineSeconds`."""
        self.start_rollout(name)
        self.deployments[name]["status"]["conditions"] = [
            progressing("False", "ProgressDeadlineExceeded")
        ]

    def condition(self, type_: str) -> tuple[str, str]:
        found = conditions.find(self.status.conditions, type_)
        assert found is not None
        return found.status, found.reason

    def only_set(self) -> Any:
        (entry,) = self.status.shard_sets
        return entry


def running(name: str, command: str) -> JobView:
    return JobView(
        name=name,
        command=command,
        finished=False,
        succeeded=False,
        condition_reason=None,
        condition_message="",
        pods=(),
    )


def apply_json_patch(document: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902, the operations preshard uses, on plain dicts (as the API server would)."""
    result = copy.deepcopy(document)
    for op in ops:
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]
        ]
        node = result
        for part in parents:
            node = node[part]
        if op["op"] == "test":
            assert node[last] == op["value"], f"test of {op['path']} failed"
        elif op["op"] in ("add", "replace"):
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[last]
    return result


def verified(tp: int = 2, manifest_format: int = 2) -> Outcome:
    return Outcome(
        command="verify",
        ok=True,
        reason=reasons.VERIFIED,
        tensor_parallel_size=tp,
        total_bytes=1000,
        files=5,
        vllm_version="0.34.0",
        tensorizer_version="2.10.1",
        manifest_format=manifest_format,
    )


def failed(command: str, reason: str, message: str = "") -> Outcome:
    return Outcome(command=command, ok=False, reason=reason, message=message)  # type: ignore[arg-type]


def serialized() -> Outcome:
    return Outcome(command="serialize", ok=True, reason=reasons.SERIALIZED, total_bytes=1000)


def drive_to_verifying(world: World) -> None:
    """Probed, serialized, and its verify Job running."""
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    world.step()
    world.finish(world.only_set().job, serialized())
    world.step()


def drive_to_ready(world: World) -> None:
    drive_to_verifying(world)
    world.finish(world.only_set().job, verified())
    world.step()
    world.roll_out()
    world.step()


def test_a_new_resource_probes_before_it_serializes() -> None:
    world = World()
    result = world.step()
    (job,) = result.create_jobs
    assert job["metadata"]["labels"]["preshard.dev/command"] == "verify"
    assert world.only_set().stage == "Probing"
    assert world.condition(conditions.READY) == ("False", reasons.PROBING)
    assert result.patches == []
    # Every new set probes first: no event for that; what the probe finds is the news.
    assert result.events == []
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    result = world.step()
    assert [(e.type, e.reason) for e in result.events] == [("Normal", reasons.SERIALIZING)]


def test_an_existing_set_is_reused_without_a_gpu() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, verified())
    result = world.step()
    assert result.create_jobs == []
    entry = world.only_set()
    assert (entry.stage, entry.reason, entry.serialize_run) == (
        "Verified",
        reasons.ALREADY_SERIALIZED,
        0,
    )
    (patch,) = result.patches
    assert patch.name == "vllm"
    world.step()
    assert world.condition(conditions.READY) == ("False", reasons.ROLLING_OUT)
    world.roll_out()
    world.step()
    assert world.condition(conditions.READY) == ("True", reasons.READY)
    assert world.condition(conditions.SERIALIZED) == ("True", reasons.ALREADY_SERIALIZED)


def test_full_lifecycle_serialize_verify_patch_ready() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    result = world.step()
    (serialize,) = result.create_jobs
    assert serialize["metadata"]["name"].endswith("-serialize-1")
    assert world.only_set().stage == "Serializing"
    assert world.condition(conditions.SERIALIZED) == ("False", reasons.SERIALIZING)

    world.finish(world.only_set().job, serialized())
    result = world.step()
    (verify,) = result.create_jobs
    assert verify["metadata"]["name"].endswith("-verify-2")
    assert world.only_set().stage == "Verifying"
    assert world.condition(conditions.SERIALIZED) == ("True", reasons.SERIALIZED)
    assert world.condition(conditions.VERIFIED) == ("False", reasons.VERIFYING)

    world.finish(world.only_set().job, verified())
    result = world.step()
    assert [p.name for p in result.patches] == ["vllm"]
    assert world.only_set().stage == "Verified"
    assert world.only_set().next_check == "2026-12-01T13:00:00Z"
    (target,) = world.status.targets
    assert (target.state, target.reason, target.tensor_parallel_size, target.rollout) == (
        "RollingOut",
        reasons.ROLLING_OUT,
        2,
        "in progress",
    )
    assert world.condition(conditions.TARGETS_PATCHED) == ("True", reasons.PATCHED)
    assert world.condition(conditions.READY) == ("False", reasons.ROLLING_OUT)

    world.roll_out()
    converged = world.step()
    (target,) = world.status.targets
    assert (target.state, target.reason, target.rollout) == ("Patched", reasons.PATCHED, "complete")
    assert (converged.create_jobs, converged.patches, converged.delete_jobs) == ([], [], [])
    assert world.condition(conditions.READY) == ("True", reasons.READY)
    assert world.condition(conditions.TARGETS_PATCHED) == ("True", reasons.PATCHED)
    assert world.condition(conditions.DEGRADED) == ("False", reasons.AS_EXPECTED)
    args = world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--load-format" in args
    assert world.deployments["vllm"]["spec"]["replicas"] == 2


def test_planning_twice_on_one_observation_decides_the_same() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    snapshot = copy.deepcopy(world.status), dict(world.jobs)
    first = world.step()
    world.status, world.jobs = snapshot
    second = world.step()
    assert first.create_jobs == second.create_jobs
    assert first.status == second.status


def test_converged_resource_has_nothing_to_do_and_keeps_transition_times() -> None:
    world = World()
    drive_to_ready(world)
    before = world.status
    world.now = NOW + timedelta(minutes=5)
    result = world.step()
    assert (result.create_jobs, result.patches, result.events) == ([], [], [])
    assert result.status == before
    assert result.requeue_after == pytest.approx(55 * 60)


def test_bad_input_is_not_retried_and_a_retry_annotation_starts_over() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    world.step()
    world.finish(
        world.only_set().job,
        failed("serialize", reasons.INSUFFICIENT_SCRATCH, "needs 300 GiB, 100 GiB free"),
    )
    result = world.step()
    assert result.create_jobs == []
    entry = world.only_set()
    assert (entry.stage, entry.reason) == ("Failed", reasons.INSUFFICIENT_SCRATCH)
    assert world.condition(conditions.READY) == ("False", reasons.INSUFFICIENT_SCRATCH)
    assert "needs 300 GiB" in entry.message
    assert any(
        e.type == "Warning" and e.reason == reasons.INSUFFICIENT_SCRATCH for e in result.events
    )
    assert world.status.targets[0].state == "Waiting"
    assert world.step().create_jobs == []

    world.annotations["preshard.dev/retry"] = "1"
    result = world.step()
    (job,) = result.create_jobs
    assert job["metadata"]["name"].endswith("-serialize-2")
    assert world.step().create_jobs == []


def test_a_spec_change_starts_a_failed_set_over_even_with_the_same_key() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    world.step()
    world.finish(world.only_set().job, failed("serialize", reasons.OOM_KILLED, "OOMKilled"))
    world.step()
    key = world.only_set().artifact_key
    assert world.step().create_jobs == []
    world.spec["serialization"] = {"memory": "128Gi"}
    world.generation = 2
    (job,) = world.step().create_jobs
    assert job["metadata"]["name"].endswith("-serialize-2")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["memory"] == "128Gi"
    assert world.only_set().artifact_key == key
    assert world.step().create_jobs == []


def test_a_failed_job_without_a_message_reports_the_platform_reason() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    world.step()
    name = world.only_set().job
    world.jobs[name] = JobView(
        name=name,
        command="serialize",
        finished=True,
        succeeded=False,
        condition_reason="BackoffLimitExceeded",
        condition_message="Job has reached the specified backoff limit",
        pods=(
            PodView(
                name="p", created="t", phase="Failed", exit_code=137, terminated_reason="OOMKilled"
            ),
        ),
    )
    world.step()
    assert (world.only_set().stage, world.only_set().reason) == ("Failed", reasons.OOM_KILLED)


def test_unreachable_store_backs_off_and_retries() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.UNREACHABLE, "connect timeout"))
    result = world.step()
    assert result.create_jobs == []
    assert result.requeue_after == pytest.approx(30)
    entry = world.only_set()
    assert (entry.stage, entry.failures, entry.next_check) == ("Probing", 1, "2026-12-01T12:00:30Z")
    assert world.condition(conditions.DEGRADED) == ("True", reasons.UNREACHABLE)
    world.now = NOW + timedelta(seconds=31)
    (retry,) = world.step().create_jobs
    assert retry["metadata"]["name"].endswith("-verify-2")


def test_a_serialization_cut_off_from_the_store_is_run_again_a_few_times() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    world.step()
    for run in (1, 2):
        world.finish(world.only_set().job, failed("serialize", reasons.UNREACHABLE, "down"))
        result = world.step()
        assert result.create_jobs == []
        assert world.only_set().stage == "Serializing"
        world.now += timedelta(minutes=10)
        (again,) = world.step().create_jobs
        assert again["metadata"]["name"].endswith(f"-serialize-{run + 1}")
    world.finish(world.only_set().job, failed("serialize", reasons.UNREACHABLE, "down"))
    world.step()
    assert (world.only_set().stage, world.only_set().reason) == ("Failed", reasons.UNREACHABLE)


def test_a_missing_secret_is_reported_while_the_job_waits() -> None:
    world = World()
    world.step()
    name = world.only_set().job
    world.jobs[name] = JobView(
        name=name,
        command="verify",
        finished=False,
        succeeded=False,
        condition_reason=None,
        condition_message="",
        pods=(
            PodView(
                name="p",
                created="t",
                phase="Pending",
                waiting_reason="CreateContainerConfigError",
                waiting_message='secret "s3" not found',
            ),
        ),
    )
    world.step()
    assert world.only_set().reason == reasons.SECRET_NOT_FOUND
    assert world.condition(conditions.READY)[1] == reasons.SECRET_NOT_FOUND


def test_a_shard_missing_after_ready_is_detected_and_nothing_is_repointed() -> None:
    world = World()
    drive_to_ready(world)
    patched = copy.deepcopy(world.deployments)
    world.now = NOW + timedelta(hours=1, seconds=1)
    (check,) = world.step().create_jobs
    assert check["metadata"]["name"].endswith("-verify-3")
    assert world.condition(conditions.READY) == ("True", reasons.READY)
    world.finish(world.only_set().job, failed("verify", reasons.SHARD_MISSING, "model-rank-001"))
    result = world.step()
    assert result.patches == []
    assert world.deployments == patched
    assert world.condition(conditions.READY) == ("False", reasons.SHARD_MISSING)
    assert world.condition(conditions.DEGRADED) == ("True", reasons.SHARD_MISSING)


def test_tp_larger_than_a_node_is_refused_without_a_job() -> None:
    world = World({**BASE_SPEC, "tensorParallelSizes": [16]})
    result = world.step()
    assert result.create_jobs == []
    assert world.condition(conditions.READY) == ("False", reasons.TP_EXCEEDS_GPUS)


def test_target_missing_then_appearing() -> None:
    world = World()
    world.deployments = {}
    drive_to_ready(world)
    assert world.status.targets[0].state == "NotFound"
    assert world.condition(conditions.READY) == ("False", reasons.TARGET_NOT_FOUND)
    world.deployments = {"vllm": deployment()}
    assert [p.name for p in world.step().patches] == ["vllm"]
    world.roll_out()
    world.step()
    assert world.condition(conditions.READY) == ("True", reasons.READY)


def test_a_deployment_owned_by_another_resource_is_a_conflict() -> None:
    world = World()
    other = deployment()
    other["metadata"]["annotations"] = {ANNOTATION_OWNER: "someone-else"}
    world.deployments = {"vllm": other}
    drive_to_ready(world)
    assert world.last is not None
    assert world.last.patches == []
    assert world.status.targets[0].state == "Conflict"
    assert world.condition(conditions.READY) == ("False", reasons.TARGET_CONFLICT)


def test_an_unsafe_shell_command_is_refused() -> None:
    world = World()
    world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0].update(
        {"command": ["/bin/sh", "-c"], "args": ["pip install x && vllm serve org/model"]}
    )
    drive_to_ready(world)
    assert world.status.targets[0].state == "Refused"
    assert world.condition(conditions.READY) == ("False", reasons.UNSUPPORTED_COMMAND)


def test_hand_edits_are_reasserted() -> None:
    world = World()
    drive_to_ready(world)
    container = world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    args[args.index("--tensor-parallel-size") + 1] = "4"
    (patch,) = world.step().patches
    assert patch.name == "vllm"
    fixed = world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert fixed[fixed.index("--tensor-parallel-size") + 1] == "2"
    assert world.step().patches == []


def test_changing_tp_builds_the_new_set_before_switching() -> None:
    world = World({**BASE_SPEC, "storage": {**BASE_SPEC["storage"], "retention": "Delete"}})
    drive_to_ready(world)
    old_key = world.only_set().artifact_key
    world.spec["tensorParallelSizes"] = [4]
    world.generation = 2
    result = world.step()
    (probe,) = result.create_jobs
    assert probe["metadata"]["annotations"]["preshard.dev/tensor-parallel-size"] == "4"
    assert result.patches == []
    (target,) = world.status.targets
    assert (target.state, target.artifact_key) == ("Waiting", old_key)
    assert {e.stage for e in world.status.shard_sets} == {"Probing", "Superseded"}

    new = next(e for e in world.status.shard_sets if e.tensor_parallel_size == 4)
    assert new.job is not None, "the new set is being probed by a Job"
    world.finish(new.job, verified(4))
    result = world.step()
    assert [p.name for p in result.patches] == ["vllm"]
    args = world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert world.step().create_jobs == [], "old pods still load the old set"
    world.roll_out()
    (delete,) = world.step().create_jobs
    assert delete["metadata"]["labels"]["preshard.dev/command"] == "delete"
    old = next(e for e in world.status.shard_sets if e.artifact_key == old_key)
    assert old.job is not None, "the old set is being deleted by a Job"
    world.finish(old.job, Outcome(command="delete", ok=True, reason=reasons.DELETED))
    world.step()
    world.step()
    assert [e.tensor_parallel_size for e in world.status.shard_sets] == [4]
    assert world.condition(conditions.READY) == ("True", reasons.READY)


def test_a_set_another_resource_uses_is_released_not_deleted() -> None:
    world = World({**BASE_SPEC, "storage": {**BASE_SPEC["storage"], "retention": "Delete"}})
    drive_to_ready(world)
    old_key = world.only_set().artifact_key
    old_uri = world.only_set().uri
    world.spec["model"]["revision"] = "def456"
    world.step(sets_used_elsewhere=frozenset({old_uri}))
    new = next(e for e in world.status.shard_sets if e.artifact_key != old_key)
    assert new.job is not None, "the new set is being probed by a Job"
    world.finish(new.job, verified())
    world.step(sets_used_elsewhere=frozenset({old_uri}))
    world.roll_out()
    result = world.step(sets_used_elsewhere=frozenset({old_uri}))
    assert result.create_jobs == []
    assert any(e.reason == reasons.RELEASED for e in result.events)
    assert [e.artifact_key for e in world.status.shard_sets] == [new.artifact_key]


def test_a_target_removed_from_the_spec_is_restored() -> None:
    world = World()
    original = copy.deepcopy(world.deployments["vllm"])
    drive_to_ready(world)
    world.spec["targets"] = []
    (patch,) = world.step().patches
    assert patch.restore
    restored = world.deployments["vllm"]
    for key in ("spec",):
        assert restored[key] == original[key]
    assert restored["metadata"].get("annotations", {}) == {}
    assert world.condition(conditions.TARGETS_PATCHED) == ("True", reasons.NO_TARGETS)


def test_selector_targets_every_matching_deployment() -> None:
    spec = {**BASE_SPEC, "targets": [{"selector": {"matchLabels": {"tier": "serving"}}}]}
    first, second, other = deployment("a"), deployment("b"), deployment("c")
    for item in (first, second):
        item["metadata"]["labels"]["tier"] = "serving"
    world = World(spec, a=first, b=second, c=other)
    drive_to_ready(world)
    assert [t.name for t in world.status.targets] == ["a", "b"]
    assert world.condition(conditions.READY) == ("True", reasons.READY)
    assert "annotations" not in world.deployments["c"]["metadata"]


# Targets serve once their rollout completes -------------------------------------------------

CRASH = (
    "RuntimeError: CUDA error: out of memory while loading model-rank-001.tensors "
    "AWS_SECRET_ACCESS_KEY=hunter2"
)


def patched_pod(
    item: dict[str, Any], name: str, *, crash: str | None = None, template_hash: str = "7c9b"
) -> TargetPodView:
    """A pod the Deployment's current template makes, crash-looping with `crash` if given."""
    pod_spec = copy.deepcopy(item["spec"]["template"]["spec"])
    statuses: list[dict[str, Any]] = [
        {"name": c["name"], "ready": crash is None, "restartCount": 0, "state": {"running": {}}}
        for c in pod_spec["containers"]
    ]
    if crash is not None:
        statuses[0].update(
            restartCount=3,
            state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
            lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": crash}},
        )
    pod = {
        "metadata": {
            "name": name,
            "creationTimestamp": "2026-12-01T12:00:00Z",
            "labels": {"app": "vllm", "pod-template-hash": template_hash},
            "ownerReferences": [
                {"kind": "ReplicaSet", "name": f"vllm-{template_hash}", "controller": True}
            ],
        },
        "spec": pod_spec,
        "status": {"phase": "Running", "containerStatuses": statuses},
    }
    view = target_pod_view(pod)
    assert view is not None
    return view


def patch_and_restore_spec(policy: str) -> dict[str, Any]:
    return {**BASE_SPEC, "targets": [{"name": "vllm", "onRolloutFailure": policy}]}


def drive_to_patched(world: World) -> str:
    """Verify the set and patch the Deployment, without finishing its rollout; the set's URI."""
    world.step()
    world.finish(world.only_set().job, verified())
    assert [p.name for p in world.step().patches] == ["vllm"]
    return str(world.only_set().uri)


def target_of(world: World) -> tuple[str, str, str | None]:
    (state,) = world.status.targets
    return state.state, state.reason, state.rollout


def test_ready_waits_until_every_replica_runs_the_patched_template() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, verified())
    result = world.step()
    uri = world.only_set().uri
    assert [p.name for p in result.patches] == ["vllm"]
    assert target_of(world) == ("RollingOut", reasons.ROLLING_OUT, "in progress")
    assert world.condition(conditions.READY) == ("False", reasons.ROLLING_OUT)
    assert world.condition(conditions.TARGETS_PATCHED) == ("True", reasons.PATCHED)
    assert [e for e in result.events if e.message.startswith("Deployment")] == [
        Event("Warning", reasons.ARGS_OVERRIDDEN, f"Deployment vllm: {OVERRIDDEN[1:]}", "vllm"),
        Event(
            "Normal",
            reasons.ROLLING_OUT,
            f"Deployment vllm: rolling out the patched template that loads {uri}{OVERRIDDEN}",
            "vllm",
        ),
    ]

    # The Deployment controller starts the rollout: the new pod is not available yet, and the
    # old ones still serve. Nothing changes in the status, so nothing is written.
    before = world.status
    world.start_rollout()
    world.pods = {"vllm": (patched_pod(world.deployments["vllm"], "vllm-7c9b-a"),)}
    result = world.step()
    assert (result.patches, result.events, result.status) == ([], [], before)

    # Every replica updated, but one old pod is still counted: not complete yet.
    status = world.deployments["vllm"]["status"]
    status.update(updatedReplicas=2, availableReplicas=2, replicas=3)
    assert world.step().status == before

    world.roll_out()
    result = world.step()
    assert target_of(world) == ("Patched", reasons.PATCHED, "complete")
    assert world.condition(conditions.READY) == ("True", reasons.READY)
    assert result.events == [], "the rollout the patch event announced is no news"


def test_a_deployment_not_yet_seen_by_its_controller_is_still_rolling_out() -> None:
    world = World()
    drive_to_patched(world)
    # Counts from the old template look complete, but the controller has not seen the new one.
    assert world.deployments["vllm"]["status"]["observedGeneration"] == 1
    assert world.deployments["vllm"]["metadata"]["generation"] == 2
    world.step()
    assert target_of(world) == ("RollingOut", reasons.ROLLING_OUT, "in progress")


def test_a_deployment_scaled_to_zero_is_ready_and_serves_nothing() -> None:
    world = World()
    world.deployments["vllm"]["spec"]["replicas"] = 0
    world.deployments["vllm"]["status"] = {"observedGeneration": 1}
    uri = drive_to_patched(world)
    world.roll_out()
    result = world.step()
    (state,) = world.status.targets
    assert (state.state, state.reason, state.rollout, state.message) == (
        "Patched",
        reasons.SCALED_TO_ZERO,
        "scaled to zero",
        f"loads {uri}; scaled to zero replicas, it serves nothing{OVERRIDDEN}",
    )
    assert world.condition(conditions.READY) == ("True", reasons.READY)
    assert result.events == [], "the rollout the patch event announced is no news"


def test_a_crash_looping_patched_pod_makes_the_target_unavailable() -> None:
    world = World()
    uri = drive_to_patched(world)
    world.start_rollout()
    current = world.deployments["vllm"]
    world.pods = {
        "vllm": (
            patched_pod(current, "vllm-7c9b-ok"),
            patched_pod(current, "vllm-7c9b-bad", crash=CRASH),
        )
    }
    result = world.step()
    expected = (
        f"patched pods of {uri} fail: pod vllm-7c9b-bad container vllm: CrashLoopBackOff, "
        "exit code 1: RuntimeError: CUDA error: out of memory while loading "
        "model-rank-001.tensors AWS_SECRET_ACCESS_KEY=<redacted>" + OVERRIDDEN
    )
    (state,) = world.status.targets
    assert (state.state, state.reason, state.message) == (
        "Unavailable",
        reasons.TARGET_UNAVAILABLE,
        expected,
    )
    assert world.condition(conditions.READY) == ("False", reasons.TARGET_UNAVAILABLE)
    assert world.condition(conditions.TARGETS_PATCHED) == ("True", reasons.PATCHED)
    assert result.events == [
        Event("Warning", reasons.TARGET_UNAVAILABLE, f"Deployment vllm: {expected}", "vllm")
    ]
    assert "hunter2" not in world.status.model_dump_json()
    assert result.patches == [], "the patched template stays (policy Keep)"
    assert world.step().events == [], "one event per transition"

    # The pods become ready: serving again, and that is news.
    world.pods = {"vllm": (patched_pod(current, "vllm-7c9b-ok"),)}
    world.roll_out()
    result = world.step()
    assert target_of(world) == ("Patched", reasons.PATCHED, "complete")
    assert result.events == [
        Event("Normal", reasons.PATCHED, f"Deployment vllm: loads {uri}{OVERRIDDEN}", "vllm")
    ]


def test_a_crashing_pod_of_another_template_is_not_the_patched_one() -> None:
    world = World()
    drive_to_patched(world)
    world.start_rollout()
    before = copy.deepcopy(world.deployments["vllm"])
    container = before["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [*container["args"], "--enforce-eager"]
    world.pods = {
        "vllm": (patched_pod(before, "vllm-1111-bad", crash=CRASH, template_hash="1111"),)
    }
    world.step()
    assert target_of(world) == ("RollingOut", reasons.ROLLING_OUT, "in progress")


def test_a_rollout_past_its_deadline_keeps_the_patch_by_default() -> None:
    world = World()
    uri = drive_to_patched(world)
    world.exceed_deadline()
    result = world.step()
    (state,) = world.status.targets
    assert (state.state, state.reason, state.rollout, state.message) == (
        "Unavailable",
        reasons.TARGET_UNAVAILABLE,
        "failed",
        f"the rollout of {uri} exceeded its progress deadline "
        f'(ReplicaSet "vllm-7c9b" has timed out progressing.){OVERRIDDEN}',
    )
    assert result.patches == []
    assert world.condition(conditions.READY) == ("False", reasons.TARGET_UNAVAILABLE)
    assert world.step().patches == []


def test_a_rollout_past_its_deadline_is_restored_once_with_policy_restore() -> None:
    world = World(patch_and_restore_spec("Restore"))
    original = copy.deepcopy(world.deployments["vllm"]["spec"]["template"])
    uri = drive_to_patched(world)
    key = world.only_set().artifact_key
    world.exceed_deadline()
    world.pods = {"vllm": (patched_pod(world.deployments["vllm"], "vllm-7c9b-x", crash=CRASH),)}
    stalled = copy.deepcopy(world.deployments)
    result = world.step()
    (patch,) = result.patches
    assert patch.restore
    assert world.deployments["vllm"]["spec"]["template"] == original
    annotations = world.deployments["vllm"]["metadata"].get("annotations") or {}
    assert not [k for k in annotations if k.startswith("preshard.dev/")]
    (state,) = world.status.targets
    message = (
        f"the rollout of {uri} exceeded its progress deadline (pod vllm-7c9b-x container vllm: "
        "CrashLoopBackOff, exit code 1: RuntimeError: CUDA error: out of memory while loading "
        "model-rank-001.tensors AWS_SECRET_ACCESS_KEY=<redacted>); the original template is "
        "restored. A spec change or a new preshard.dev/retry value patches it again"
    )
    assert state.model_dump(exclude_none=True) == {
        "name": "vllm",
        "container": "vllm",
        "tensor_parallel_size": 2,
        "state": "RolledBack",
        "reason": reasons.ROLLOUT_FAILED,
        "message": message,
        "rollout": "restored",
        "failed_artifact_key": key,
        "failed_generation": 1,
    }
    assert world.condition(conditions.READY) == ("False", reasons.ROLLOUT_FAILED)
    assert world.condition(conditions.TARGETS_PATCHED) == ("False", reasons.ROLLOUT_FAILED)
    assert [(e.type, e.reason) for e in result.events] == [
        ("Warning", reasons.ROLLOUT_FAILED),
        ("Normal", reasons.RESTORED),
    ]

    # A pass planned from an index that does not show the restore yet plans the same restore
    # (the reconciler does not send it twice) and nothing else.
    restored = world.status
    world.pods = {}
    world.deployments = copy.deepcopy(stalled)
    lagging = world.step()
    assert [p.restore for p in lagging.patches] == [True]
    assert lagging.status == restored

    # Restored, it is not patched again for the same set and spec.
    world.roll_out()
    before = world.status
    for _ in range(2):
        quiet = world.step()
        assert (quiet.patches, quiet.events, quiet.status) == ([], [], before)

    # A new value of the retry annotation patches it again.
    world.annotations["preshard.dev/retry"] = "1"
    again = world.step()
    assert [p.restore for p in again.patches] == [False]
    assert target_of(world) == ("RollingOut", reasons.ROLLING_OUT, "in progress")

    # Failing again under that token, it is restored; a newer spec generation tries again.
    world.exceed_deadline()
    assert [p.restore for p in world.step().patches] == [True]
    assert world.status.targets[0].retry_token == "1"
    world.roll_out()
    assert world.step().patches == []
    world.generation = 2
    assert [p.restore for p in world.step().patches] == [False]


def set_at(world: World, tp: int) -> Any:
    return next(e for e in world.status.shard_sets if e.tensor_parallel_size == tp)


def resharded() -> Outcome:
    return Outcome(command="reshard", ok=True, reason=reasons.RESHARDED, total_bytes=1000)


def add_tp_4(world: World) -> tuple[str, Any, Plan]:
    """Ready at TP 2, then the spec asks for TP 4 too: the TP 2 key, the TP 4 entry once its
    probe found nothing, and the plan of that pass."""
    drive_to_ready(world)
    source = world.only_set().artifact_key
    result = ask_for_tp_4(world)
    return source, set_at(world, 4), result


def ask_for_tp_4(world: World) -> Plan:
    """The spec asks for TP 4 beside TP 2 and the TP 4 probe finds nothing: the plan of the
    pass that reads that probe."""
    world.spec["tensorParallelSizes"] = [2, 4]
    world.generation = 2
    world.step()
    world.finish(set_at(world, 4).job, failed("verify", reasons.MANIFEST_MISSING))
    return world.step()


def test_a_new_tp_size_is_resharded_on_cpu_from_a_verified_set() -> None:
    world = World()
    source, entry, result = add_tp_4(world)
    (job,) = result.create_jobs
    assert job["metadata"]["name"].endswith("-reshard-1")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:4] == [
        "reshard",
        f"s3://bucket/shards/{source}/",
        "--to-tensor-parallel-size",
        "4",
    ]
    assert not any("gpu" in name for name in container["resources"]["requests"])
    assert (entry.stage, entry.reason, entry.resharded_from, entry.serialize_run) == (
        "Resharding",
        reasons.RESHARDING,
        source,
        0,
    )
    assert f"resharding on CPU from the TP 2 set {source}" in entry.message
    assert world.condition(conditions.SERIALIZED) == ("False", reasons.RESHARDING)
    assert [e.reason for e in result.events] == [reasons.RESHARDING]

    world.finish(entry.job, resharded())
    (verify,) = world.step().create_jobs
    assert verify["metadata"]["labels"]["preshard.dev/command"] == "verify"
    new = set_at(world, 4)
    assert new.stage == "Verifying"
    world.finish(new.job, verified(4))
    world.step()
    new = set_at(world, 4)
    assert (new.stage, new.reason, new.reshard_run, new.serialize_run) == (
        "Verified",
        reasons.VERIFIED,
        1,
        0,
    )
    assert new.message.startswith(f"resharded on CPU from {source}; ")
    assert not any(name.endswith("-serialize-2") for name in world.jobs)


def test_a_refused_reshard_falls_back_to_the_gpu_job() -> None:
    world = World()
    _, entry, _ = add_tp_4(world)
    world.finish(
        entry.job, failed("reshard", reasons.RESHARD_UNSUPPORTED, "Qwen2ForCausalLM: not supported")
    )
    result = world.step()
    (serialize,) = result.create_jobs
    assert serialize["metadata"]["name"].endswith("-serialize-1")
    entry = set_at(world, 4)
    assert (entry.stage, entry.reason, entry.resharded_from) == (
        "Serializing",
        reasons.SERIALIZING,
        None,
    )
    fallback = next(e for e in result.events if e.reason == reasons.RESHARD_UNSUPPORTED)
    assert fallback.type == "Normal"
    assert "serializing on GPUs instead: Qwen2ForCausalLM: not supported" in fallback.message


def test_a_reshard_that_fails_otherwise_falls_back_with_a_warning() -> None:
    world = World()
    _, entry, _ = add_tp_4(world)
    world.finish(entry.job, None, exit_code_=137)
    result = world.step()
    assert [j["metadata"]["name"].rsplit("-", 2)[-2] for j in result.create_jobs] == ["serialize"]
    (warning,) = [e for e in result.events if e.type == "Warning"]
    assert "reshard from" in warning.message


def test_reshard_off_serializes_every_tp_size_on_gpus() -> None:
    world = World({**BASE_SPEC, "serialization": {"reshard": False}})
    _, entry, _ = add_tp_4(world)
    assert entry.stage == "Serializing"
    assert entry.job is not None
    assert entry.job.endswith("-serialize-1")


def test_a_set_of_another_revision_is_no_reshard_source() -> None:
    world = World()
    drive_to_ready(world)
    world.spec["model"]["revision"] = "def456"
    world.spec["tensorParallelSizes"] = [4]
    world.spec["targets"] = [{"name": "vllm", "tensorParallelSize": 4}]
    world.generation = 2
    world.step()
    new = set_at(world, 4)
    world.finish(new.job, failed("verify", reasons.MANIFEST_MISSING))
    (job,) = world.step().create_jobs
    assert job["metadata"]["name"].endswith("-serialize-1")


def test_a_superseded_set_still_loaded_is_a_reshard_source() -> None:
    world = World()
    drive_to_ready(world)
    source = world.only_set().artifact_key
    world.spec["tensorParallelSizes"] = [4]
    world.spec["targets"] = [{"name": "vllm", "tensorParallelSize": 4}]
    world.generation = 2
    world.step()
    assert {e.stage for e in world.status.shard_sets} == {"Probing", "Superseded"}
    new = set_at(world, 4)
    world.finish(new.job, failed("verify", reasons.MANIFEST_MISSING))
    (job,) = world.step().create_jobs
    assert job["metadata"]["name"].endswith("-reshard-1")
    new = set_at(world, 4)
    assert new.resharded_from == source


def add_tp_4_while_tp_2_is_verified(world: World) -> tuple[str, Plan]:
    """TP 2 serialized and its verify Job running when the spec asks for TP 4 too (`Serialized`
    is True then, and a person adds a TP size): the TP 2 key, and the plan of the pass that
    read TP 4's probe."""
    drive_to_verifying(world)
    assert world.condition(conditions.SERIALIZED)[0] == "True"
    source = world.only_set().artifact_key
    return source, ask_for_tp_4(world)


def test_a_new_tp_size_waits_for_a_set_being_verified_and_reshards_from_it() -> None:
    world = World()
    source, result = add_tp_4_while_tp_2_is_verified(world)
    assert result.create_jobs == []
    waiting = set_at(world, 4)
    assert (waiting.stage, waiting.reason) == ("Probing", reasons.WAITING_FOR_SOURCE)
    assert waiting.message == (
        f"not in storage; waits for the TP 2 set {source}, being verified now, "
        "to reshard from it on CPU"
    )
    assert [(e.type, e.reason) for e in result.events] == [("Normal", reasons.WAITING_FOR_SOURCE)]
    # Waiting is converged: the same observation decides nothing new and writes nothing.
    before = world.status
    quiet = world.step()
    assert (quiet.create_jobs, quiet.events, quiet.status) == ([], [], before)

    # The pass that reads the TP 2 verification still sees it being verified; the next reshards.
    world.finish(set_at(world, 2).job, verified())
    assert world.step().create_jobs == []
    assert set_at(world, 2).stage == "Verified"
    (job,) = world.step().create_jobs
    assert job["metadata"]["name"].endswith("-reshard-1")
    entry = set_at(world, 4)
    assert (entry.stage, entry.resharded_from, entry.serialize_run) == ("Resharding", source, 0)


def test_a_new_tp_size_serializes_when_the_set_it_waited_for_is_broken() -> None:
    world = World()
    add_tp_4_while_tp_2_is_verified(world)
    world.finish(set_at(world, 2).job, failed("verify", reasons.SHARD_MISSING, "rank 1 missing"))
    world.step()
    assert set_at(world, 2).stage == "Failed"
    (job,) = world.step().create_jobs
    assert job["metadata"]["name"].endswith("-serialize-1")
    assert set_at(world, 4).stage == "Serializing"


def test_a_set_backing_off_from_its_verification_is_not_waited_for() -> None:
    world = World()
    drive_to_verifying(world)
    world.finish(world.only_set().job, failed("verify", reasons.UNREACHABLE, "connection refused"))
    world.step()
    assert (world.only_set().stage, world.only_set().job) == ("Verifying", None)
    (job,) = ask_for_tp_4(world).create_jobs
    assert job["metadata"]["name"].endswith("-serialize-1")


def test_a_reshard_job_deleted_under_the_operator_is_created_again() -> None:
    world = World()
    _, entry, _ = add_tp_4(world)
    del world.jobs[entry.job]
    (again,) = world.step().create_jobs
    assert again["metadata"]["name"] == entry.job
    assert again["spec"]["template"]["spec"]["containers"][0]["args"][0] == "reshard"


def test_a_running_job_the_status_never_recorded_is_taken_over() -> None:
    """The operator stopped between creating a Job and writing the status that names it: the
    next operator finds the Job running and takes it over instead of starting a second run."""
    world = World()
    (probe,) = world.step().create_jobs
    world.status = ShardedModelStatus()
    assert [j["metadata"]["name"] for j in world.step().create_jobs] == [probe["metadata"]["name"]]
    assert (world.only_set().job, world.only_set().verify_run) == (probe["metadata"]["name"], 1)

    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    before = world.status
    (serialize,) = world.step().create_jobs
    name = serialize["metadata"]["name"]
    assert name.endswith("-serialize-1")
    world.status = before
    assert [j["metadata"]["name"] for j in world.step().create_jobs] == [name]
    entry = world.only_set()
    assert (entry.stage, entry.job, entry.serialize_run) == ("Serializing", name, 1)

    # Once it has finished it is no longer taken over: its result may be of an earlier life
    # of the set (see below), so a run of its own starts.
    world.finish(name, serialized())
    world.status = before
    (again,) = world.step().create_jobs
    assert again["metadata"]["name"].endswith("-serialize-2")


def test_a_set_released_and_wanted_again_gets_jobs_of_its_own() -> None:
    """The churn case: a TP size dropped while its probe ran (its Job deleted, its entry
    released) and asked for again must not wait for the old Job, which no longer runs."""
    world = World({**BASE_SPEC, "tensorParallelSizes": [2, 4]})
    world.step()
    old = set_at(world, 4)
    world.spec["tensorParallelSizes"] = [2]
    world.generation = 2
    released = world.step()
    assert old.job in released.delete_jobs
    world.jobs[old.job] = replace(running(old.job, "verify"), deleting=True)
    world.spec["tensorParallelSizes"] = [2, 4]
    world.generation = 3
    (probe,) = [j for j in world.step().create_jobs if "-verify-" in j["metadata"]["name"]]
    assert probe["metadata"]["name"] == old.job.replace("-verify-1", "-verify-2")
    assert set_at(world, 4).job == probe["metadata"]["name"]


def test_a_job_deleted_under_a_set_is_followed_by_the_next_run() -> None:
    world = World()
    world.step()
    probe = world.only_set().job
    world.jobs[probe] = replace(world.jobs[probe], deleting=True)
    (again,) = world.step().create_jobs
    assert again["metadata"]["name"] == probe.replace("-verify-1", "-verify-2")
    assert world.only_set().verify_run == 2


@pytest.mark.parametrize("index_lags", [False, True], ids=["gone", "still-listed"])
def test_a_name_deleted_a_moment_ago_is_not_used_again(index_lags: bool) -> None:
    """The Job controller would not start a pod for a new Job under such a name for minutes.
    While the index still lists the Job as running, it is not taken over either."""
    world = World({**BASE_SPEC, "tensorParallelSizes": [2, 4]})
    world.step()
    old = set_at(world, 4).job
    world.spec["tensorParallelSizes"] = [2]
    world.generation = 2
    world.step()
    assert old not in world.jobs, "deleted, and gone from the index"
    if index_lags:
        world.jobs[old] = running(old, "verify")
    world.spec["tensorParallelSizes"] = [2, 4]
    world.generation = 3
    result = world.step(deleted_jobs=frozenset({old}))
    assert set_at(world, 4).job == old.replace("-verify-1", "-verify-2")
    assert old not in [j["metadata"]["name"] for j in result.create_jobs]


def test_a_set_dropped_while_probed_and_wanted_again_is_probed_again() -> None:
    """A loaded set dropped while a probe of it ran keeps its stage (its target still loads it)
    but loses its Job; wanted again, it must not wait for that Job."""
    world = World()
    drive_to_ready(world)
    loaded = world.only_set().artifact_key

    def want(tp: int) -> None:
        world.spec["tensorParallelSizes"] = [tp]
        world.spec["targets"] = [{"name": "vllm", "tensorParallelSize": tp}]
        world.generation += 1
        world.step()

    want(4)
    want(2)
    entry = set_at(world, 2)
    assert (entry.artifact_key, entry.stage) == (loaded, "Probing")
    want(4)
    entry = set_at(world, 2)
    assert (entry.stage, entry.job) == ("Probing", None), "kept for its target, Job stopped"
    want(2)
    entry = set_at(world, 2)
    assert entry.job is not None
    assert entry.job in world.jobs


def test_a_running_jobs_progress_shows_in_its_set_and_goes_when_it_ends() -> None:
    world = World()
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.MANIFEST_MISSING))
    world.step()
    job = world.only_set().job
    step = "upload 35% of 14.96 GiB, 420 MB/s, about 25 s left"
    world.step(progress={job: step})
    assert (world.only_set().progress, world.only_set().message) == (
        step,
        f"Job {job} is running",
    )
    assert world.step(progress={}).status == world.status, "a log not read now is no step back"
    assert world.only_set().progress == step
    world.finish(job, serialized())
    world.step(progress={job: step})
    assert world.only_set().progress is None
