"""The vLLM release of the server against the one that wrote its shards: read from tags and
annotations, compared by release, refused on a mismatch unless allowed, noted when unknown, in
the builder, the planner and `preshard render` alike."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from preshard.api.models import parse_spec
from preshard.builders.identity import image_tag, serializer_vllm_version, vllm_release
from preshard.builders.patching import (
    ANNOTATION_VLLM_VERSION,
    PatchedDeployment,
    Refusal,
    patch_deployment,
    serving_vllm_version,
)
from preshard.cli import main
from preshard.contract import reasons
from preshard.controller import conditions
from preshard.settings import Settings
from tests.unit.test_patching import KEY, target_input
from tests.unit.test_patching import deployment as target_deployment
from tests.unit.test_plan import World, deployment, drive_to_ready

ROOT = Path(__file__).resolve().parents[2]
MISMATCH = (
    "container vllm runs vLLM 0.11.0 (read from its image vllm/vllm-openai:v0.11.0) but shard "
    "set {key} was written by vLLM 0.34.0: another release may name, shape or fuse the weights "
    "differently, and the server would fail to load them or load them wrong. Serve with vLLM "
    "0.34.0, set serialization.image to a serializer image on vLLM 0.11.0 (a new shard set), or "
    "set allowVllmVersionMismatch: true on the target to patch it anyway"
)
UNCHECKED = (
    "the vLLM version could not be checked: the image vllm/vllm-openai:latest names no vLLM "
    "release (set the Deployment's annotation preshard.dev/vllm-version to the release "
    "container vllm runs; the shards were written by vLLM 0.34.0)"
)


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("v0.34.0", "0.34.0"),
        ("0.34.0", "0.34.0"),
        ("0.32.0+cpu", "0.32.0"),
        ("v0.9.0-cu128", "0.9.0"),
        ("0.10.1.1", "0.10.1.1"),
        ("0.11.0rc1", "0.11.0rc1"),
        ("0.4.0.post1", "0.4.0.post1"),
        ("V0.34.0", "0.34.0"),
        ("latest", None),
        ("nightly-0123abc", None),
        ("0.34", None),
        ("", None),
        (None, None),
    ],
)
def test_a_release_is_read_without_its_build_suffix(text: str | None, release: str | None) -> None:
    assert vllm_release(text) == release


@pytest.mark.parametrize(
    ("image", "tag"),
    [
        ("vllm/vllm-openai:v0.34.0", "v0.34.0"),
        ("registry.example.com:5000/vllm/vllm-openai:0.34.0", "0.34.0"),
        ("registry.example.com:5000/vllm/vllm-openai", None),
        ("vllm/vllm-openai:v0.34.0@sha256:" + "a" * 64, "v0.34.0"),
        ("vllm/vllm-openai@sha256:" + "a" * 64, None),
    ],
)
def test_image_tag(image: str, tag: str | None) -> None:
    assert image_tag(image) == tag


def container(image: str) -> dict[str, Any]:
    return {"name": "vllm", "image": image}


def annotated(value: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION_VLLM_VERSION: value}}}


def test_the_servers_release_comes_from_the_annotation_then_a_vllm_images_tag() -> None:
    assert serving_vllm_version({}, container("vllm/vllm-openai:v0.11.0")) == (
        "0.11.0",
        "its image vllm/vllm-openai:v0.11.0",
    )
    assert serving_vllm_version({}, container("rocm/vllm:0.9.1")) == (
        "0.9.1",
        "its image rocm/vllm:0.9.1",
    )
    # A custom image's own version is not vLLM's.
    assert serving_vllm_version({}, container("example.com/llm-server:1.4.2")) == (
        None,
        "the image example.com/llm-server:1.4.2 names no vLLM release",
    )
    assert serving_vllm_version(annotated("0.34.0"), container("example.com/llm:1.4.2")) == (
        "0.34.0",
        "the Deployment's annotation preshard.dev/vllm-version",
    )
    # The user's word beats a tag.
    assert serving_vllm_version(annotated("v0.34.0"), container("vllm/vllm-openai:v0.11.0")) == (
        "0.34.0",
        "the Deployment's annotation preshard.dev/vllm-version",
    )
    assert serving_vllm_version(annotated("new"), container("vllm/vllm-openai:v0.11.0")) == (
        None,
        "its annotation preshard.dev/vllm-version='new' names no vLLM release",
    )


def test_the_serializers_release_is_the_setting_or_a_user_images_tag() -> None:
    settings = Settings(serializer_image="ghcr.io/preshard/preshard-serializer:9.9.9")
    spec = target_input().spec
    assert serializer_vllm_version(spec, settings) == "0.34.0"
    own = target_input({"serialization": {"image": "example.com/serializer:v0.11.0-cu126"}})
    assert serializer_vllm_version(own.spec, settings) == "0.11.0"
    untagged = target_input({"serialization": {"image": "example.com/serializer:stable"}})
    assert serializer_vllm_version(untagged.spec, settings) is None


def patched(image: str, written: str | None, **changes: Any) -> PatchedDeployment | Refusal:
    item = target_deployment()
    item["spec"]["template"]["spec"]["containers"][0]["image"] = image
    return patch_deployment(item, replace(target_input(), shard_vllm_version=written, **changes))


def test_another_release_is_refused() -> None:
    assert patched("vllm/vllm-openai:v0.11.0", "0.34.0") == Refusal(
        reasons.VLLM_VERSION_MISMATCH, MISMATCH.format(key=KEY)
    )


def test_builds_of_one_release_match() -> None:
    result = patched("vllm/vllm-openai:v0.34.0-cu128", "0.34.0+cu126")
    assert isinstance(result, PatchedDeployment)
    assert result.version_note is None


def test_a_mismatch_the_target_allows_is_patched_with_a_note() -> None:
    result = patched("vllm/vllm-openai:v0.11.0", "0.34.0", allow_vllm_version_mismatch=True)
    assert isinstance(result, PatchedDeployment)
    assert result.version_note == (
        f"container vllm runs vLLM 0.11.0 and shard set {KEY} was written by vLLM 0.34.0: "
        "patched anyway (allowVllmVersionMismatch)"
    )


def test_an_unknown_side_is_patched_with_a_note() -> None:
    result = patched("vllm/vllm-openai:latest", "0.34.0")
    assert isinstance(result, PatchedDeployment)
    assert result.version_note == UNCHECKED
    unknown_set = patched("vllm/vllm-openai:v0.34.0", None)
    assert isinstance(unknown_set, PatchedDeployment)
    assert unknown_set.version_note == (
        f"the vLLM version could not be checked: the vLLM release that wrote shard set {KEY} is "
        "not known (container vllm runs 0.34.0)"
    )


def world_on(image: str, spec: dict[str, Any] | None = None) -> World:
    item = deployment()
    item["spec"]["template"]["spec"]["containers"][0]["image"] = image
    if spec is None:
        return World(vllm=item)
    return World(spec, vllm=item)


def test_the_planner_refuses_another_release_and_writes_nothing() -> None:
    world = world_on("vllm/vllm-openai:v0.11.0")
    before = copy.deepcopy(world.deployments["vllm"])
    drive_to_ready(world)
    assert world.deployments["vllm"] == before
    (state,) = world.status.targets
    key = world.only_set().artifact_key
    assert (state.state, state.reason, state.message) == (
        "Refused",
        reasons.VLLM_VERSION_MISMATCH,
        MISMATCH.format(key=key),
    )
    assert world.condition(conditions.READY) == ("False", reasons.VLLM_VERSION_MISMATCH)
    assert world.step().events == []


def test_the_planner_patches_an_allowed_mismatch_and_says_so() -> None:
    spec = {
        "model": {"id": "org/model", "revision": "abc123"},
        "storage": {"uri": "s3://bucket/shards", "credentialsSecretRef": {"name": "s3"}},
        "tensorParallelSizes": [2],
        "targets": [{"name": "vllm", "allowVllmVersionMismatch": True}],
    }
    world = world_on("vllm/vllm-openai:v0.11.0", spec)
    drive_to_ready(world)
    (state,) = world.status.targets
    key = world.only_set().artifact_key
    assert (state.state, state.reason) == ("Patched", reasons.PATCHED)
    assert state.message.endswith(
        f"\ncontainer vllm runs vLLM 0.11.0 and shard set {key} was written by vLLM 0.34.0: "
        "patched anyway (allowVllmVersionMismatch)"
    )
    assert world.condition(conditions.READY) == ("True", reasons.READY)


def test_the_planner_patches_an_unknown_release_and_says_it_was_not_checked() -> None:
    world = world_on("vllm/vllm-openai:latest")
    drive_to_ready(world)
    (state,) = world.status.targets
    assert (state.state, state.reason) == ("Patched", reasons.PATCHED)
    assert state.message == f"loads {world.only_set().uri}" + (
        "\nchanged in the vLLM command line: replaced --tensor-parallel-size 1 with 2 (the shard "
        "set's TP size)\n" + UNCHECKED
    )


def test_the_sets_recorded_release_wins_over_the_serializer_image() -> None:
    # The verify outcome of `drive_to_ready` records 0.34.0; a server on 0.34.0 matches it
    # whatever the operator's serializer setting says.
    world = world_on("vllm/vllm-openai:v0.34.0")
    drive_to_ready(world)
    assert world.only_set().vllm_version == "0.34.0"
    (state,) = world.status.targets
    assert (state.state, state.message) == (
        "Patched",
        f"loads {world.only_set().uri}\nchanged in the vLLM command line: replaced "
        "--tensor-parallel-size 1 with 2 (the shard set's TP size)",
    )


def test_a_patched_deployment_moved_to_another_release_is_refused_and_left_as_it_is() -> None:
    world = world_on("vllm/vllm-openai:v0.34.0")
    drive_to_ready(world)
    world.deployments["vllm"]["spec"]["template"]["spec"]["containers"][0]["image"] = (
        "vllm/vllm-openai:v0.11.0"
    )
    moved = copy.deepcopy(world.deployments["vllm"])
    result = world.step()
    assert result.patches == []
    assert world.deployments["vllm"] == moved
    (state,) = world.status.targets
    assert (state.state, state.reason) == ("Refused", reasons.VLLM_VERSION_MISMATCH)


def render(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, image: str
) -> tuple[int, list[dict[str, Any]], str]:
    item = yaml.safe_load((ROOT / "examples" / "vllm-deployment.yaml").read_text())
    item["spec"]["template"]["spec"]["containers"][0]["image"] = image
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(item))
    code = main(["render", "-f", str(ROOT / "examples" / "shardedmodel.yaml"), "-f", str(path)])
    out, err = capsys.readouterr()
    return code, [d for d in yaml.safe_load_all(out) if d], err


def test_render_refuses_another_release_with_the_operators_reason(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, documents, err = render(capsys, tmp_path, "vllm/vllm-openai:v0.11.0")
    assert code == 1
    assert [d["kind"] for d in documents] == ["Job", "Job"]
    assert err.startswith(
        "Deployment llama-vllm: VLLMVersionMismatch: container vllm runs vLLM 0.11.0 (read from "
        "its image vllm/vllm-openai:v0.11.0) but shard set "
    )


def test_render_says_when_the_release_could_not_be_checked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, documents, err = render(capsys, tmp_path, "vllm/vllm-openai:latest")
    assert code == 0
    assert [d["kind"] for d in documents] == ["Job", "Job", "Deployment"]
    assert err.endswith(f"Deployment llama-vllm: {UNCHECKED}\n")


def test_the_target_field_is_in_the_spec() -> None:
    spec = parse_spec(
        {
            "model": {"id": "org/model"},
            "storage": {"uri": "s3://bucket/shards"},
            "tensorParallelSizes": [1],
            "targets": [{"name": "vllm", "allowVllmVersionMismatch": True}],
        }
    )
    assert spec.targets[0].allow_vllm_version_mismatch is True
