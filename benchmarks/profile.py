"""Where the operator's CPU goes: a py-spy profile of it, summed by whose code ran.

`python -m benchmarks.controller --profile` records the operator from the start of apply until
it has settled with py-spy (`record --gil --nonblocking`: only the thread holding the GIL is
sampled, and the operator is never paused), then sums the samples by owner:

- **preshard, reconcile passes**: a thread of the pool that runs the passes, in preshard's code
  or below it (planning, the API client's calls, deep copies, pydantic);
- **preshard, on the event loop**: the event loop's thread in preshard's handlers (the indexes,
  the wake-ups, the daemon's part of a pass) or below them;
- **kopf**: the event loop's thread in kopf and not below a handler of preshard's: its
  processing of every watch event (causes, indexing, handler invocation, queueing);
- **watch streams, JSON**: decoding the watch streams' lines (kopf calls `json.loads`);
- **event loop, sockets, threads**: the rest: asyncio's scheduling, TLS reads and writes,
  hand-offs between the loop and the threads.

A sample is a moment the operator held the GIL. On a machine whose cores are all busy that
includes moments its thread waited for a core, so `seconds` (samples over the rate) is wall
time, not CPU time, and the shares are the figures to read. py-spy is not a dependency: install
it (`pip install py-spy`) or name it in `PRESHARD_PY_SPY`. Its sampling takes a few percent of a
core, so a profiled run's other figures are not compared with unprofiled runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

PY_SPY_ENV: Final = "PRESHARD_PY_SPY"
RATE_HZ: Final = 50

PASSES: Final = "preshard, reconcile passes"
HANDLERS: Final = "preshard, on the event loop"
KOPF: Final = "kopf"
JSON: Final = "watch streams, JSON"
LOOP: Final = "event loop, sockets, threads"
OWNERS: Final = (PASSES, HANDLERS, KOPF, JSON, LOOP)

# The frames every stack of the operator's event loop starts with: its entry point, not work.
_ENTRY: Final = ("preshard/cli.py", "preshard/controller/cli.py")
# A thread's stack, even one py-spy could not unwind to its start, runs through one of these.
_THREAD: Final = ("threading.py", "concurrent/futures/thread.py")


def py_spy() -> str:
    """The py-spy executable, or an error that says how to get one."""
    found = shutil.which(os.environ.get(PY_SPY_ENV) or "py-spy")
    if found is None:
        raise RuntimeError(
            f"profiling needs py-spy: `pip install py-spy`, or its path in ${PY_SPY_ENV}"
        )
    return found


@contextlib.contextmanager
def recording(pid: int, raw: Path) -> Iterator[Path]:
    """Sample process `pid` while the block runs; the samples are in `raw` after it."""
    process = subprocess.Popen(
        [
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--gil",
            "--nonblocking",
            "--rate",
            str(RATE_HZ),
            "--format",
            "raw",
            "--output",
            str(raw),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield raw
    finally:
        # py-spy writes what it sampled when interrupted.
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=120)
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote no profile: {errors.strip()[-2000:]}")


def owner(stack: str) -> str:
    """Whose code one sample (a line of py-spy's raw format, without the count) was in."""
    paths = [_path(frame) for frame in stack.split(";")]
    if any(path.startswith("preshard/") and path not in _ENTRY for path in paths):
        return PASSES if any(path in _THREAD for path in paths) else HANDLERS
    if any(path.startswith("json/") for path in paths):
        return JSON
    if any(path.startswith("kopf/") for path in paths):
        return KOPF
    return LOOP


def summarise(lines: Iterable[str], rate_hz: int = RATE_HZ) -> dict[str, Any]:
    """The samples of a raw py-spy profile, by owner: count, seconds and share of the total."""
    counts = dict.fromkeys(OWNERS, 0)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            counts[owner(stack)] += int(count)
    total = sum(counts.values())
    return {
        "rate_hz": rate_hz,
        "samples": total,
        "seconds": round(total / rate_hz, 1),
        "by_owner": {
            name: {
                "samples": count,
                "seconds": round(count / rate_hz, 1),
                "share": round(count / total, 3) if total else None,
            }
            for name, count in counts.items()
        },
    }


def _path(frame: str) -> str:
    # A frame reads `function (path/to/module.py:line)`; the path is relative to the entry
    # of sys.path it was imported from.
    location = frame.rpartition(" (")[2].rstrip(")")
    return location.rpartition(":")[0] or location
