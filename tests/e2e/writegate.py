"""The operator with a gate before its Deployment patches, so that a test can make a competing
edit land between the operator's read of a Deployment and its write, every time.

Run as the operator's entrypoint (`python -m tests.e2e.writegate run ...`), this is `preshard`
with one change: while `<gate>/<namespace>.<name>.hold` exists, a patch of that Deployment first
writes `<namespace>.<name>.held` (the JSON patch, as planned) and then waits for the hold to go
away. What it sends afterwards, and everything else, is the operator's own code. The gate
directory is named by `GATE_ENV`; without a hold file nothing waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from preshard import cli
from preshard.controller import kube
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for

GATE_ENV: Final = "PRESHARD_E2E_WRITE_GATE"
# A held patch goes on after this long, so a test that dies mid-way leaves no operator stuck.
HOLD_LIMIT_SECONDS: Final = 300.0
_POLL_SECONDS: Final = 0.05
_ROOT: Final = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WriteGate:
    """The gate's directory, as tests and the gated operator see it."""

    directory: Path

    def file(self, namespace: str, name: str, what: str) -> Path:
        """One of a Deployment's files: `hold` (the test's) or `held` (the operator's)."""
        return self.directory / f"{namespace}.{name}.{what}"

    def hold(self, namespace: str, name: str) -> None:
        """Make the operator's next patches of this Deployment wait until `release`."""
        self.file(namespace, name, "held").unlink(missing_ok=True)
        self.file(namespace, name, "hold").touch()

    def release(self, namespace: str, name: str) -> None:
        """Let a held patch of this Deployment go to the API server."""
        self.file(namespace, name, "hold").unlink(missing_ok=True)

    def held(self, namespace: str, name: str) -> list[dict[str, Any]] | None:
        """The patch waiting at the gate, once the operator has planned one."""
        path = self.file(namespace, name, "held")
        if not path.exists():
            return None
        patch: list[dict[str, Any]] = json.loads(path.read_text())
        return patch

    def wait(self, namespace: str, name: str) -> None:
        """What the gated operator does before patching a Deployment: wait while it is held."""
        hold = self.file(namespace, name, "hold")
        with contextlib.suppress(TimeoutError):
            wait_for(
                lambda: not hold.exists(),
                timeout=HOLD_LIMIT_SECONDS,
                interval=_POLL_SECONDS,
                what="the hold to be lifted",
            )

    @contextmanager
    def installed(self, operator: OperatorProcess) -> Iterator[None]:
        """Run `operator` through the gate (a restart), and as it was again afterwards."""
        saved_entrypoint, saved_env = operator.entrypoint, dict(operator.extra_env)
        operator.stop()
        operator.entrypoint = [sys.executable, "-m", __name__]
        operator.extra_env.update({GATE_ENV: str(self.directory), "PYTHONPATH": str(_ROOT)})
        try:
            operator.start(timeout=60)
            yield
        finally:
            for path in self.directory.glob("*.hold"):
                path.unlink(missing_ok=True)
            operator.stop()
            operator.entrypoint, operator.extra_env = saved_entrypoint, saved_env
            operator.start(timeout=60)


def _gate_patches(gate: WriteGate) -> None:
    """Put the gate in front of every Deployment patch the operator makes."""
    patch_deployment = kube.Kube.patch_deployment

    def gated(self: kube.Kube, namespace: str, name: str, patch: list[kube.Manifest]) -> None:
        if gate.file(namespace, name, "hold").exists():
            held = gate.file(namespace, name, "held")
            held.with_suffix(".tmp").write_text(json.dumps(patch))
            held.with_suffix(".tmp").replace(held)
            gate.wait(namespace, name)
        patch_deployment(self, namespace, name, patch)

    kube.Kube.patch_deployment = gated  # type: ignore[method-assign] # the gate, by design


if __name__ == "__main__":
    _gate_patches(WriteGate(Path(os.environ[GATE_ENV])))
    sys.exit(cli.main())
