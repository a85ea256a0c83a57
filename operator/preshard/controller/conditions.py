"""Conditions, set the Kubernetes way: one pure function, one list written whole."""

from __future__ import annotations

from typing import Final

from preshard.api.status import Condition, ConditionStatus

READY: Final = "Ready"
SERIALIZED: Final = "Serialized"
VERIFIED: Final = "Verified"
TARGETS_PATCHED: Final = "TargetsPatched"
DEGRADED: Final = "Degraded"

# The order `kubectl describe` shows them in.
ORDER: Final = (READY, SERIALIZED, VERIFIED, TARGETS_PATCHED, DEGRADED)


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    now: str,
    generation: int | None,
) -> list[Condition]:
    """A new list with one condition set; `lastTransitionTime` moves only when status flips."""
    previous = next((c for c in conditions if c.type == type_), None)
    transition = (
        previous.last_transition_time if previous is not None and previous.status == status else now
    )
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=transition,
        observed_generation=generation,
    )
    others = [c for c in conditions if c.type != type_]
    return sorted([*others, new], key=_position)


def find(conditions: list[Condition], type_: str) -> Condition | None:
    """The condition of a type, if set."""
    return next((c for c in conditions if c.type == type_), None)


def _position(condition: Condition) -> int:
    return ORDER.index(condition.type) if condition.type in ORDER else len(ORDER)
