"""The profile summary of the controller benchmark: which owner each py-spy sample goes to.

The stacks are in py-spy's raw format as `py-spy record --gil --format raw` writes them for the
operator: frames from the outermost, `function (module path:line)`, separated by `;`, then the
number of samples.
"""

from __future__ import annotations

import pytest
from benchmarks import profile

ENTRY = (
    "<module> (preshard:10);main (preshard/cli.py:62);_run (preshard/controller/cli.py:103);"
    "run (asyncio/runners.py:190);BaseEventLoop.run_forever (asyncio/base_events.py:607);"
    "BaseEventLoop._run_once (asyncio/base_events.py:1922);Handle._run (asyncio/events.py:80)"
)
THREAD = (
    "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982);"
    "_worker (concurrent/futures/thread.py:83);_WorkItem.run (concurrent/futures/thread.py:58)"
)
KOPF_EVENT = (
    f"{ENTRY};worker (kopf/_core/reactor/queueing.py:300);"
    "process_resource_event (kopf/_core/reactor/processing.py:120)"
)
HANDLER = (
    f"{ENTRY};index_resource (kopf/_core/engines/indexing.py:400);"
    "invoke (kopf/_core/actions/invocation.py:110);"
    "deployment_index (preshard/controller/handlers.py:360);deepcopy (copy.py:128)"
)
PASS = (
    f"{THREAD};Reconciler.reconcile (preshard/controller/reconciler.py:150);"
    "Kube.patch_status (preshard/controller/kube.py:90);SSLSocket.send (ssl.py:1210)"
)
TRUNCATED_PASS = (
    "_WorkItem.run (concurrent/futures/thread.py:58);"
    "plan_targets (preshard/controller/plan/targets.py:40)"
)
STREAM = (
    f"{ENTRY};watch_objs (kopf/_cogs/clients/watching.py:250);"
    "stream (kopf/_cogs/clients/api.py:278);loads (json/__init__.py:346);"
    "JSONDecoder.raw_decode (json/decoder.py:353)"
)
LOOP = f"{ENTRY};EpollSelector.select (selectors.py:468)"
HAND_OFF = f"{THREAD};Future.set_result (concurrent/futures/_base.py:550)"


@pytest.mark.parametrize(
    ("stack", "owner"),
    [
        (KOPF_EVENT, profile.KOPF),
        (HANDLER, profile.HANDLERS),
        (PASS, profile.PASSES),
        (TRUNCATED_PASS, profile.PASSES),
        (STREAM, profile.JSON),
        (LOOP, profile.LOOP),
        (HAND_OFF, profile.LOOP),
    ],
    ids=["kopf", "handler", "pass", "truncated-pass", "json", "loop", "hand-off"],
)
def test_a_sample_belongs_to_the_code_it_ran_in(stack: str, owner: str) -> None:
    # The operator's entry point is on every stack of the event loop: it is not preshard's work.
    assert profile.owner(stack) == owner


def test_the_summary_counts_seconds_and_shares_by_owner() -> None:
    lines = [f"{KOPF_EVENT} 30\n", f"{PASS} 15\n", f"{HANDLER} 5\n", "\n"]

    summary = profile.summarise(lines, rate_hz=10)

    assert (summary["samples"], summary["seconds"]) == (50, 5.0)
    by_owner = summary["by_owner"]
    assert list(by_owner) == list(profile.OWNERS)
    assert by_owner[profile.KOPF] == {"samples": 30, "seconds": 3.0, "share": 0.6}
    assert by_owner[profile.PASSES] == {"samples": 15, "seconds": 1.5, "share": 0.3}
    assert by_owner[profile.HANDLERS] == {"samples": 5, "seconds": 0.5, "share": 0.1}
    assert by_owner[profile.JSON] == {"samples": 0, "seconds": 0.0, "share": 0.0}


def test_without_py_spy_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profile.PY_SPY_ENV, "no-such-py-spy")

    with pytest.raises(RuntimeError, match="pip install py-spy"):
        profile.py_spy()
