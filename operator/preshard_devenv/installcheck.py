"""No file installed by two distributions: the check `make install` ends with.

When two wheels write the same path, an installer that unpacks wheels in parallel (uv does)
keeps whichever copy it writes last, so the same lock gives a working environment on one
machine and a broken import on the next. This reads every distribution's RECORD in the
environment's site-packages and names each pair of distributions that claim one path. It
uses only the standard library. Run it as `python -m preshard_devenv check-install`.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final

# Overlaps known to be harmless, by path and the distributions that share it, with the reason.
# Any other distribution claiming the same path still fails the check.
ALLOWED: Final[Mapping[tuple[str, frozenset[str]], str]] = {
    ("build_backend.py", frozenset({"flashinfer-python", "torch-c-dlpack-ext"})): (
        "both wheels ship their own build script at the top of site-packages by mistake "
        "(every torch-c-dlpack-ext release does); nothing imports it"
    ),
}


@dataclass(frozen=True)
class Overlap:
    """Files that more than one distribution claims, grouped by the distributions."""

    owners: tuple[str, ...]
    """The distributions, as `name version`, sorted."""
    paths: tuple[str, ...]
    """The shared paths relative to site-packages; those whose copies differ come first."""

    def describe(self) -> str:
        """One line: the distributions, one shared file, and how many more there are."""
        owners = " and ".join(self.owners) + (" both" if len(self.owners) == 2 else " all")
        more = len(self.paths) - 1
        tail = f" (and {more} more file{'s' if more > 1 else ''})" if more else ""
        return f"{owners} install {self.paths[0]}{tail}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _bookkeeping(relative: str) -> bool:
    """A distribution's own metadata, or bytecode an installer compiled: never shared files."""
    parts = Path(relative).parts
    return not parts or parts[0].endswith((".dist-info", ".egg-info")) or "__pycache__" in parts


def site_packages() -> list[Path]:
    """The running interpreter's site-packages directories (purelib and platlib)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()})


def find_overlaps(site_dirs: Iterable[Path]) -> list[Overlap]:
    """Every group of files that two or more distributions in `site_dirs` claim.

    Distributions without a RECORD (nothing to compare) are skipped, as are the entries
    `_bookkeeping` names and overlaps listed in `ALLOWED`.
    """
    dirs = sorted({Path(d).resolve() for d in site_dirs})
    base = dirs[0] if dirs else Path()
    claims: dict[str, dict[str, str | None]] = defaultdict(dict)
    canonical: dict[str, str] = {}
    for dist in metadata.distributions(path=[str(d) for d in dirs]):
        owner = f"{dist.metadata['Name']} {dist.version}"
        canonical[owner] = _canonical(dist.metadata["Name"])
        for file in dist.files or ():
            relative = os.path.relpath(os.path.normpath(str(dist.locate_file(file))), base)
            if not _bookkeeping(relative):
                claims[relative][owner] = file.hash.value if file.hash else None
    groups: dict[tuple[str, ...], list[tuple[bool, str]]] = defaultdict(list)
    for path, owners in claims.items():
        if len(owners) < 2:
            continue
        names = frozenset(canonical[owner] for owner in owners)
        if (path, names) in ALLOWED:
            continue
        identical = len(set(owners.values())) == 1
        groups[tuple(sorted(owners))].append((identical, path))
    return [
        Overlap(owners=owners, paths=tuple(path for _, path in sorted(files)))
        for owners, files in sorted(groups.items())
    ]


def check(site_dirs: Sequence[Path] | None = None) -> tuple[bool, list[str]]:
    """Whether no file is shared, and the lines that say so or name every overlap."""
    dirs = list(site_dirs) if site_dirs else site_packages()
    overlaps = find_overlaps(dirs)
    where = ", ".join(str(d) for d in dirs)
    if not overlaps:
        return True, [f"no file is installed by two distributions in {where}"]
    return False, [
        f"files installed by more than one distribution in {where}; the installer keeps "
        "whichever copy it unpacks last:",
        *(f"  {overlap.describe()}" for overlap in overlaps),
        "Pin the distributions in requirements/overrides.txt so that one owns each file, "
        "then run `make lock`.",
    ]
