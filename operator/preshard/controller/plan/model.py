"""What the planner reads and what it returns, and how it writes times and messages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, Literal

from preshard.api import models
from preshard.api.status import ShardedModelStatus
from preshard.builders import Manifest
from preshard.builders.shardset import Owner
from preshard.controller.observe import JobView, TargetPodView

ANNOTATION_RETRY: Final = "preshard.dev/retry"
MESSAGE_LIMIT: Final = 1024

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the ShardedModel."""

    type: EventType
    reason: str
    message: str
    deployment: str | None = None
    """The target Deployment whose patch or restore this event announces: it is posted only if
    that write is made."""


@dataclass(frozen=True)
class DeploymentPatch:
    """A JSON patch for one Deployment."""

    name: str
    patch: list[Manifest]
    planned_from: tuple[str, int]
    """The Deployment's uid and generation the patch was planned from (its `test` checks the
    generation): a second patch from the same pair means the index has not caught up yet."""
    restore: bool = False
    kept: tuple[str, ...] = ()
    """A restore's note of preshard's fields the user changed since, kept as they are."""


@dataclass
class Plan:
    """What the controller does next."""

    status: ShardedModelStatus
    create_jobs: list[Manifest] = field(default_factory=list)
    delete_jobs: list[str] = field(default_factory=list)
    patches: list[DeploymentPatch] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None

    def wake_at(self, when: datetime, now: datetime) -> None:
        """Ask to be reconciled again no later than `when`."""
        delay = max(1.0, (when - now).total_seconds())
        self.requeue_after = delay if self.requeue_after is None else min(self.requeue_after, delay)


@dataclass(frozen=True)
class Observed:
    """Everything the planner reads besides the spec and status."""

    jobs: Mapping[str, JobView]
    deployments: Mapping[str, Manifest]
    now: datetime
    sets_used_elsewhere: frozenset[str] = frozenset()
    """URIs of this resource's shard sets that another ShardedModel lists too."""
    target_pods: Mapping[str, tuple[TargetPodView, ...]] = field(default_factory=dict)
    """The pods of patched templates, by Deployment name."""
    progress: Mapping[str, str] = field(default_factory=dict)
    """How far running Jobs are, by Job name, as their pods' logs last said (stepped)."""
    deleted_jobs: frozenset[str] = frozenset()
    """Names of this namespace's Jobs the operator deleted a few minutes ago: not to be used
    again yet (the Job controller would not start a pod for a new Job of such a name)."""


@dataclass(frozen=True)
class Resource:
    """The ShardedModel being reconciled."""

    owner: Owner
    generation: int
    annotations: Mapping[str, str]
    spec: models.ShardedModelSpec
    status: ShardedModelStatus


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC, second precision, as Kubernetes writes times."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    """The inverse of `timestamp`; None for None."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) if text else None


def clip(text: str) -> str:
    """The text, cut to fit a status message or an event."""
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."
