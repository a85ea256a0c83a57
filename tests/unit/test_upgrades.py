"""An operator upgrade re-serializes nothing and restarts no vLLM pod: the artifact key follows
the serializer's vLLM release, not preshard's version, and a new tools image alone is no reason
to write a patched Deployment, unless the image it has cannot read its set's manifest."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from preshard.api.models import parse_spec
from preshard.builders.identity import artifact_key, shard_set_key
from preshard.builders.patching import (
    ANNOTATION_TOOLS_MANIFEST_FORMAT,
    INIT_CONTAINER,
    PatchedDeployment,
    managed_view,
    patch_deployment,
)
from preshard.contract import reasons
from preshard.settings import Settings, SettingsError
from tests.unit import test_plan
from tests.unit.test_patching import deployment, target_input
from tests.unit.test_plan import NOW, World, drive_to_ready, failed, serialized, verified

ROOT = Path(__file__).resolve().parents[2]
SPEC: dict[str, Any] = {
    "model": {"id": "org/model", "revision": "abc"},
    "storage": {"uri": "s3://bucket/prefix"},
    "tensorParallelSizes": [2],
}


def key(settings: Settings, **serialization: Any) -> str:
    spec = parse_spec({**SPEC, "serialization": serialization} if serialization else SPEC)
    return shard_set_key(spec, 2, namespace="ns", settings=settings)


def release(version: str, vllm: str = "0.34.0") -> Settings:
    """The settings a chart release gives: its serializer image is tagged with its version."""
    return Settings(
        serializer_image=f"ghcr.io/preshard/preshard-serializer:{version}",
        serializer_vllm_version=vllm,
        tools_image=f"ghcr.io/preshard/preshard:{version}",
    )


def test_the_default_serializer_keeps_its_keys_across_preshard_releases() -> None:
    assert key(release("0.1.0")) == key(release("0.2.0"))
    # A mirror of the image (another registry, a digest) is the same vLLM too.
    mirrored = replace(release("0.1.0"), serializer_image="mirror.example.com/serializer@sha256:0")
    assert key(mirrored) == key(release("0.1.0"))


def test_another_vllm_release_makes_another_set() -> None:
    assert key(release("0.1.0", vllm="0.35.0")) != key(release("0.1.0"))
    # Builds of one release are one release.
    assert key(release("0.1.0", vllm="v0.34.0")) == key(release("0.1.0"))


def test_a_users_serializer_image_is_keyed_on_its_reference_as_before() -> None:
    own = {"image": "example.com/serializer:1"}
    assert key(release("0.1.0"), **own) == key(release("0.2.0", vllm="0.35.0"), **own)
    assert key(release("0.1.0"), **own) != key(release("0.1.0"), image="example.com/serializer:2")
    # The key earlier releases gave it (they hashed the image reference, as now): no new sets.
    spec = parse_spec({**SPEC, "serialization": own})
    assert key(release("0.1.0"), **own) == artifact_key(
        spec, 2, namespace="ns", serializer_image="example.com/serializer:1"
    )
    assert key(release("0.1.0"), **own) == "a0461d19e7076496856c"


def test_the_serializer_vllm_version_setting() -> None:
    assert Settings.from_env({}).serializer_vllm_version == "0.34.0"
    env = {"PRESHARD_SERIALIZER_VLLM_VERSION": "0.35.1"}
    assert Settings.from_env(env).serializer_vllm_version == "0.35.1"
    with pytest.raises(SettingsError, match="PRESHARD_SERIALIZER_VLLM_VERSION='latest'"):
        Settings.from_env({"PRESHARD_SERIALIZER_VLLM_VERSION": "latest"})


def test_the_default_vllm_version_is_the_one_the_serializer_image_is_built_on() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    built_on = re.search(r"^FROM vllm/vllm-openai:v(\S+) AS serializer$", dockerfile, re.M)
    assert built_on is not None
    values = yaml.safe_load((ROOT / "charts" / "preshard" / "values.yaml").read_text())
    assert Settings().serializer_vllm_version == built_on.group(1)
    assert values["serializerImage"]["vllmVersion"] == built_on.group(1)


def init_image(item: dict[str, Any]) -> str:
    pod = item["spec"]["template"]["spec"]
    image: str = next(c for c in pod["initContainers"] if c["name"] == INIT_CONTAINER)["image"]
    return image


def patched(
    item: dict[str, Any], tools_image: str, manifest_format: int = 2, **extra: Any
) -> dict[str, Any]:
    settings = Settings(tools_image=tools_image)
    target = replace(
        target_input(extra or None, settings=settings), manifest_format=manifest_format
    )
    result = patch_deployment(item, target)
    assert isinstance(result, PatchedDeployment)
    return result.deployment


def as_an_older_release_patched(item: dict[str, Any]) -> dict[str, Any]:
    """The Deployment as a release before manifest format 2 left it: its image reads format 1
    and it says nothing of the formats."""
    del item["metadata"]["annotations"][ANNOTATION_TOOLS_MANIFEST_FORMAT]
    return item


def test_a_new_tools_image_alone_writes_nothing() -> None:
    first = patched(deployment(), "tools:1")
    again = patched(first, "tools:2")
    assert init_image(again) == "tools:1"
    assert managed_view(again, "vllm") == managed_view(first, "vllm")


def test_the_tools_image_moves_with_the_next_change_of_the_patch() -> None:
    first = patched(deployment(), "tools:1")
    changed = patched(first, "tools:2", loading={"numReaders": 2})
    assert init_image(changed) == "tools:2"
    assert managed_view(changed, "vllm") != managed_view(first, "vllm")


def test_the_tools_image_is_recorded_with_the_manifest_format_it_reads() -> None:
    annotations = patched(deployment(), "tools:1")["metadata"]["annotations"]
    assert annotations[ANNOTATION_TOOLS_MANIFEST_FORMAT] == "2"


def test_an_older_tools_image_is_kept_while_its_set_is_in_a_format_it_reads() -> None:
    first = as_an_older_release_patched(patched(deployment(), "tools:1", manifest_format=1))
    again = patched(first, "tools:2", manifest_format=1)
    assert init_image(again) == "tools:1"
    assert managed_view(again, "vllm") == managed_view(first, "vllm")
    assert ANNOTATION_TOOLS_MANIFEST_FORMAT not in again["metadata"]["annotations"]


def test_an_older_tools_image_moves_when_its_set_is_in_a_newer_format() -> None:
    """Its `fetch-config` would refuse the manifest, and every new pod would fail to start."""
    first = as_an_older_release_patched(patched(deployment(), "tools:1", manifest_format=1))
    again = patched(first, "tools:2", manifest_format=2)
    assert init_image(again) == "tools:2"
    assert again["metadata"]["annotations"][ANNOTATION_TOOLS_MANIFEST_FORMAT] == "2"


def test_a_tools_image_that_reads_the_sets_format_is_kept_through_an_upgrade() -> None:
    first = patched(deployment(), "tools:1", manifest_format=2)
    again = patched(first, "tools:2", manifest_format=2)
    assert init_image(again) == "tools:1"
    assert again["metadata"]["annotations"][ANNOTATION_TOOLS_MANIFEST_FORMAT] == "2"


def test_the_input_hash_does_not_depend_on_the_tools_image() -> None:
    one = patched(deployment(), "tools:1")
    two = patched(deployment(), "tools:2")
    assert one["metadata"]["annotations"] == two["metadata"]["annotations"]


def test_the_planner_does_not_patch_again_after_an_upgrade(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World()
    drive_to_ready(world)
    before = world.deployments["vllm"]
    monkeypatch.setattr(test_plan, "SETTINGS", replace(test_plan.SETTINGS, tools_image="tools:2"))
    result = world.step()
    assert result.patches == []
    assert world.deployments["vllm"] is before
    assert init_image(before) == "tools:1"
    # Another reason to patch (a spec change) takes the new image along.
    world.spec = {**world.spec, "loading": {"numReaders": 2}}
    world.generation = 2
    (patch,) = world.step().patches
    assert init_image(world.deployments["vllm"]) == "tools:2"
    assert patch.name == "vllm"


def test_a_set_made_again_after_an_upgrade_takes_the_tools_image_that_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A set and a Deployment from a release that wrote format 1: the upgrade writes nothing;
    the set made again (here after a lost file and a retry) is in format 2, which the kept image
    cannot read, so the image moves with the verified set."""
    world = World()
    drive_to_ready(world)
    as_an_older_release_patched(world.deployments["vllm"])
    (entry,) = world.status.shard_sets
    older = entry.model_copy(update={"manifest_format": None})
    world.status = world.status.model_copy(update={"shard_sets": [older]})
    monkeypatch.setattr(test_plan, "SETTINGS", replace(test_plan.SETTINGS, tools_image="tools:2"))
    assert world.step().patches == []

    world.now = NOW + timedelta(hours=1, seconds=1)
    world.step()
    world.finish(world.only_set().job, failed("verify", reasons.SHARD_MISSING, "model-rank-001"))
    assert world.step().patches == []
    assert init_image(world.deployments["vllm"]) == "tools:1"
    world.annotations["preshard.dev/retry"] = "1"
    world.step()
    world.finish(world.only_set().job, serialized())
    world.step()
    world.finish(world.only_set().job, verified(manifest_format=2))
    (patch,) = world.step().patches
    assert patch.name == "vllm"
    assert init_image(world.deployments["vllm"]) == "tools:2"
    annotations = world.deployments["vllm"]["metadata"]["annotations"]
    assert annotations[ANNOTATION_TOOLS_MANIFEST_FORMAT] == "2"
