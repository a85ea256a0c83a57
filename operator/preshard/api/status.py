"""The ShardedModel status: what the controller observed and decided.

Conditions are the source of truth for readiness (`Ready`, `Serialized`, `Verified`,
`TargetsPatched`, `Degraded`). The per-shard-set `stage` records which step of the lifecycle
the controller is in, so that a restarted operator picks up where it left off; it is derived
from the Jobs it observed and is never used on its own to claim readiness.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from preshard.api.models import ApiModel


class StatusModel(ApiModel):
    """Status is read back from the cluster: fields this version does not know are ignored."""

    model_config = ConfigDict(extra="ignore")


ConditionStatus = Literal["True", "False", "Unknown"]

Stage = Literal[
    # A verify Job checks whether the set already exists (no GPU needed if it does).
    "Probing",
    # The GPU Job is writing and uploading the set.
    "Serializing",
    # A CPU Job is writing the set from a verified set of the same model at another TP size.
    "Resharding",
    # A verify Job checks the set the serialization Job just wrote.
    "Verifying",
    # The set is complete and may be loaded.
    "Verified",
    # The set cannot be made or is broken; `reason` says why. A spec change or the
    # `preshard.dev/retry` annotation starts over.
    "Failed",
    # No longer wanted by the spec; kept until no target uses it, then deleted or released.
    "Superseded",
    # A delete Job removes the superseded set (retention Delete).
    "Deleting",
]

TargetState = Literal[
    # Loads its shard set and the rollout of the patched template is complete: it serves.
    "Patched",
    # Patched; the Deployment controller is rolling the patched template out.
    "RollingOut",
    # Patched, but its pods crash or do not become available (or the rollout exceeded its
    # progress deadline and the policy keeps the patched template).
    "Unavailable",
    # The patched rollout exceeded its progress deadline and the original template was restored.
    "RolledBack",
    # Waits for its shard set (and keeps loading the one it has, if any).
    "Waiting",
    # Cannot be patched safely; nothing is written.
    "Refused",
    "NotFound",
    # Another ShardedModel manages it.
    "Conflict",
]


class Condition(StatusModel):
    """A Kubernetes condition."""

    type: str = Field(max_length=64)
    """Type of the condition: Ready, Serialized, Verified, TargetsPatched or Degraded."""

    status: ConditionStatus
    """True, False or Unknown."""

    reason: str = Field(max_length=128)
    """CamelCase reason for the condition's last transition."""

    message: str = Field(default="", max_length=4096)
    """Human-readable details."""

    last_transition_time: str
    """When the status last changed (RFC 3339)."""

    observed_generation: int | None = None
    """The spec generation the condition was computed from."""


class ShardSetStatus(StatusModel):
    """One shard set: one tensor-parallel size of one artifact."""

    tensor_parallel_size: int
    """TP size: the set holds one rank file per GPU."""

    artifact_key: str
    """Content key of the set (a hash of model, revision, TP, dtype, image and tensorizer settings).
    """

    uri: str
    """Prefix of the set in S3."""

    stage: Stage
    """Lifecycle step."""

    reason: str = ""
    """CamelCase reason of the latest result."""

    message: str = Field(default="", max_length=4096)
    """Details of the latest result."""

    job: str | None = None
    """The Job working on the set now (or last)."""

    verify_run: int = 0
    """How many verify Jobs ran for this set."""

    serialize_run: int = 0
    """How many serialization Jobs ran for this set."""

    delete_run: int = 0
    """How many delete Jobs ran for this set."""

    reshard_run: int = 0
    """How many reshard Jobs ran for this set."""

    resharded_from: str | None = None
    """The artifact key of the set this one was resharded from on CPU; none when serialized."""

    retry_token: str | None = None
    """The `preshard.dev/retry` annotation value last acted on."""

    failed_generation: int | None = None
    """The spec generation the set failed under; a newer spec starts it over."""

    failures: int = 0
    """Consecutive transient failures (unreachable store), for back-off."""

    next_check: str | None = None
    """When the next verification is due (RFC 3339)."""

    verified_at: str | None = None
    """When the set last verified complete (RFC 3339)."""

    total_bytes: int | None = None
    """Size of every file of the set, from its manifest."""

    files: int | None = None
    """Number of files in the set."""

    vllm_version: str | None = None
    """vLLM version the set was made with."""

    tensorizer_version: str | None = None
    """tensorizer version the set was made with."""

    manifest_format: int | None = None
    """The format of the set's `manifest.json`, from its last verification: what the init
    container of a Deployment that loads it must read."""

    progress: str | None = None
    """How far the running serialize or reshard Job is, from its pod's log, in steps of 5%:
    `upload 35% of 14.96 GiB, 420 MB/s, about 25 s left`."""


class TargetStatus(StatusModel):
    """One Deployment preshard points (or will point) at a shard set."""

    name: str
    """Name of the Deployment."""

    container: str | None = None
    """The vLLM container that was patched."""

    tensor_parallel_size: int
    """TP size the Deployment serves with."""

    artifact_key: str | None = None
    """The shard set the Deployment loads now."""

    state: TargetState
    """Patched (serving: the patched template is rolled out), RollingOut, Unavailable (patched pods
    crash or never become available), RolledBack (the patched rollout failed and the original
    template was restored), Waiting (for its shard set), Refused (cannot be patched safely),
    NotFound or Conflict (another ShardedModel owns it).
    """

    reason: str = ""
    """CamelCase reason of the state."""

    message: str = Field(default="", max_length=4096)
    """Details."""

    rollout: str | None = None
    """Rollout of the Deployment's template: `in progress`, `complete`, `scaled to zero`,
    `failed` or `restored`.
    """

    failed_artifact_key: str | None = None
    """The shard set whose rollout failed and was rolled back (onRolloutFailure Restore)."""

    failed_generation: int | None = None
    """The spec generation that rollout failed under; a newer spec patches the Deployment again."""

    retry_token: str | None = None
    """The `preshard.dev/retry` annotation value when the rollout failed; a new value patches the
    Deployment again.
    """


class ShardedModelStatus(StatusModel):
    """Observed state of a ShardedModel."""

    observed_generation: int | None = None
    """The spec generation this status describes."""

    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Serialized, Verified, TargetsPatched and Degraded."""

    shard_sets: list[ShardSetStatus] = Field(default_factory=list)
    """One entry per shard set, wanted or still in use."""

    targets: list[TargetStatus] = Field(default_factory=list)
    """One entry per Deployment matched by the targets."""
