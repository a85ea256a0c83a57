"""A patch something keeps reverting (Argo CD or Flux self-heal) is written three times, then
refused with TargetReverted, from what the Deployment and the status record; a new spec
generation or retry value tries again."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

from preshard.builders.patching import ANNOTATION_INPUT_HASH, ANNOTATION_PATCH_ROUNDS
from preshard.contract import reasons
from preshard.controller import conditions
from preshard.controller.plan import ANNOTATION_RETRY, PATCH_ROUNDS_WINDOW, Event
from tests.unit.test_plan import World, drive_to_ready

REVERTED = (
    "the patch of Deployment vllm was undone 3 times within 10 minutes of its first write: "
    "something else (Argo CD or Flux with self-heal, another controller, a script) puts its own "
    "pod template back. preshard stops patching it rather than restart its GPU pods each round, "
    "and leaves it as that writer made it. Make the two coexist: have that tool ignore the "
    "fields preshard manages (Argo CD: ignoreDifferences with managedFieldsManagers: [preshard] "
    "and RespectIgnoreDifferences=true; see the GitOps section of docs/install.md), then set a "
    "new preshard.dev/retry value or change the spec to patch again"
)


def rounds(world: World) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(
        world.deployments["vllm"]["metadata"]["annotations"][ANNOTATION_PATCH_ROUNDS]
    )
    return record


def revert(world: World, template: dict[str, Any]) -> None:
    """What a GitOps tool's self-heal does: the template from Git, preshard's annotations
    left (they are not in Git)."""
    item = world.deployments["vllm"]
    item["spec"]["template"] = copy.deepcopy(template)
    item["metadata"]["generation"] += 1
    item["metadata"]["resourceVersion"] = str(int(item["metadata"]["resourceVersion"]) + 1)


def ready_world() -> tuple[World, dict[str, Any]]:
    world = World()
    original = copy.deepcopy(world.deployments["vllm"]["spec"]["template"])
    drive_to_ready(world)
    return world, original


def test_the_first_patch_is_round_one() -> None:
    world, _ = ready_world()
    annotations = world.deployments["vllm"]["metadata"]["annotations"]
    assert rounds(world) == {
        "count": 1,
        "generation": 1,
        "inputHash": annotations[ANNOTATION_INPUT_HASH],
        "retry": None,
        "since": "2026-12-01T12:00:00Z",
    }


def test_the_third_revert_is_refused_and_nothing_is_written() -> None:
    world, original = ready_world()
    for count in (2, 3):
        world.now += timedelta(minutes=1)
        revert(world, original)
        (patch,) = world.step().patches
        assert not patch.restore
        assert rounds(world)["count"] == count
        assert rounds(world)["since"] == "2026-12-01T12:00:00Z"
    world.now += timedelta(minutes=1)
    revert(world, original)
    reverted = copy.deepcopy(world.deployments["vllm"])
    result = world.step()
    assert result.patches == []
    assert world.deployments["vllm"] == reverted
    (state,) = world.status.targets
    assert (state.state, state.reason, state.message) == (
        "Refused",
        reasons.TARGET_REVERTED,
        REVERTED,
    )
    assert Event("Warning", reasons.TARGET_REVERTED, f"Deployment vllm: {REVERTED}", "vllm") in (
        result.events
    )
    assert world.condition(conditions.READY) == ("False", reasons.TARGET_REVERTED)
    assert world.condition(conditions.TARGETS_PATCHED) == ("False", reasons.TARGET_REVERTED)
    # It stays refused, also long after the rounds, and quiet.
    world.now += timedelta(hours=2)
    again = world.step()
    assert (again.patches, again.events) == ([], [])
    assert world.status.targets[0].reason == reasons.TARGET_REVERTED


def refused_world() -> tuple[World, dict[str, Any]]:
    world, original = ready_world()
    for _ in range(3):
        revert(world, original)
        world.step()
    assert world.status.targets[0].reason == reasons.TARGET_REVERTED
    return world, original


def test_a_new_retry_value_patches_again_from_round_one() -> None:
    world, _ = refused_world()
    world.annotations[ANNOTATION_RETRY] = "1"
    (patch,) = world.step().patches
    assert not patch.restore
    assert (rounds(world)["count"], rounds(world)["retry"]) == (1, "1")
    assert world.status.targets[0].state == "RollingOut"


def test_a_new_spec_generation_patches_again() -> None:
    world, _ = refused_world()
    world.generation = 2
    (patch,) = world.step().patches
    assert not patch.restore
    assert (rounds(world)["count"], rounds(world)["generation"]) == (1, 2)


def test_reverts_further_apart_than_the_window_are_patched_again_and_again() -> None:
    world, original = ready_world()
    for _ in range(5):
        world.now += PATCH_ROUNDS_WINDOW + timedelta(seconds=1)
        revert(world, original)
        assert len(world.step().patches) == 1
        assert rounds(world)["count"] == 1
    assert world.status.targets[0].state == "RollingOut"


def test_a_changed_patch_starts_over() -> None:
    world, original = ready_world()
    revert(world, original)
    world.step()
    assert rounds(world)["count"] == 2
    # The user edits a field of their own: another original, another patch (annotations only).
    world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}
    )
    assert len(world.step().patches) == 1
    assert rounds(world)["count"] == 1
    assert rounds(world)["since"] == "2026-12-01T12:00:00Z"


def test_a_mangled_record_counts_as_none() -> None:
    world, original = ready_world()
    world.deployments["vllm"]["metadata"]["annotations"][ANNOTATION_PATCH_ROUNDS] = "{"
    revert(world, original)
    world.step()
    assert rounds(world)["count"] == 1


def test_restore_removes_the_record() -> None:
    world, _ = ready_world()
    world.spec["targets"] = []
    world.generation = 2
    (patch,) = world.step().patches
    assert patch.restore
    assert ANNOTATION_PATCH_ROUNDS not in world.deployments["vllm"]["metadata"].get(
        "annotations", {}
    )
