"""What a pass tells: the conditions of the new status, and the events of what changed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from preshard.api.status import Condition, ShardedModelStatus, ShardSetStatus, TargetStatus
from preshard.builders import patching
from preshard.contract import reasons
from preshard.controller import conditions
from preshard.controller.plan.context import Context
from preshard.controller.plan.model import DeploymentPatch, Event, clip

# Target states whose Deployment loads its set (TargetsPatched), and those that need a person.
PATCHED_STATES: Final = frozenset({"Patched", "RollingOut", "Unavailable"})
TROUBLED_STATES: Final = frozenset({"Refused", "Conflict", "NotFound", "Unavailable", "RolledBack"})


def conditions_of(
    context: Context, wanted: Sequence[ShardSetStatus], targets: Sequence[TargetStatus]
) -> list[Condition]:
    """The conditions of the new status, from the wanted sets' entries and the targets'."""
    generation = context.resource.generation
    result = list(context.resource.status.conditions)

    def put(type_: str, ok: bool, reason: str, message: str) -> None:
        nonlocal result
        result = conditions.set_condition(
            result,
            type_,
            "True" if ok else "False",
            reason,
            clip(message),
            now=context.stamp,
            generation=generation,
        )

    failed = [e for e in wanted if e.stage == "Failed"]
    not_serialized = [e for e in wanted if e.stage not in ("Verifying", "Verified")]
    not_verified = [e for e in wanted if e.stage != "Verified"]
    if any(e.serialize_run for e in wanted):
        serialized_reason = reasons.SERIALIZED
    elif any(e.reshard_run for e in wanted):
        serialized_reason = reasons.RESHARDED
    else:
        serialized_reason = reasons.ALREADY_SERIALIZED
    put(
        conditions.SERIALIZED,
        not not_serialized,
        _first_reason(not_serialized, serialized_reason),
        _describe_sets(not_serialized) or "every shard set is written",
    )
    put(
        conditions.VERIFIED,
        not not_verified,
        _first_reason(not_verified, reasons.VERIFIED),
        _describe_sets(not_verified) or "every shard set verified complete",
    )
    unpatched = [t for t in targets if t.state not in PATCHED_STATES]
    if not context.spec.targets:
        put(conditions.TARGETS_PATCHED, True, reasons.NO_TARGETS, "no targets to patch")
    else:
        put(
            conditions.TARGETS_PATCHED,
            not unpatched,
            unpatched[0].reason if unpatched else reasons.PATCHED,
            "; ".join(f"{t.name}: {t.message}" for t in unpatched)
            or f"{len(targets)} Deployment(s) load their shard sets",
        )
    not_serving = [t for t in targets if t.state != "Patched"]
    problems = [t for t in not_serving if t.state in TROUBLED_STATES]
    ready = not not_verified and not not_serving
    if ready:
        ready_reason, ready_message = (
            reasons.READY,
            "shards verified and every target's rollout complete",
        )
    elif failed:
        ready_reason, ready_message = failed[0].reason, _describe_sets(failed)
    elif problems:
        ready_reason = problems[0].reason
        ready_message = "; ".join(f"{t.name}: {t.message}" for t in problems)
    elif not_verified:
        ready_reason, ready_message = (
            _first_reason(not_verified, ""),
            _describe_sets(not_verified),
        )
    else:
        ready_reason = not_serving[0].reason
        ready_message = "; ".join(f"{t.name}: {t.message}" for t in not_serving)
    put(conditions.READY, ready, ready_reason, ready_message)
    troubled = [e for e in wanted if e.failures > 0 or (e.stage == "Failed" and e.verified_at)]
    put(
        conditions.DEGRADED,
        bool(troubled),
        troubled[0].reason if troubled else reasons.AS_EXPECTED,
        _describe_sets(troubled) or "no faults",
    )
    return result


def announce(
    context: Context, status: ShardedModelStatus, patches: Sequence[DeploymentPatch]
) -> tuple[Event, ...]:
    """The events of what changed from the previous status to `status`, and of the restores
    among `patches`."""
    events: list[Event] = []
    before = {e.artifact_key: e for e in context.resource.status.shard_sets}
    for entry in status.shard_sets:
        old = before.get(entry.artifact_key)
        if old is not None and (old.stage, old.reason, old.job) == (
            entry.stage,
            entry.reason,
            entry.job,
        ):
            continue
        if old is not None and old.stage == entry.stage == "Verified" and not entry.failures:
            # A periodic check that starts or passes is no news.
            continue
        if old is None and entry.stage == "Probing":
            # Every new set is probed first, and the status says so: what the probe finds is
            # the news.
            continue
        failed = entry.stage == "Failed" or entry.failures > 0
        text = f"TP {entry.tensor_parallel_size} shard set {entry.artifact_key}: {entry.stage}"
        detail = entry.message
        events.append(
            Event(
                "Warning" if failed else "Normal",
                entry.reason or entry.stage,
                clip(f"{text}: {detail}" if detail else text),
            )
        )
    old_targets = {t.name: t for t in context.resource.status.targets}
    for state in status.targets:
        old_target = old_targets.get(state.name)
        if old_target is not None and (
            old_target.state,
            old_target.reason,
            old_target.artifact_key,
        ) == (
            state.state,
            state.reason,
            state.artifact_key,
        ):
            continue
        if old_target is None and state.state == "Waiting":
            # Every new resource waits at first; that is no news.
            continue
        if (
            old_target is not None
            and (old_target.state, state.state) == ("RollingOut", "Patched")
            and old_target.artifact_key == state.artifact_key
            and state.reason in (reasons.PATCHED, reasons.SCALED_TO_ZERO)
        ):
            # The rollout the patch event announced is done: Ready says so.
            continue
        bad = state.state in TROUBLED_STATES or state.reason == reasons.TARGET_IMAGE_CHANGED
        events.append(
            Event(
                "Warning" if bad else "Normal",
                state.reason or state.state,
                clip(f"Deployment {state.name}: {state.message}"),
                deployment=state.name,
            )
        )
    for patch in patches:
        # A patch shows as its target's transition; a restore has no target left to show.
        if patch.restore:
            events.append(
                Event(
                    "Warning" if patch.kept else "Normal",
                    reasons.RESTORED,
                    clip(patching.restore_message(patch.name, patch.kept)),
                    deployment=patch.name,
                )
            )
    return tuple(events)


def _first_reason(entries: Sequence[ShardSetStatus], default: str) -> str:
    return entries[0].reason or entries[0].stage if entries else default


def _describe_sets(entries: Sequence[ShardSetStatus]) -> str:
    return "; ".join(
        f"TP {e.tensor_parallel_size} ({e.artifact_key}): {e.stage}"
        + (f", {e.reason}" if e.reason else "")
        + (f": {e.message}" if e.message else "")
        for e in entries
    )
