"""Running data-plane commands as a pod would: their own environment, to their outcome."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from preshard.contract.outcome import Outcome
from preshard_devenv.s3server import S3Server


def pod_env(s3_server: S3Server, home: Path) -> dict[str, str]:
    """A pod's environment: the S3 credentials and endpoint, nothing of this process."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home), **s3_server.env()}


def run_preshard(
    executable: Path, args: list[str], env: Mapping[str, str], log: Path, timeout: float
) -> Outcome:
    """Run one data-plane command to its end; its outcome, with its output on failure."""
    termination = log.with_suffix(".outcome")
    with log.open("wb") as output:
        finished = subprocess.run(
            [str(executable), *args, "--termination-log", str(termination)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=dict(env),
            timeout=timeout,
            check=False,
        )
    outcome = Outcome.model_validate_json(termination.read_text())
    assert finished.returncode == 0, log.read_text()[-4000:]
    return outcome
