"""Log lines of the data-plane commands: plain text or JSON, progress at a steady pace.

Every line passes through a redacting formatter: the values of the credential variables the
commands read are replaced by `***` wherever they would appear, tracebacks included.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Final, Literal

LOGGER_NAME: Final = "preshard"
LogFormat = Literal["text", "json"]

# Environment variables whose values must never be printed.
SECRET_ENV_VARS: Final = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "S3_SECRET_ACCESS_KEY",
)
# Short values would blank out ordinary words; real secrets are far longer.
_MIN_SECRET_LENGTH: Final = 8

PROGRESS_INTERVAL_ENV: Final = "PRESHARD_PROGRESS_INTERVAL"
DEFAULT_PROGRESS_INTERVAL: Final = 5.0


def logger() -> logging.Logger:
    """The logger every data-plane module writes to."""
    return logging.getLogger(LOGGER_NAME)


def secret_values() -> list[str]:
    """The secrets present in this process's environment, longest first."""
    found = {os.environ.get(name, "") for name in SECRET_ENV_VARS}
    return sorted((v for v in found if len(v) >= _MIN_SECRET_LENGTH), key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every secret from the environment replaced by `***`."""
    for secret in secret_values():
        text = text.replace(secret, "***")
    return text


class _RedactingFormatter(logging.Formatter):
    def __init__(self, log_format: LogFormat, command: str) -> None:
        super().__init__()
        self._json = log_format == "json"
        self._command = command

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        when = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        when = when.replace("+00:00", "Z")
        if self._json:
            line = json.dumps(
                {
                    "time": when,
                    "level": record.levelname.lower(),
                    "command": self._command,
                    "logger": record.name,
                    "message": message,
                }
            )
        else:
            line = f"{when} {record.levelname:<7} {self._command}: {message}"
        return redact(line)


@contextmanager
def configured(log_format: LogFormat, command: str) -> Iterator[None]:
    """Send preshard's log (and library warnings) to stderr for the length of a command."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RedactingFormatter(log_format, command))
    ours = logger()
    root = logging.getLogger()
    saved = (ours.level, ours.propagate, root.level)
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ours.removeHandler(handler)
        root.removeHandler(handler)
        ours.setLevel(saved[0])
        ours.propagate = saved[1]
        root.setLevel(saved[2])


def human_bytes(count: float) -> str:
    """A byte count for people: `512 B`, `3.4 MiB`, `1.20 GiB`."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


def progress_interval() -> float:
    """Seconds between progress lines (`PRESHARD_PROGRESS_INTERVAL`, default 5)."""
    try:
        value = float(os.environ.get(PROGRESS_INTERVAL_ENV, DEFAULT_PROGRESS_INTERVAL))
    except ValueError:
        return DEFAULT_PROGRESS_INTERVAL
    return value if value > 0 else DEFAULT_PROGRESS_INTERVAL


class Progress:
    """Counts bytes done of a known total and logs a line every few seconds from a thread."""

    def __init__(self, label: str, total_bytes: int, *, total_files: int | None = None) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self._done_bytes = 0
        self._done_files = 0
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, count: int) -> None:
        """Count `count` more bytes as done."""
        with self._lock:
            self._done_bytes += count

    def file_done(self) -> None:
        """Count one more file as done."""
        with self._lock:
            self._done_files += 1

    @property
    def done_bytes(self) -> int:
        """Bytes counted so far."""
        with self._lock:
            return self._done_bytes

    def line(self) -> str:
        """One progress line: bytes done of total, percent, rate, files."""
        with self._lock:
            done, files = self._done_bytes, self._done_files
        elapsed = max(time.monotonic() - self._started, 1e-6)
        percent = 100.0 * done / self.total_bytes if self.total_bytes else 100.0
        text = (
            f"{self.label}: {human_bytes(done)} of {human_bytes(self.total_bytes)} "
            f"({percent:.0f}%), {done / elapsed / 1e6:.1f} MB/s"
        )
        if self.total_files is not None:
            text += f", {files} of {self.total_files} files"
        return text

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"progress-{self.label}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        interval = progress_interval()
        while not self._stop.wait(interval):
            logger().info("%s", self.line())


@contextmanager
def heartbeat(describe: Callable[[], str]) -> Iterator[None]:
    """Log `describe()` every few seconds while a long step without its own progress runs."""
    stop = threading.Event()
    started = time.monotonic()

    def run() -> None:
        interval = progress_interval()
        while not stop.wait(interval):
            logger().info("%s (%.0fs)", describe(), time.monotonic() - started)

    thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
