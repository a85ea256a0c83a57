"""What every stage of the planner reads, `Context`, and what it asks for, `Actions`.

The stages are pure functions: each takes the context and its own inputs and returns its result
together with the actions it wants. The composer adds the actions up in the order the stages
ran, so the Jobs, patches and events of a plan come in a stable order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from preshard.api import models
from preshard.api.status import ShardSetStatus
from preshard.builders import Manifest
from preshard.builders.identity import shard_set_key
from preshard.controller.plan.model import (
    DeploymentPatch,
    Event,
    Observed,
    Resource,
    timestamp,
)
from preshard.settings import Settings


@dataclass(frozen=True)
class Context:
    """One pass's inputs, and what every stage derives from them."""

    resource: Resource
    observed: Observed
    settings: Settings
    stamp: str
    """The time of the pass, as the status writes it."""
    previous: Mapping[str, ShardSetStatus]
    """The previous status's shard set entries, by artifact key."""

    @classmethod
    def of(cls, resource: Resource, observed: Observed, settings: Settings) -> Context:
        """The context of a pass over this resource and observation."""
        return cls(
            resource=resource,
            observed=observed,
            settings=settings,
            stamp=timestamp(observed.now),
            previous={e.artifact_key: e for e in resource.status.shard_sets},
        )

    @property
    def spec(self) -> models.ShardedModelSpec:
        """The resource's parsed spec."""
        return self.resource.spec

    @property
    def now(self) -> datetime:
        """The time of the pass."""
        return self.observed.now

    def key(self, tp: int) -> str:
        """The artifact key the current spec gives its set of this TP size."""
        owner = self.resource.owner
        return shard_set_key(self.spec, tp, namespace=owner.namespace, settings=self.settings)


@dataclass(frozen=True)
class Actions:
    """What a stage asks the controller to do besides the status it returns."""

    create_jobs: tuple[Manifest, ...] = ()
    delete_jobs: tuple[str, ...] = ()
    patches: tuple[DeploymentPatch, ...] = ()
    events: tuple[Event, ...] = ()
    wake_at: datetime | None = None
    """Reconcile again no later than this."""

    def __add__(self, later: Actions) -> Actions:
        """These actions, then `later`'s; the earlier of the two wake-ups."""
        wakes = [when for when in (self.wake_at, later.wake_at) if when is not None]
        return Actions(
            create_jobs=self.create_jobs + later.create_jobs,
            delete_jobs=self.delete_jobs + later.delete_jobs,
            patches=self.patches + later.patches,
            events=self.events + later.events,
            wake_at=min(wakes, default=None),
        )
