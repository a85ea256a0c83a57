"""A pod's containers as local processes: starting one with its environment, paths and
image, its state and readiness as the kubelet reports them, its exit and termination message,
and killing what still runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from preshard_devenv.podrunner.images import CONTAINER_PATH, LocalImage, resolve_executable
from preshard_devenv.podrunner.podspec import PathMap, expand, readiness_url
from preshard_devenv.podrunner.status import now

TERMINATION_LOG_ENV: Final = "PRESHARD_TERMINATION_LOG"
MAX_KILL_GRACE: Final = 5.0
_MESSAGE_LIMIT: Final = 4096
_FALLBACK_LOG_LINES: Final = 80
_FALLBACK_LOG_BYTES: Final = 2048


@dataclass
class ContainerRun:
    """One container of a running pod, and what the kubelet would report about it."""

    spec: dict[str, Any]
    init: bool
    restart_count: int = 0
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "PodInitializing"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    server: bool = False
    started_at: str = ""
    log_path: Path | None = None
    message_path: Path | None = None
    probe_url: str | None = None
    """The readiness probe's URL; None means Ready while running."""
    probe_ok: bool = False

    @property
    def name(self) -> str:
        """The container's name."""
        return str(self.spec["name"])

    @property
    def terminated(self) -> dict[str, Any] | None:
        """The terminated state, if the container has exited."""
        value = self.state.get("terminated")
        return value if isinstance(value, dict) else None

    @property
    def running(self) -> bool:
        """Whether the container is running (a server or a live process)."""
        return "running" in self.state

    @property
    def ready(self) -> bool:
        """Whether the container is running and its readiness probe, if any, passes."""
        return self.running and (self.probe_url is None or self.server or self.probe_ok)

    def probe(self) -> bool:
        """Run the readiness probe once; True when the readiness changed."""
        if self.probe_url is None or not self.running:
            return False
        try:
            with urllib.request.urlopen(self.probe_url, timeout=1) as answer:  # noqa: S310 - loopback
                status: int = answer.status
            ok = 200 <= status < 400
        except (urllib.error.URLError, OSError):
            ok = False
        changed = ok != self.probe_ok
        self.probe_ok = ok
        return changed

    def status(self) -> dict[str, Any]:
        """The container status entry."""
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.running,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.process is not None or self.server:
            status["containerID"] = f"preshard-runner://{self.name}-{self.restart_count}"
        return status

    def start(
        self,
        image: LocalImage,
        env: Mapping[str, str],
        paths: PathMap,
        *,
        pod_dir: Path,
        tmp: Path,
        hostname: str,
        extra_env: Mapping[str, str],
    ) -> None:
        """Start the container in `pod_dir`: its process, or a server that runs nothing here.

        `env` is the container's own resolved environment, `paths` maps its mount paths to
        local directories; `extra_env` is the runner's, below the image's and the container's.
        """
        command = [paths(expand(a, env)) for a in self.spec.get("command") or image.entrypoint]
        args = [paths(expand(a, env)) for a in self.spec.get("args") or []]
        env = {k: paths(v) for k, v in env.items()}
        self.message_path = pod_dir / "termination" / self.name
        self.message_path.parent.mkdir(parents=True, exist_ok=True)
        self.message_path.write_bytes(b"")
        logs = pod_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{self.name}.log"
        base = {
            "PATH": f"{image.bin_dir}:{CONTAINER_PATH}" if image.bin_dir else CONTAINER_PATH,
            "HOME": str(pod_dir / "home"),
            "TMPDIR": str(tmp),
            "HOSTNAME": hostname,
            "LANG": "C.UTF-8",
        }
        for key in ("HOME", "TMPDIR"):
            Path(base[key]).mkdir(parents=True, exist_ok=True)
        full_env = {**base, **extra_env, **image.env, **env}
        full_env[TERMINATION_LOG_ENV] = str(self.message_path)
        executable = (
            resolve_executable(command[0], full_env["PATH"], image.bin_dir) if command else None
        )
        self.started_at = now()
        self.state = {"running": {"startedAt": self.started_at}}
        self.probe_url = readiness_url(self.spec)
        self.probe_ok = False
        if executable is None:
            self.server = True
            return
        working_dir = self.spec.get("workingDir")
        cwd = Path(paths(working_dir)) if working_dir else pod_dir
        cwd.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [executable, *command[1:], *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )

    def record_exit(self) -> None:
        """Take the exited process's code and termination message into the state."""
        if self.process is None:
            return
        code = self.process.returncode
        if code < 0:
            # The kubelet reports a signal as 128 + its number.
            code = 128 - code
        message = ""
        if self.message_path is not None and self.message_path.exists():
            with self.message_path.open("rb") as handle:
                message = handle.read(_MESSAGE_LIMIT).decode(errors="replace")
        if (
            not message
            and code != 0
            and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        ):
            message = self.log_tail()
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": self.started_at,
            "finishedAt": now(),
            "containerID": f"preshard-runner://{self.name}-{self.restart_count}",
        }
        if message:
            terminated["message"] = message
        self.state = {"terminated": terminated}

    def log_tail(self) -> str:
        """The end of the container's output, as `FallbackToLogsOnError` reports it."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_bytes().splitlines()[-_FALLBACK_LOG_LINES:]
        return b"\n".join(lines)[-_FALLBACK_LOG_BYTES:].decode(errors="replace")


def kill_all(runs: Iterable[ContainerRun], grace: float) -> None:
    """SIGTERM every live process of `runs`, then SIGKILL what still runs after `grace`
    seconds (capped at `MAX_KILL_GRACE`)."""
    grace = min(grace, MAX_KILL_GRACE)
    live = [r.process for r in runs if r.process is not None and r.process.poll() is None]
    for process in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in live:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
