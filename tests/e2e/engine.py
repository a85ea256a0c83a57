"""The CPU test engine, with a switchboard the end-to-end tests use to hold or fail a run.

Serialization pods run as local processes (the pod runner), so a test can reach the engine
of a running `preshard serialize` through files in a directory named by an environment
variable every runner container gets. While `hold` exists the engine waits before it writes
(the pod stays Running for as long as the test needs: to kill the operator, stop the S3
server, restart the API server or delete the ShardedModel); while `fail` exists the engine
fails the way a crashing vLLM would. Without either file it is exactly `CpuTestEngine`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from preshard.dataplane.engine import EngineRequest
from preshard_devenv.cpuengine import CpuTestEngine
from preshard_devenv.procs import wait_for

SPEC: Final = "tests.e2e.engine:ControlledEngine"
CONTROL_ENV: Final = "PRESHARD_E2E_ENGINE_CONTROL"
# A held engine gives up waiting after this long, so a test that dies mid-way frees the pod.
HOLD_LIMIT_SECONDS: Final = 120.0
_POLL_SECONDS: Final = 0.1


class EngineFailureError(RuntimeError):
    """The failure a test asked for."""


@dataclass(frozen=True)
class EngineControl:
    """The switchboard's directory, as tests and the engine see it."""

    directory: Path

    @property
    def hold_file(self) -> Path:
        """While it exists, engines wait before writing."""
        return self.directory / "hold"

    @property
    def fail_file(self) -> Path:
        """While it exists, engines fail."""
        return self.directory / "fail"

    @property
    def waiting_file(self) -> Path:
        """Written by an engine while it waits on `hold`."""
        return self.directory / "waiting"

    def hold(self) -> None:
        """Make the next engines wait until `release`."""
        self.waiting_file.unlink(missing_ok=True)
        self.hold_file.touch()

    def release(self) -> None:
        """Let waiting engines go on."""
        self.hold_file.unlink(missing_ok=True)

    def fail(self) -> None:
        """Make engines fail until `heal`."""
        self.fail_file.touch()

    def heal(self) -> None:
        """Let engines succeed again."""
        self.fail_file.unlink(missing_ok=True)

    def reset(self) -> None:
        """Neither hold nor fail."""
        self.release()
        self.heal()
        self.waiting_file.unlink(missing_ok=True)

    def engine_waiting(self) -> bool:
        """Whether an engine has reached the hold (download done, nothing written yet)."""
        return self.waiting_file.exists()


class ControlledEngine(CpuTestEngine):
    """`CpuTestEngine` that obeys the switchboard named by `PRESHARD_E2E_ENGINE_CONTROL`."""

    def serialize(self, request: EngineRequest) -> None:
        """Wait while held, fail when told to, else serialize on the CPU."""
        directory = os.environ.get(CONTROL_ENV)
        if directory:
            control = EngineControl(Path(directory))
            if control.hold_file.exists():
                control.waiting_file.write_text(str(os.getpid()))
            with contextlib.suppress(TimeoutError):
                wait_for(
                    lambda: not control.hold_file.exists(),
                    timeout=HOLD_LIMIT_SECONDS,
                    interval=_POLL_SECONDS,
                    what="the hold to be lifted",
                )
            if control.fail_file.exists():
                raise EngineFailureError("the engine failed (a test asked it to)")
        super().serialize(request)
