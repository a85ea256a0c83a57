"""`make run` as a new user meets it: no kube context, the walk-through followed to the letter.

`python -m preshard_devenv run-operator` (what `make run` runs) starts a local control plane and
S3 server, then the operator and the test kubelet with vLLM's CPU build. The test applies the
example it prints with `kubectl`, waits for the completion it prints once the ShardedModel is
Ready, asks the patched vLLM again on the port the printed `curl` names, and then stops it with
SIGTERM, as `kill` or `timeout` would: it must exit 0 and leave none of the processes it started
behind (the operator, `vllm serve`), only the cluster that `make dev-cluster-down` stops.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

import pytest

from preshard_devenv import background, binaries, engine, realrun
from preshard_devenv.procs import wait_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.engine]

# The local cluster's start, the serialization at TP 2 and the patched server's start, on two
# busy cores.
READY_SECONDS: Final = 600.0


class _Output:
    """The lines a process writes to a pipe, read by a thread as they come."""

    def __init__(self, pipe: IO[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait(self, pattern: str, *, timeout: float, run: subprocess.Popen[str]) -> str:
        """The first group of the first line that matches `pattern`."""

        def found() -> str | None:
            match = re.search(pattern, self.text(), re.MULTILINE)
            if match is None and run.poll() is not None:
                pytest.fail(f"`make run` exited ({run.returncode}) before printing {pattern!r}")
            return match.group(1) if match else None

        return wait_for(found, timeout=timeout, interval=1.0, what=f"output {pattern!r}")


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process: its parent's pid and its command line (zombies left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rpartition(")")[2].split()[:2]
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if state != "Z":
            found[int(entry.name)] = (int(parent), " ".join(argv.decode().split("\0")[:-1]))
    return found


def _started_by(root: int, cluster: set[int]) -> dict[int, str]:
    """The processes below `root`, less the cluster's and those below them: pid, command line."""
    processes = _processes()
    below: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, command) in processes.items():
            if ppid == parent and pid not in cluster:
                below[pid] = command
                frontier.append(pid)
    return below


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    yield state
    subprocess.run(
        [sys.executable, "-m", "preshard_devenv", "down", "--state-dir", str(state)],
        capture_output=True,
        timeout=300,
        check=False,
    )


@pytest.mark.timeout(READY_SECONDS + 300)
def test_make_run_serves_the_shards_it_made_and_stops_everything_on_sigterm(
    state_dir: Path, tmp_path: Path
) -> None:
    # No kube context: `make run` starts its own cluster instead of using one.
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    with (tmp_path / "stderr.log").open("w") as stderr:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "preshard_devenv",
                "run-operator",
                "--state-dir",
                str(state_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=tmp_path,
        )
    assert run.stdout is not None
    output = _Output(run.stdout)
    started: dict[int, str] = {}
    try:
        example = output.wait(r"^\s+kubectl apply -f (\S+)$", timeout=READY_SECONDS, run=run)
        kubeconfig = output.wait(r"^\s+export KUBECONFIG=(\S+)$", timeout=1, run=run)
        subprocess.run(
            [str(binaries.tool_path("kubectl")), "apply", "-f", example],
            env={**os.environ, "KUBECONFIG": kubeconfig},
            capture_output=True,
            timeout=60,
            check=True,
        )
        printed = output.wait(r"\(token ids \[([\d, ]+)\]\)$", timeout=READY_SECONDS, run=run)
        port = output.wait(r"http://127\.0\.0\.1:(\d+)/v1/completions", timeout=1, run=run)

        again = engine.complete(f"http://127.0.0.1:{port}", realrun.SERVED_MODEL, realrun.PROMPT)
        assert list(again.token_ids) == [int(t) for t in printed.split(",")]

        state = background.read_state(state_dir)
        assert state is not None
        started = _started_by(run.pid, {p.pid for p in state.processes})
        assert any(" serve " in c for c in started.values()), started
        assert any(c.endswith(" run --liveness ") for c in started.values()), started

        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 0, (tmp_path / "stderr.log").read_text()[-4000:]
        wait_until(
            lambda: not started.keys() & _processes().keys(),
            timeout=30,
            what=f"what `make run` started to exit: {sorted(started.values())}",
        )
        assert "stopping the operator and the pods it runs" in (tmp_path / "stderr.log").read_text()
        assert "`make dev-cluster-down` stops them" in output.text()
        assert all(p.alive() for p in state.processes), "the cluster keeps running"
    finally:
        run.kill()
        for pid in started.keys() & _processes().keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
