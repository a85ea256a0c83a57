"""Run the real operator (`preshard run`) as a child process, as production runs it.

Tests start it with a kubeconfig (the admin's, or a ServiceAccount's to prove RBAC), stop it, kill
it mid-work and start it again. Its log goes to a file the test can read and scan.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from preshard.devenv import procs


class OperatorProcess:
    """One `preshard run` process at a time, restartable."""

    def __init__(
        self, kubeconfig: Path, log_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.extra_env = dict(env or {})
        self.process: procs.Process | None = None
        self.port = 0
        self.starts = 0

    @property
    def log_path(self) -> Path:
        """The log of every start so far, appended."""
        return self.log_dir / "operator.log"

    def start(self) -> OperatorProcess:
        """Start the operator and wait until its liveness endpoint answers."""
        self.port = procs.free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        argv = [
            str(Path(sys.executable).with_name("preshard")),
            "run",
            "--liveness",
            f"http://127.0.0.1:{self.port}/healthz",
        ]
        self.process = procs.start("operator", argv, self.log_dir, env=env, stop_timeout=20)
        self.starts += 1
        procs.wait_until(
            lambda: procs.http_ok(f"http://127.0.0.1:{self.port}/healthz"),
            timeout=60,
            what="the operator's liveness endpoint",
            process=self.process,
        )
        return self

    def stop(self) -> None:
        """Stop it gracefully (SIGTERM, as Kubernetes does)."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def kill(self) -> None:
        """Kill it without warning (SIGKILL), as an OOM kill or a node loss would."""
        if self.process is not None and self.process.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.popen.wait(timeout=10)
        self.process = None

    def log(self) -> str:
        """Everything the operator has logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.alive()
