"""A reconciler leaves out a pass whose input is that of its last pass, which wrote nothing."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from preshard.controller.handlers import PassInput, PassMemory
from preshard.controller.observe import JobView, PodView
from preshard.controller.plan import Observed
from tests.support.specs import kwok_spec

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def resource(**metadata: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "llama",
            "namespace": "ns",
            "uid": "u-1",
            "generation": 1,
            "resourceVersion": "10",
            "finalizers": ["preshard.dev/cleanup"],
            **metadata,
        },
        "spec": kwok_spec(),
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


def observed(phase: str = "Running", now: datetime = NOW) -> Observed:
    pod = PodView(name="llama-verify-1-x", created="2026-01-01T00:00:00Z", phase=phase)
    job = JobView(
        name="llama-verify-1",
        command="verify",
        finished=False,
        succeeded=False,
        condition_reason=None,
        condition_message="",
        pods=(pod,),
    )
    return Observed(jobs={job.name: job}, deployments={}, now=now)


def planned(
    body: dict[str, Any], seen: Observed, deleted: frozenset[str] = frozenset()
) -> PassInput:
    return PassInput.of(body, seen, deleted)


def test_what_every_write_or_the_clock_changes_is_not_an_input() -> None:
    first = planned(resource(), observed())
    later = resource(resourceVersion="11", finalizers=[], labels={"team": "serving"})
    assert planned(later, observed(now=NOW + timedelta(minutes=5))) == first


@pytest.mark.parametrize(
    ("body", "seen", "deleted"),
    [
        (resource(generation=2), observed(), frozenset()),
        (resource(annotations={"preshard.dev/retry": "1"}), observed(), frozenset()),
        (resource(deletionTimestamp="2026-01-01T00:01:00Z"), observed(), frozenset()),
        (resource(), observed(phase="Succeeded"), frozenset()),
        (resource(), observed(), frozenset({"llama-verify-1"})),
    ],
    ids=["spec", "annotation", "deletion", "pod phase", "deleted job"],
)
def test_what_planning_reads_is_an_input(
    body: dict[str, Any], seen: Observed, deleted: frozenset[str]
) -> None:
    assert planned(body, seen, deleted) != planned(resource(), observed())


def test_a_status_change_is_an_input() -> None:
    body = resource()
    changed = copy.deepcopy(body)
    changed["status"]["conditions"][0]["status"] = "False"
    assert planned(changed, observed()) != planned(body, observed())


def test_only_a_settled_pass_with_time_left_is_repeated() -> None:
    memory = PassMemory()
    same = planned(resource(), observed())
    assert memory.remaining(same) is None

    memory.remember(None, 60.0)
    assert memory.remaining(same) is None, "the last pass wrote: the next one runs"

    memory.remember(same, 60.0)
    left = memory.remaining(planned(resource(resourceVersion="12"), observed()))
    assert left is not None
    assert 0 < left <= 60.0
    assert memory.remaining(planned(resource(), observed(phase="Failed"))) is None

    memory.forget()
    assert memory.remaining(same) is None, "after a failed pass the next one runs"

    memory.remember(same, 0.0)
    assert memory.remaining(same) is None, "the settled pass's timer is due: it runs"


def test_the_targets_are_parsed_once_per_generation() -> None:
    memory = PassMemory()
    first = memory.interest(resource())
    assert first.names == frozenset({"vllm"})
    renamed = resource()
    renamed["spec"]["targets"] = [{"name": "other"}]
    assert memory.interest(renamed) is first, "the same generation has the same spec"
    renamed["metadata"]["generation"] = 2
    assert memory.interest(renamed).names == frozenset({"other"})
