"""The planner's side of overrides, restores that keep the user's edits, and Deployments that
another controller owns (the `World` of `test_plan` plays the cluster)."""

from __future__ import annotations

import copy
from typing import Any

from preshard.contract import reasons
from preshard.controller import conditions
from preshard.controller.plan import Event
from tests.unit.test_plan import BASE_SPEC, OVERRIDDEN, World, deployment, drive_to_ready


def container(world: World) -> dict[str, Any]:
    item: dict[str, Any] = world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]
    return item


def test_the_override_line_is_announced_once_and_stays_in_the_message() -> None:
    world = World()
    drive_to_ready(world)
    (state,) = world.status.targets
    assert state.message.endswith(OVERRIDDEN)
    assert world.step().events == []


def test_a_new_override_is_announced_again() -> None:
    world = World()
    drive_to_ready(world)
    # The user adds a tensorizer key of their own to the patched Deployment: it is merged, and
    # that is a change of their command line to report.
    args = container(world)["args"]
    at = args.index("--model-loader-extra-config") + 1
    args[at] = args[at][:-1] + ',"vllm_tensorized":true}'
    first = world.step()
    line = (
        "changed in the vLLM command line: replaced --tensor-parallel-size 1 with 2 (the "
        "shard set's TP size); --model-loader-extra-config: kept your vllm_tensorized"
    )
    assert [e for e in first.events if e.reason == reasons.ARGS_OVERRIDDEN] == [
        Event("Warning", reasons.ARGS_OVERRIDDEN, f"Deployment vllm: {line}", "vllm")
    ]
    assert world.status.targets[0].message.endswith(line)
    assert world.step().events == []


def test_no_override_no_line() -> None:
    world = World(
        vllm=deployment(args=["org/model", "--tensor-parallel-size", "2", "--port", "8000"])
    )
    drive_to_ready(world)
    (state,) = world.status.targets
    assert "changed in the vLLM command line" not in state.message
    assert all(e.reason != reasons.ARGS_OVERRIDDEN for e in world.step().events)


def test_a_dropped_target_keeps_the_users_edits_and_names_what_of_preshards_it_kept() -> None:
    world = World()
    original = copy.deepcopy(world.deployments["vllm"])
    drive_to_ready(world)
    vllm = container(world)
    vllm["args"] += ["--max-num-seqs", "8"]
    vllm["env"].append({"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"})
    vllm["resources"]["limits"]["nvidia.com/gpu"] = "4"
    world.spec["targets"] = []
    world.generation = 2
    result = world.step()
    (patch,) = result.patches
    assert (patch.restore, patch.kept) == (True, ("resources.limits nvidia.com/gpu",))
    assert (
        Event(
            "Warning",
            reasons.RESTORED,
            "Deployment vllm restored; kept your own changes to what preshard had set: "
            "resources.limits nvidia.com/gpu",
            "vllm",
        )
        in result.events
    )
    restored = world.deployments["vllm"]["spec"]["template"]
    expected = copy.deepcopy(original["spec"]["template"])
    wanted = expected["spec"]["containers"][0]
    wanted["args"] += ["--max-num-seqs", "8"]
    wanted["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    wanted["resources"] = {"limits": {"nvidia.com/gpu": "4"}}
    assert restored == expected


def test_a_restore_without_kept_changes_is_a_normal_event() -> None:
    world = World()
    drive_to_ready(world)
    world.spec["targets"] = []
    world.generation = 2
    result = world.step()
    assert Event("Normal", reasons.RESTORED, "Deployment vllm restored", "vllm") in result.events


def owned_by_a_controller() -> dict[str, Any]:
    item = deployment()
    item["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": "llama",
            "uid": "lws-1",
            "controller": True,
        }
    ]
    return item


def test_a_deployment_another_controller_owns_is_refused() -> None:
    world = World(vllm=owned_by_a_controller())
    drive_to_ready(world)
    assert world.last is not None
    assert world.last.patches == []
    (state,) = world.status.targets
    assert (state.state, state.reason) == ("Refused", reasons.TARGET_MANAGED_BY_CONTROLLER)
    assert "controlled by LeaderWorkerSet llama" in state.message
    assert world.condition(conditions.READY) == ("False", reasons.TARGET_MANAGED_BY_CONTROLLER)


def test_allow_controller_owned_patches_it() -> None:
    spec = {**BASE_SPEC, "targets": [{"name": "vllm", "allowControllerOwned": True}]}
    world = World(spec, vllm=owned_by_a_controller())
    drive_to_ready(world)
    assert world.condition(conditions.READY) == ("True", reasons.READY)
