"""The Deployment index and the lookup a reconcile pass makes in it, by exact equality."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from preshard.api.models import LabelSelector
from preshard.builders.patching import ANNOTATION_OWNER
from preshard.controller.handlers import (
    DeploymentEntry,
    DeploymentKey,
    Indexes,
    Interest,
    deployment_entries,
)


def deployment(name: str, app: str = "vllm", patched_by: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "labels": {"app": app},
        "managedFields": [{"manager": "kubectl"}],
    }
    if patched_by is not None:
        metadata["annotations"] = {ANNOTATION_OWNER: patched_by}
    return {"metadata": metadata, "spec": {"replicas": 1}}


def index_of(*deployments: dict[str, Any]) -> dict[DeploymentKey, list[DeploymentEntry]]:
    """What kopf's index holds after these Deployments' events: each key's values."""
    index: dict[DeploymentKey, list[DeploymentEntry]] = defaultdict(list)
    for manifest in deployments:
        for key, entry in deployment_entries("ns", manifest["metadata"]["name"], manifest).items():
            index[key].append(entry)
    return index


def lookup(index: dict[DeploymentKey, list[DeploymentEntry]], interest: Interest) -> list[str]:
    indexes = Indexes(jobs={}, pods={}, deployments=index, shard_sets={}, target_pods={})  # type: ignore[arg-type]
    return sorted(indexes.deployments_for(("ns", "shm"), interest))


def test_a_deployment_is_listed_by_namespace_and_name_and_a_patched_one_by_its_owner() -> None:
    plain = deployment("a")
    patched = deployment("b", patched_by="shm")
    index = index_of(plain, patched)

    assert set(index) == {
        DeploymentKey("ns"),
        DeploymentKey("ns", name="a"),
        DeploymentKey("ns", name="b"),
        DeploymentKey("ns", patched_by="shm"),
    }
    assert [name for name, _ in index[DeploymentKey("ns")]] == ["a", "b"]
    assert index[DeploymentKey("ns", patched_by="shm")] == index[DeploymentKey("ns", name="b")]
    assert "managedFields" not in index[DeploymentKey("ns", name="a")][0][1]["metadata"]


def test_a_pass_finds_its_named_targets_and_what_it_patched_without_the_rest() -> None:
    index = index_of(
        deployment("named"),
        deployment("renamed-since", patched_by="shm"),
        deployment("theirs", patched_by="other"),
        deployment("unrelated"),
    )

    assert lookup(index, Interest(names=frozenset({"named", "missing"}))) == [
        "named",
        "renamed-since",
    ]
    assert lookup(index, Interest()) == ["renamed-since"]


def test_a_label_selector_is_matched_against_every_deployment_of_the_namespace() -> None:
    index = index_of(
        deployment("a", app="vllm"),
        deployment("b", app="other"),
        deployment("c", app="other", patched_by="shm"),
    )
    selector = LabelSelector.model_validate({"matchLabels": {"app": "vllm"}})

    assert lookup(index, Interest(selectors=(selector,))) == ["a", "c"]
