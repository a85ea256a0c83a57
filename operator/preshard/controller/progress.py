"""How far a running serialize or reshard Job is, read from the tail of its pod's log.

The operator reads no Secret and talks to no S3, so the data plane cannot hand it a progress
object; and its pods get no API token, so they cannot write one to the API either. What they
have is their log, which the data plane already writes a progress line to every few seconds
(`preshard.dataplane.logs`: `upload: 1.20 GiB of 4.00 GiB (30%), 250.0 MB/s, ...`) and whose
secrets it already redacts. The operator reads the last lines of that log through the API
(`pods/log`, a few KiB), at most once per `PRESHARD_PROGRESS_SECONDS` per pod, and only for
running serialize and reshard Jobs.

What it reports moves in steps: a percentage is cut down to a multiple of `STEP_PERCENT`, and
the rate and time left are those measured when the step was reached, so that a set's status
changes (and costs a write) at most once per step and per poll, not on every poll.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

STEP_PERCENT: Final = 5
# How many log lines, and bytes, one read asks for: the last progress line is among them, since
# the data plane writes one every few seconds.
TAIL_LINES: Final = 20
TAIL_BYTES: Final = 16 * 1024
# A pod not asked about for this long is forgotten (its Job finished or went).
FORGET_SECONDS: Final = 900.0

_UNITS: Final = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE: Final = r"[0-9.]+ (?:B|KiB|MiB|GiB|TiB)"
_BYTES: Final = re.compile(
    rf"^(?P<label>download|upload): (?P<done>{_SIZE}) of (?P<total>{_SIZE})"
    r"(?: \(\d+%\), (?P<rate>[0-9.]+) MB/s)?"
)
_TENSORS: Final = re.compile(r"^reshard: (?P<done>\d+) of (?P<total>\d+) tensors")
_ENGINE: Final = re.compile(r"^engine: ")
# A text line: `<time> <LEVEL> <command>: <message>` (see the data plane's formatter).
_TEXT_LINE: Final = re.compile(r"^\S+ [A-Z]+\s+[a-z-]+: (?P<message>.*)$")


@dataclass(frozen=True)
class Step:
    """One reported state of a running Job: the stage and the step reached in it."""

    key: tuple[str, int]
    """(stage, percent cut down to a step; -1 for a stage without a measure): a new key is
    news, the same key is not."""
    text: str
    """What the status shows."""


def parse_size(text: str) -> float:
    """`1.20 GiB` as bytes."""
    number, unit = text.split(" ")
    return float(number) * _UNITS[unit]


def human(count: float) -> str:
    """A byte count as the data plane writes it, for the status."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if count >= _UNITS[unit]:
            return f"{count / _UNITS[unit]:.2f} {unit}"
    return f"{int(count)} B"


def message_of(line: str) -> str:
    """The message of one data-plane log line, text or JSON."""
    line = line.strip()
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return ""
        message = record.get("message") if isinstance(record, dict) else None
        return message if isinstance(message, str) else ""
    found = _TEXT_LINE.match(line)
    return found.group("message") if found else ""


def latest_step(log_tail: str) -> Step | None:
    """The step of the last progress line in a log tail; None when it has none."""
    for line in reversed(log_tail.splitlines()):
        step = step_of(message_of(line))
        if step is not None:
            return step
    return None


def step_of(message: str) -> Step | None:
    """The step one progress message reports, or None for any other message."""
    found = _BYTES.match(message)
    if found:
        done, total = parse_size(found["done"]), parse_size(found["total"])
        percent = _stepped(done, total)
        text = f"{found['label']} {percent}% of {human(total)}"
        rate = float(found["rate"]) * 1e6 if found["rate"] else 0.0
        if rate > 0 and total > done:
            text += f", {rate / 1e6:.0f} MB/s, about {_duration((total - done) / rate)} left"
        return Step((found["label"], percent), text)
    found = _TENSORS.match(message)
    if found:
        percent = _stepped(int(found["done"]), int(found["total"]))
        return Step(("reshard", percent), f"reshard {percent}% of {found['total']} tensors")
    if _ENGINE.match(message):
        return Step(("engine", -1), "engine: vLLM is writing the rank files")
    return None


def _stepped(done: float, total: float) -> int:
    percent = 100.0 * done / total if total else 100.0
    return int(min(percent, 100.0) // STEP_PERCENT * STEP_PERCENT)


def _duration(seconds: float) -> str:
    whole = round(seconds)
    if whole < 120:
        return f"{whole} s"
    if whole < 7200:
        return f"{whole // 60} min"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


ReadTail = Callable[[str, str], str]
"""Reads the tail of a pod's log: (namespace, pod) -> text; raises on failure."""


class ProgressReader:
    """The steps of running Job pods, each read at most once per `interval` seconds.

    Shared by the reconcile daemons; a read that fails (no log yet, a node that serves none)
    keeps the step known before, or none.
    """

    def __init__(self, read_tail: ReadTail, interval: float) -> None:
        self._read_tail = read_tail
        self._interval = interval
        self._lock = threading.Lock()
        # (namespace, pod) -> (last read, last asked, step)
        self._known: dict[tuple[str, str], tuple[float, float, Step | None]] = {}

    @property
    def interval(self) -> float:
        """Seconds between two reads of one pod's log."""
        return self._interval

    def step(self, namespace: str, pod: str) -> Step | None:
        """The pod's step: read again when the last read is `interval` old, else as known."""
        now = time.monotonic()
        key = (namespace, pod)
        with self._lock:
            self._forget_old(now)
            read_at, _, known = self._known.get(key, (float("-inf"), now, None))
            if now - read_at < self._interval:
                self._known[key] = (read_at, now, known)
                return known
            # Claimed before the read, so two daemons do not both read the same pod.
            self._known[key] = (now, now, known)
        try:
            tail = self._read_tail(namespace, pod)
        except Exception:  # noqa: BLE001 - no log is no progress; the Job's outcome still counts
            return known
        found = latest_step(tail)
        if found is None or (known is not None and found.key == known.key):
            return known
        with self._lock:
            self._known[key] = (now, now, found)
        return found

    def _forget_old(self, now: float) -> None:
        stale = [k for k, (_, asked, _) in self._known.items() if now - asked > FORGET_SECONDS]
        for key in stale:
            del self._known[key]
