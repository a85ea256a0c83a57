"""The scratch volume of `preshard serialize`: is there room for the model and its shards?

The filesystem's free space is not the whole answer on Kubernetes: an `emptyDir` with a
`sizeLimit` reports the node's free space while the kubelet evicts the pod past the limit. So
the room left is the smaller of the free space and, when `--scratch-size-limit` is given, that
limit minus what the directory already holds.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from preshard.contract import reasons
from preshard.dataplane.errors import DataplaneError
from preshard.dataplane.logs import human_bytes


def directory_bytes(path: Path) -> int:
    """The bytes of every regular file under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                continue
    return total


@dataclass(frozen=True)
class ScratchEstimate:
    """The room a serialization needs on the scratch volume."""

    source_bytes: int
    shard_bytes: int
    reusable_bytes: int = 0

    @property
    def needed_bytes(self) -> int:
        """Bytes still to be written: the download and the shards, less what is already there."""
        return max(0, self.source_bytes + self.shard_bytes - self.reusable_bytes)


def available_bytes(scratch: Path, size_limit: int | None) -> int:
    """The bytes that can still be written under `scratch`."""
    free = shutil.disk_usage(scratch).free
    if size_limit is None:
        return free
    return max(0, min(free, size_limit - directory_bytes(scratch)))


def check_room(scratch: Path, estimate: ScratchEstimate, size_limit: int | None) -> None:
    """Fail with `InsufficientScratch` when the estimate does not fit."""
    available = available_bytes(scratch, size_limit)
    if estimate.needed_bytes > available:
        parts = f"the model {human_bytes(estimate.source_bytes)} + shards about " + human_bytes(
            estimate.shard_bytes
        )
        if estimate.reusable_bytes:
            parts += f" - {human_bytes(estimate.reusable_bytes)} already there"
        raise DataplaneError(
            reasons.INSUFFICIENT_SCRATCH,
            f"scratch {scratch} needs about {human_bytes(estimate.needed_bytes)} ({parts}) "
            f"but only {human_bytes(available)} is free",
        )
