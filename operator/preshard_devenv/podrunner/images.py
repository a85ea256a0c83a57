"""Container images on this machine: what an image provides here (`LocalImage`), and the
local program a container's argv[0] names."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

CONTAINER_PATH: Final = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class LocalImage:
    """What a container image provides on this machine."""

    bin_dir: Path | None = None
    """Its programs (a virtualenv's `bin`), searched before the container's PATH."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Its `ENV`: a container's own `env` wins over it."""
    entrypoint: tuple[str, ...] = ()
    """Its `ENTRYPOINT`, run when a container sets `args` but no `command`."""


def image_repository(image: str) -> str:
    """`image` without its tag or digest: `vllm/vllm-openai:v0.34.0` -> `vllm/vllm-openai`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def resolve_executable(argv0: str, path: str, bin_dir: Path | None = None) -> str | None:
    """The local program for a container's argv[0], or None when it does not exist here."""
    here = Path(sys.executable).parent if bin_dir is None else bin_dir
    if argv0 == "preshard":
        return str(here / "preshard")
    if argv0 in ("python", "python3"):
        return str(here / "python") if bin_dir is not None else sys.executable
    if "/" in argv0:
        return argv0 if os.access(argv0, os.X_OK) and Path(argv0).is_file() else None
    return shutil.which(argv0, path=path)
