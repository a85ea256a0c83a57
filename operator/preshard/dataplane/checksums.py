"""The checksums a shard set's files are checked by: CRC64/NVME, and sha256 for older sets.

A file's CRC64/NVME (the polynomial of S3's default full-object checksum) is computed with the
AWS CRT's vectorised code, several GB/s per core: the uploader takes one per part, sends it
as the part's `x-amz-checksum-crc64nvme` header for the server to check, and combines the
parts' values into the whole file's, so every byte is checksummed once. Sets written before
preshard recorded CRC64/NVME carry a sha256 per file instead; every reader still checks those.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Final, Literal, Protocol

from awscrt import checksums

Algorithm = Literal["crc64nvme", "sha256"]
CRC64NVME: Final = "crc64nvme"
SHA256: Final = "sha256"
READ_CHUNK: Final = 8 << 20


class Hasher(Protocol):
    """What a digest of a stream of chunks offers (`hashlib`'s shape)."""

    def update(self, data: bytes, /) -> None:
        """Add the next bytes."""

    def hexdigest(self) -> str:
        """The digest of everything added, as the manifest records it."""


def crc64nvme(data: bytes, previous: int = 0) -> int:
    """The CRC64/NVME of `data`, or of `data` following bytes whose CRC64/NVME is `previous`."""
    crc: int = checksums.crc64nvme(data, previous)
    return crc


def to_hex(crc: int) -> str:
    """A CRC64/NVME as the manifest records it: 16 lower-case hex digits."""
    return f"{crc:016x}"


def combine(parts: Iterable[tuple[int, int]]) -> str:
    """The hex CRC64/NVME of consecutive parts, each given as its own CRC64/NVME and length."""
    whole = Crc64Nvme()
    for crc, length in parts:
        whole.add_part(crc, length)
    return whole.hexdigest()


def s3_header(crc: int) -> str:
    """The base64 big-endian value that S3's `x-amz-checksum-crc64nvme` header carries."""
    return base64.b64encode(crc.to_bytes(8, "big")).decode()


class Crc64Nvme:
    """A running CRC64/NVME, fed bytes in order or whole parts' checksums in order."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes, /) -> None:
        """Add the next bytes."""
        self._crc = crc64nvme(data, self._crc)

    def add_part(self, crc: int, length: int) -> None:
        """Add the next `length` bytes by their own CRC64/NVME, without reading them again."""
        self._crc = int(checksums.combine_crc64nvme(self._crc, crc, length))

    def hexdigest(self) -> str:
        """16 lower-case hex digits."""
        return to_hex(self._crc)


def new_hasher(algorithm: Algorithm) -> Hasher:
    """An empty digest of `algorithm`."""
    return Crc64Nvme() if algorithm == CRC64NVME else hashlib.sha256()


def digest_of_bytes(data: bytes, algorithm: Algorithm) -> str:
    """The digest of a whole body."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def digest_of_file(path: Path, algorithm: Algorithm) -> str:
    """The digest of a local file, read in large chunks."""
    hasher = new_hasher(algorithm)
    with path.open("rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()
