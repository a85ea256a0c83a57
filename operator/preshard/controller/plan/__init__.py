"""The reconcile decision: from the spec and what is observed, the next actions.

A pure function. It reads the parsed spec, the previous status, the ShardedModel's Jobs and the
namespace's Deployments, and returns the Jobs to create or delete, the Deployment patches, the
new status and the events. Running it twice on the same observation returns the same plan, and
a plan for a converged resource is empty.

Per shard set (one per wanted TP size) the lifecycle is:
probe (verify Job: already there?) → reshard (CPU Job, from a verified set of the same model at
another TP size) or serialize (GPU Job) → verify → Verified, re-verified every
`verification.intervalSeconds`. A reshard that fails for any reason falls back to the GPU Job.
Targets are pointed at a set only once it is Verified; while a new set is built they keep
serving the one they have (an ordered transition), and a set no longer wanted is released, or
deleted with retention `Delete`, once no target uses it.

`plan` composes pure stages, each returning its result and the `Actions` it wants:
- `model`: what the planner reads and returns (`Resource`, `Observed`, `Plan`);
- `context`: what every stage reads (`Context`) and what it asks for (`Actions`);
- `sets`: the step of each wanted shard set, and of each set no longer wanted;
- `targets`: the target Deployments, their patches and restores, and the sets they load;
- `report`: the conditions and the events.
"""

from __future__ import annotations

from datetime import datetime

from preshard.api.status import ShardedModelStatus
from preshard.builders.shardset import ShardSet
from preshard.contract import reasons
from preshard.controller import conditions
from preshard.controller.plan import report, sets, targets
from preshard.controller.plan.context import Actions, Context
from preshard.controller.plan.model import (
    ANNOTATION_RETRY,
    DeploymentPatch,
    Event,
    Observed,
    Plan,
    Resource,
    timestamp,
)
from preshard.controller.plan.targets import PATCH_ROUNDS_WINDOW
from preshard.settings import Settings

__all__ = [
    "ANNOTATION_RETRY",
    "PATCH_ROUNDS_WINDOW",
    "DeploymentPatch",
    "Event",
    "Observed",
    "Plan",
    "Resource",
    "plan",
    "plan_invalid",
]


def plan(resource: Resource, observed: Observed, settings: Settings) -> Plan:
    """The next actions for one ShardedModel."""
    context = Context.of(resource, observed, settings)
    spec = resource.spec
    desired = {
        tp: ShardSet.for_spec(spec, tp, context.key(tp)) for tp in spec.tensor_parallel_sizes
    }
    advanced = [sets.advance(context, shard_set) for shard_set in desired.values()]
    entries = [entry for entry, _ in advanced]
    wanted_keys = {s.artifact_key for s in desired.values()}
    by_key = {e.artifact_key: e for e in entries}
    pointed = targets.plan_targets(context, desired, {**context.previous, **by_key})
    retired = [
        sets.retire(context, entry, pointed.in_use)
        for key, entry in context.previous.items()
        if key not in wanted_keys
    ]
    entries += [kept for kept, _ in retired if kept is not None]
    # In the order the stages ran: the order of the plan's Jobs, patches and events.
    actions = sum([*(a for _, a in advanced), pointed.actions, *(a for _, a in retired)], Actions())
    status = ShardedModelStatus(
        observed_generation=resource.generation,
        conditions=report.conditions_of(
            context, [by_key[s.artifact_key] for s in desired.values()], pointed.statuses
        ),
        shard_sets=entries,
        targets=list(pointed.statuses),
    )
    announced = report.announce(context, status, actions.patches)
    result = Plan(
        status=status,
        create_jobs=list(actions.create_jobs),
        delete_jobs=list(actions.delete_jobs),
        patches=list(actions.patches),
        events=[*actions.events, *announced],
    )
    if actions.wake_at is not None:
        result.wake_at(actions.wake_at, context.now)
    return result


def plan_invalid(
    status: ShardedModelStatus, generation: int, message: str, now: datetime
) -> ShardedModelStatus:
    """The status of a ShardedModel whose spec does not parse: nothing else happens."""
    stamp = timestamp(now)
    result = status.conditions
    for type_ in (conditions.READY, conditions.SERIALIZED, conditions.VERIFIED):
        result = conditions.set_condition(
            result, type_, "False", reasons.INVALID_SPEC, message, now=stamp, generation=generation
        )
    return status.model_copy(update={"conditions": result, "observed_generation": generation})
