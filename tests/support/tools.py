"""The pinned command-line tools, helm and kubectl, run the way a person runs them: with a clean
environment of their own, as a user of the cluster or with no cluster at all."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ToolError(AssertionError):
    """A helm or kubectl command failed; the message has its stderr."""


@dataclass(frozen=True)
class Tool:
    """A command-line tool run with a clean environment of its own (no user configuration)."""

    binary: Path
    home: Path
    kubeconfig: Path | None = None

    def env(self) -> dict[str, str]:
        """The environment of every run: PATH, a private HOME and Helm directories, KUBECONFIG."""
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def as_user(self, kubeconfig: Path) -> Tool:
        """The same tool acting with another kubeconfig."""
        return Tool(self.binary, self.home, kubeconfig)

    def run(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the tool; with `check`, a non-zero exit raises `ToolError` with its stderr."""
        result = subprocess.run(
            [str(self.binary), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise ToolError(
                f"{self.binary.name} {' '.join(args[:2])} exited with {result.returncode}:\n"
                f"{result.stderr.strip()}"
            )
        return result


def kubectl_apply(kubectl: Tool, manifest: dict[str, Any], directory: Path) -> str:
    """`kubectl apply -f` of one object, as a person would; returns kubectl's output."""
    path = directory / f"{manifest['metadata']['name']}-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return kubectl.run("apply", "-f", str(path)).stdout
