"""How long the measured steps of a test run took, printed at the run's end (the end-to-end
tests' summary hook)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

TIMINGS: list[tuple[str, float]] = []


def record(what: str, seconds: float) -> None:
    """Keep a measured duration for the run's summary."""
    TIMINGS.append((what, seconds))


@contextmanager
def stopwatch(what: str) -> Iterator[None]:
    """Measure the enclosed block and `record` it."""
    started = time.monotonic()
    yield
    record(what, time.monotonic() - started)
