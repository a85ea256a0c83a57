"""The API models and the CRD generated from them: one source of truth, kept in step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from preshard.api import crd
from preshard.api.models import (
    InvalidSpecError,
    LabelSelector,
    ShardedModelSpec,
    parse_spec,
)
from preshard.api.status import ShardedModelStatus
from preshard.contract.engine_args import RESERVED_ENGINE_ARGS

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / "shardedmodels.preshard.dev.yaml"

MINIMAL: dict[str, Any] = {
    "model": {"id": "org/model"},
    "storage": {"uri": "s3://bucket/prefix"},
    "tensorParallelSizes": [2],
}


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        found += walk(sub, f"{path}.{name}")
    if "items" in schema:
        found += walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += walk(schema["additionalProperties"], f"{path}{{}}")
    return found


def test_committed_crd_is_generated_from_the_models() -> None:
    assert COMMITTED.read_text() == crd.render_crd(), "crds/ is stale: run `make crds`"


def test_crd_schema_is_structural_and_documented() -> None:
    version = crd.build_crd()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "title", "patternProperties", "$defs"}
    for path, node in walk(spec):
        assert not forbidden & node.keys(), path
        assert "type" in node, path
        if not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description for kubectl explain"


def test_crd_names_and_columns() -> None:
    manifest = crd.build_crd()
    assert manifest["spec"]["names"]["shortNames"] == ["shm"]
    version = manifest["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Ready", "Reason", "TP", "Progress", "Age"]


def test_reserved_engine_args_are_refused_in_either_spelling() -> None:
    for name in ("tensor-parallel-size", "load_format", "model"):
        with pytest.raises(InvalidSpecError, match="preshard sets these itself"):
            parse_spec({**MINIMAL, "serialization": {"extraEngineArgs": {name: "1"}}})
    assert "tensor_parallel_size" in RESERVED_ENGINE_ARGS


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensorParallelSizes": [3]}, "must be one of 1, 2, 4, 8, 16"),
        ({"tensorParallelSizes": [2, 2]}, "duplicates"),
        ({"model": {"id": "a/b", "uri": "s3://bucket/x"}}, "exactly one of id"),
        ({"model": {"uri": "s3://bucket/x", "revision": "main"}}, "Hugging Face models only"),
        ({"storage": {"uri": "s3://bucket/../etc"}}, "invalid format"),
        ({"storage": {"uri": "s3://bucket/a//b"}}, "invalid format"),
        ({"storage": {"uri": "https://bucket/a"}}, "invalid format"),
        ({"targets": [{"name": "a", "tensorParallelSize": 4}]}, "not listed"),
        ({"targets": [{"name": "a"}, {"name": "a"}]}, "more than one target"),
        ({"targets": [{}]}, "exactly one of name or selector"),
        ({"targets": [{"selector": {}}]}, "empty selector"),
        ({"unknown": 1}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_specs_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message) as error:
        parse_spec({**MINIMAL, **change})
    assert str(error.value).startswith("spec")


@pytest.mark.parametrize(
    ("serialization", "message"),
    [
        ({"scratchSize": "1e1.5"}, "spec.serialization.scratchSize: Value error, '1e1.5' is not"),
        (
            {"scratchSize": "-5Gi"},
            "spec.serialization.scratchSize: Value error, '-5Gi' is negative",
        ),
        ({"scratchSize": "0"}, "spec.serialization.scratchSize: Value error, '0' is less than one"),
        (
            {"scratchSize": "1m"},
            "spec.serialization.scratchSize: Value error, '1m' is less than one",
        ),
        (
            {"scratchSize": "100 Gi"},
            "spec.serialization.scratchSize: '100 Gi' has an invalid format",
        ),
        ({"memory": "-1Gi"}, "spec.serialization.memory: Value error, '-1Gi' is negative"),
        ({"cpu": "1e1.5"}, "spec.serialization.cpu: Value error, '1e1.5' is not"),
    ],
)
def test_quantities_kubernetes_would_refuse_are_refused(
    serialization: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidSpecError) as error:
        parse_spec({**MINIMAL, "serialization": serialization})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("size", ["1e11", "+100Gi", ".5Ti", "1.5Ti", "200G", "1.G"])
def test_every_size_the_crd_accepts_is_read(size: str) -> None:
    spec = parse_spec({**MINIMAL, "serialization": {"scratchSize": size, "memory": size}})
    assert spec.serialization.scratch_size == size


def test_an_invalid_value_is_shown_shortened() -> None:
    with pytest.raises(InvalidSpecError) as error:
        parse_spec({**MINIMAL, "storage": {"uri": "x" * 500}})
    assert len(str(error.value)) < 200


def test_label_selector_semantics() -> None:
    selector = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "vllm"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "DoesNotExist"},
            ],
        }
    )
    assert selector.matches({"app": "vllm", "tier": "a"})
    assert not selector.matches({"app": "vllm", "tier": "c"})
    assert not selector.matches({"app": "vllm", "tier": "a", "canary": "1"})
    assert not selector.matches({"tier": "a"})


def test_defaults_match_the_crd_defaults() -> None:
    spec = ShardedModelSpec.model_validate(MINIMAL)
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    serialization = schema["properties"]["spec"]["properties"]["serialization"]["properties"]
    assert (
        serialization["activeDeadlineSeconds"]["default"]
        == spec.serialization.active_deadline_seconds
    )
    assert serialization["dtype"]["default"] == spec.serialization.dtype
    storage = schema["properties"]["spec"]["properties"]["storage"]["properties"]
    assert storage["retention"]["default"] == spec.storage.retention


def test_status_ignores_fields_it_does_not_know() -> None:
    status = ShardedModelStatus.model_validate({"observedGeneration": 2, "fromTheFuture": True})
    assert status.observed_generation == 2


def test_example_manifests_parse() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == "ShardedModel":
                parse_spec(document["spec"])
