"""kopf's start-up barrier, on kopf's own `ToggleSet`, as its watchers and workers use it.

kopf's watcher adds a toggle for each listed object of an indexed kind and starts its worker,
which drops the toggle once the object is indexed and then waits for the whole set. The count
that matters is how often the set is looked at (`ToggleSet.is_on`): each look is a waiter woken
and taking the condition's lock.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from kopf._cogs.aiokits.aiotoggles import Toggle, ToggleSet

from preshard.controller import kopf_barrier

OBJECTS = 300


@dataclass
class Looks:
    count: int = 0


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> Looks:
    """Counts `ToggleSet.is_on`, on kopf's own `wait_for`, restored after the test."""
    counted = Looks()
    is_on = ToggleSet.is_on

    def counting(toggles: ToggleSet) -> bool:
        counted.count += 1
        return is_on(toggles)

    monkeypatch.setattr(ToggleSet, "is_on", counting)
    # kopf's own, even where this process has installed the shared one already.
    monkeypatch.setattr(
        ToggleSet, "wait_for", getattr(ToggleSet.wait_for, "__wrapped__", ToggleSet.wait_for)
    )
    return counted


async def start_up(objects: int) -> list[float]:
    """kopf's start-up in miniature: a blocker, then one toggle and one worker per listed
    object, the watcher yielding to the workers between objects. When each worker got through."""
    loop = asyncio.get_running_loop()
    indexed = ToggleSet(all)
    blocker = await indexed.make_toggle(name="orchestration blocker")
    through: list[float] = []

    async def worker(toggle: Toggle) -> None:
        await asyncio.sleep(0)
        await indexed.drop_toggle(toggle)
        await indexed.wait_for(True)
        through.append(loop.time())

    workers = []
    for number in range(objects):
        toggle = await indexed.make_toggle(name=str(number))
        workers.append(asyncio.create_task(worker(toggle)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert not through, "a worker got through before every object was listed"
    released = loop.time()
    await indexed.drop_toggle(blocker)
    await asyncio.gather(*workers)
    assert all(moment >= released for moment in through)
    return through


def test_kopf_wakes_every_waiting_worker_on_every_change(looks: Looks) -> None:
    """The cause, in the kopf this project pins: if this fails, kopf no longer wakes every
    waiter, and `kopf_barrier` may go."""
    asyncio.run(start_up(OBJECTS))
    assert looks.count > OBJECTS * OBJECTS / 4


def test_installed_the_waiters_share_one_wait(looks: Looks) -> None:
    kopf_barrier.install()
    through = asyncio.run(start_up(OBJECTS))
    assert len(through) == OBJECTS
    assert looks.count <= 3 * OBJECTS


def test_install_is_idempotent(looks: Looks) -> None:
    kopf_barrier.install()
    installed = ToggleSet.wait_for
    kopf_barrier.install()
    assert ToggleSet.wait_for is installed


def test_a_cancelled_waiter_leaves_the_others_waiting(looks: Looks) -> None:
    kopf_barrier.install()

    async def scenario() -> None:
        paused = ToggleSet(any)
        peer = await paused.make_toggle(True, name="peer")
        waiters = [asyncio.create_task(paused.wait_for(False)) for _ in range(3)]
        await asyncio.sleep(0.01)
        waiters[0].cancel()
        await asyncio.sleep(0.01)
        assert not any(waiter.done() for waiter in waiters[1:])
        await peer.turn_to(False)
        await asyncio.wait_for(asyncio.gather(*waiters[1:]), timeout=1)
        assert waiters[0].cancelled()
        # Already in the state: no wait at all.
        await asyncio.wait_for(paused.wait_for(False), timeout=0.01)

    asyncio.run(scenario())
