"""Start, watch and stop the local processes of the test environment, and wait for what they
do: `wait_for` is the one polling loop of the tooling, the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn, Self, TypeVar

T = TypeVar("T")


class DevEnvError(RuntimeError):
    """A step of the local environment failed; the message says which and how to fix it."""


class Service(ABC):
    """Something that runs between `start()` and `stop()`; a `with` block does both."""

    @abstractmethod
    def start(self) -> Self:
        """Start it and wait until it serves."""

    @abstractmethod
    def stop(self) -> None:
        """Stop it and what it started."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def interrupt_on_signals() -> None:
    """Stop on SIGTERM (`kill`, `timeout`, a cancelled CI job) and SIGHUP (a closed terminal)
    as on Ctrl-C: through a `KeyboardInterrupt`, so that what this process started is stopped
    by its `finally` and exit callbacks instead of outliving it. Ctrl-C is restored too: a
    shell starts a background job with SIGINT ignored."""

    def interrupt(signum: int, _frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt(f"received signal {signum}")

    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on right now.

    All sockets stay bound until every port is chosen, so the kernel cannot hand out the
    same port twice (choosing ports one by one can, and a server then fails to bind).
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


@dataclass
class Process:
    """One child process with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    stop_timeout: float = 15.0
    _stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        """The process id (also the process group id: each child leads its own group)."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The end of the process's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL: always by this process's own pid and group."""
        if self._stopped:
            return
        self._stopped = True
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


def start(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stop_timeout: float = 15.0,
) -> Process:
    """Start a process in its own session, its output appended to `<log_dir>/<name>.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    return Process(name=name, popen=popen, log_path=log_path, stop_timeout=stop_timeout)


def wait_for(
    check: Callable[[], T | None],
    *,
    timeout: float = 60.0,
    interval: float = 0.2,
    what: str = "the condition",
) -> T:
    """Poll `check` until it returns something truthy, and return that; `TimeoutError` after
    `timeout` seconds.

    The default limit is generous on purpose: on a busy machine (two cores, another test suite
    beside this one) the control plane takes its time, and a wait that holds returns at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_until(
    check: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    process: Process | None = None,
    interval: float = 0.2,
) -> None:
    """`wait_for` a process of the environment: fail with its log if it dies or times out."""

    def alive_and() -> bool:
        if process is not None and not process.alive():
            raise DevEnvError(
                f"{process.name} exited with code {process.popen.returncode} while waiting "
                f"for {what}; the end of {process.log_path}:\n{process.log_tail()}"
            )
        return check()

    try:
        wait_for(alive_and, timeout=timeout, interval=interval, what=what)
    except TimeoutError as error:
        tail = f"; the end of {process.log_path}:\n{process.log_tail()}" if process else ""
        raise DevEnvError(f"{error}{tail}") from None


def http_ok(url: str, *, context: ssl.SSLContext | None = None) -> bool:
    """Whether a GET of `url` answers 2xx (connection errors count as no)."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:  # noqa: S310 - loopback URLs only
            return 200 <= int(response.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False
