"""kopf's start-up barrier, without waking every waiting worker on every change.

When the operator starts, kopf holds back every object's handlers until each index has been
filled from the first listing of its kind. Each object's worker waits on one
`aiotoggles.ToggleSet` for the whole operator (`ToggleSet.wait_for`: one `asyncio.Condition`),
and each listed object of an indexed kind adds a toggle to that set and drops it once indexed,
each change a `notify_all`. Every change therefore wakes every worker already waiting, and each
of them takes the condition's lock in turn to look at the set again: about n²/2 wake-ups for n
objects of the watched kinds. preshard indexes all four of its kinds, so n is the ShardedModels,
the Deployments, preshard's Jobs and their pods, and the pods of patched Deployments. The
controller benchmark's restart over 1000 Ready ShardedModels (4000 objects) spent about 20 CPU
seconds there, and four minutes with 3000 more pods to list.

`install()` lets the waiters of one set share one wait: the first waiter for a state waits on
kopf's condition exactly as before, and the later ones await its result. A change then wakes
one task, not all of them. Each waiter still returns once the set has been seen in the state it
waits for; one waiter's cancellation cancels only its own wait.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Final

from kopf._cogs.aiokits.aiotoggles import ToggleSet

Wait = Callable[[ToggleSet, bool], Coroutine[Any, Any, None]]

_GATES: Final[weakref.WeakKeyDictionary[ToggleSet, dict[bool, asyncio.Future[None]]]] = (
    weakref.WeakKeyDictionary()
)


def shared(wait: Wait) -> Wait:
    """A `ToggleSet.wait_for` in which the waiters for a state share one call of `wait`."""

    async def wait_for(toggles: ToggleSet, state: bool, /) -> None:
        state = bool(state)
        if toggles.is_on() == state:
            return
        gates = _GATES.setdefault(toggles, {})
        gate = gates.get(state)
        if gate is None or gate.done():
            gate = gates[state] = asyncio.ensure_future(wait(toggles, state))
        await asyncio.shield(gate)

    wait_for.__wrapped__ = wait  # type: ignore[attr-defined]
    return wait_for


def install() -> None:
    """Make kopf's `ToggleSet.wait_for` shared, once per process."""
    if not hasattr(ToggleSet.wait_for, "__wrapped__"):
        ToggleSet.wait_for = shared(ToggleSet.wait_for)  # type: ignore[method-assign,assignment]
