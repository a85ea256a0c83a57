"""Run the real operator (`preshard run`) as a child process, as production runs it.

Tests and benchmarks start it with a kubeconfig (the admin's, or a ServiceAccount's to prove
RBAC), with the args and environment the Helm chart gives it or plain defaults, stop it, kill
it mid-work and start it again. Its log goes to a file they can read and scan.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from preshard_devenv import procs

LIVENESS: str = "--liveness"


class OperatorProcess(procs.Service):
    """One `preshard <args>` process at a time, restartable.

    Only the liveness endpoint is changed from the args given: it binds a free port on
    loopback. With `inherit_env` false the process sees `env` and its kubeconfig only, as a
    container sees its own environment.
    """

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        *,
        args: Sequence[str] = ("run",),
        inherit_env: bool = True,
        entrypoint: Sequence[str] = (),
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.extra_env = dict(env or {})
        self.args = list(args)
        self.inherit_env = inherit_env
        self.entrypoint = list(entrypoint)
        """The command that runs preshard; empty for the installed `preshard` entrypoint."""
        self.process: procs.Process | None = None
        self.port = 0
        self.starts = 0

    @property
    def log_path(self) -> Path:
        """The log of every start so far, appended."""
        return self.log_dir / "operator.log"

    def argv(self, liveness_url: str) -> list[str]:
        """The command line: the installed entrypoint, the args, this liveness endpoint."""
        args = [a for a in self.args if not a.startswith(LIVENESS + "=")]
        if LIVENESS in args:
            position = args.index(LIVENESS)
            del args[position : position + 2]
        entrypoint = self.entrypoint or [str(Path(sys.executable).with_name("preshard"))]
        return [*entrypoint, *args, f"{LIVENESS}={liveness_url}"]

    def start(self, *, timeout: float = 60.0) -> OperatorProcess:
        """Start the operator and wait until its liveness endpoint answers."""
        self.port = procs.free_port()
        url = f"http://127.0.0.1:{self.port}/healthz"
        base = dict(os.environ) if self.inherit_env else {"PATH": os.environ.get("PATH", "")}
        env = {
            **base,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.process = procs.start(
            "operator", self.argv(url), self.log_dir, env=env, cwd=self.log_dir, stop_timeout=20
        )
        self.starts += 1
        try:
            procs.wait_until(
                lambda: procs.http_ok(url),
                timeout=timeout,
                what="the operator's liveness endpoint",
                process=self.process,
            )
        except BaseException:
            self.stop()
            raise
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

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.alive()

    def log(self) -> str:
        """Everything the operator has logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        """The end of the operator's log, for failure messages."""
        return "\n".join(self.log().splitlines()[-lines:])
