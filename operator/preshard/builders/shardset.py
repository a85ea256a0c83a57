"""The shard set and the ShardedModel it belongs to, and the names and labels of everything
preshard creates for them.

Builders are pure: typed input in, manifest dict out, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from preshard.api import models
from preshard.builders import Manifest
from preshard.contract.layout import S3Location, shard_set_location
from preshard.settings import Settings

MANAGED_BY: Final = "preshard"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_SHARDEDMODEL: Final = "preshard.dev/shardedmodel"
LABEL_ARTIFACT_KEY: Final = "preshard.dev/artifact-key"
LABEL_COMMAND: Final = "preshard.dev/command"
# On the Jobs that make or check a set and on the Deployments patched to load it.
ANNOTATION_TP: Final = "preshard.dev/tensor-parallel-size"
ANNOTATION_URI: Final = "preshard.dev/uri"

# Job names are also label values (`job-name`), so they fit in 63 characters.
NAME_LIMIT: Final = 63
_OWNER_PART: Final = 30


@dataclass(frozen=True)
class Owner:
    """The ShardedModel a child object belongs to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Manifest:
        """The controller owner reference, so Kubernetes garbage-collects the child."""
        return {
            "apiVersion": f"{models.GROUP}/{models.VERSION}",
            "kind": models.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class ShardSet:
    """One shard set: an artifact key, its TP size and where it lives."""

    tensor_parallel_size: int
    artifact_key: str
    location: S3Location

    @classmethod
    def for_spec(
        cls, spec: models.ShardedModelSpec, tensor_parallel_size: int, artifact_key: str
    ) -> ShardSet:
        """The set a spec makes for one TP size under its storage prefix."""
        return cls(
            tensor_parallel_size=tensor_parallel_size,
            artifact_key=artifact_key,
            location=shard_set_location(spec.storage.uri, artifact_key),
        )

    @property
    def uri(self) -> str:
        """The set's prefix as an `s3://` URI ending in `/`."""
        return self.location.uri


@dataclass(frozen=True)
class BuildInput:
    """What every builder of an object for a shard set needs: the ShardedModel it belongs to,
    its spec, the set and the operator's settings."""

    owner: Owner
    spec: models.ShardedModelSpec
    shard_set: ShardSet
    settings: Settings


def child_name(owner: Owner, shard_set: ShardSet, kind: str, run: int) -> str:
    """A deterministic, readable name for a Job of one shard set."""
    head = owner.name[:_OWNER_PART].rstrip("-.")
    name = f"{head}-{shard_set.artifact_key[:8]}-{kind}-{run}"
    if len(name) > NAME_LIMIT:
        raise ValueError(f"child name {name!r} is longer than {NAME_LIMIT} characters")
    return name


def owner_label(owner: Owner) -> str:
    """The `preshard.dev/shardedmodel` label's value: the ShardedModel's name, cut to a label
    value's 63 characters."""
    return owner.name[:63].rstrip("-.")


def labels(owner: Owner, shard_set: ShardSet, component: str) -> dict[str, str]:
    """Labels on every Job and pod preshard creates."""
    return {
        LABEL_NAME: "preshard",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: component,
        LABEL_SHARDEDMODEL: owner_label(owner),
        LABEL_ARTIFACT_KEY: shard_set.artifact_key,
        LABEL_COMMAND: component,
    }
