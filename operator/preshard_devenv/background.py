"""The environment for people: a cluster and an S3 server left running in the background.

`up` starts both detached from the calling process and records them in `<state dir>/state.json`
(pids, kubeconfig, S3 endpoint); `down` stops exactly the pids recorded there. The S3
credentials go only to `<state dir>/env` (mode 0600), never to the terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.pki import write_private
from preshard_devenv.procs import DevEnvError, wait_for
from preshard_devenv.s3server import S3Server, admin_client, make_bucket, start_s3_server

Log = Callable[[str], None]

BUCKET: Final = "preshard"
STATE_FILE: Final = "state.json"
ENV_FILE: Final = "env"


@dataclass(frozen=True)
class RecordedProcess:
    """A detached process: its pid and the executable it must still be running."""

    name: str
    pid: int
    executable: str
    stop_timeout: float

    def alive(self) -> bool:
        """Whether this pid still runs the recorded executable (not a reused pid)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
        cmdline = Path(f"/proc/{self.pid}/cmdline")
        if not cmdline.exists():
            return True
        argv0 = cmdline.read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        return argv0 == self.executable


@dataclass(frozen=True)
class State:
    """What `up` started, as written to the state file."""

    kubeconfig: str
    server: str
    s3_endpoint: str
    bucket: str
    env_file: str
    processes: list[RecordedProcess] = field(default_factory=list)

    def to_json(self) -> str:
        """The state file's text."""
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> State:
        """Parse a state file."""
        data = json.loads(text)
        data["processes"] = [RecordedProcess(**p) for p in data["processes"]]
        return cls(**data)


def read_state(state_dir: Path) -> State | None:
    """The recorded state, or None when nothing was started there."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        return State.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as error:
        raise DevEnvError(
            f"{path} is not a state file this version understands ({error}); stop any "
            f"processes it lists by hand, then remove {state_dir}"
        ) from None


def up(state_dir: Path, *, log: Log) -> tuple[State, bool]:
    """Start the cluster and the S3 server unless they already run; returns (state, started)."""
    state_dir = state_dir.resolve()
    existing = read_state(state_dir)
    if existing is not None:
        if all(p.alive() for p in existing.processes):
            return existing, False
        log("some processes of the previous environment are gone; restarting all of it")
        down(state_dir, log=log)
    for sub in ("cluster", "s3"):
        shutil.rmtree(state_dir / sub, ignore_errors=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(state_dir / "cluster").start(stop_at_exit=False, log=log)
    try:
        log("starting the S3 server")
        s3 = start_s3_server(state_dir / "s3")
        try:
            make_bucket(admin_client(s3), BUCKET, exist_ok=True)
            env_file = _write_env(state_dir / ENV_FILE, cluster, s3)
        except BaseException:
            s3.stop()
            raise
    except BaseException:
        cluster.stop()
        raise
    recorded = [
        RecordedProcess(name, p.pid, str(p.popen.args[0]), p.stop_timeout)  # type: ignore[index]
        for name, p in [*cluster.processes.items(), ("seaweedfs", s3.process)]
    ]
    state = State(
        kubeconfig=str(cluster.admin_kubeconfig),
        server=cluster.server,
        s3_endpoint=s3.endpoint,
        bucket=BUCKET,
        env_file=str(env_file),
        processes=recorded,
    )
    (state_dir / STATE_FILE).write_text(state.to_json())
    return state, True


def down(state_dir: Path, *, log: Log) -> bool:
    """Stop every process recorded in the state file, newest first; False if none was."""
    state = read_state(state_dir.resolve())
    if state is None:
        return False
    for process in reversed(state.processes):
        if process.alive():
            log(f"stopping {process.name} (pid {process.pid})")
            _terminate(process)
    (state_dir / STATE_FILE).unlink()
    return True


def status_lines(state: State) -> list[str]:
    """One line per recorded process and endpoint, for `status`."""
    lines = [f"kube-apiserver  {state.server}", f"S3 endpoint     {state.s3_endpoint}"]
    lines += [f"kubeconfig      {state.kubeconfig}", f"bucket          {state.bucket}"]
    for process in state.processes:
        word = "running" if process.alive() else "STOPPED"
        lines.append(f"{process.name:<24} pid {process.pid:<8} {word}")
    return lines


def exports(state: State) -> list[str]:
    """The shell lines that point a terminal at the environment (no secrets)."""
    return [
        f"export KUBECONFIG={shlex.quote(state.kubeconfig)}",
        f"set -a; . {shlex.quote(state.env_file)}; set +a   # S3 endpoint and credentials",
    ]


def _terminate(process: RecordedProcess) -> None:
    # Each process leads its own process group (it was started in a new session).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        wait_for(lambda: not process.alive(), timeout=process.stop_timeout, what=process.name)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def _write_env(path: Path, cluster: LocalCluster, s3: S3Server) -> Path:
    values = {"KUBECONFIG": str(cluster.admin_kubeconfig), **s3.env()}
    values["PRESHARD_S3_BUCKET"] = BUCKET
    text = "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())
    write_private(path, text.encode())
    return path
