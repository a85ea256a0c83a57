"""The manifest: the commit marker of a shard set, written last.

A shard set without a well-formed manifest is never complete. The manifest records what the
set was made for (TP size, vLLM and tensorizer versions, dtype, encryption on/off, never the
key) and each file's size and checksum, so `preshard verify` can check it without a GPU. A set
made by `preshard reshard` also records the set it was made from.

Format 2 records each file's CRC64/NVME; format 1 (sets made by earlier versions) a sha256.
Both are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from preshard.contract.layout import MANIFEST_FORMAT, rank_file_names
from preshard.dataplane.checksums import (
    CRC64NVME,
    SHA256,
    Algorithm,
    digest_of_bytes,
    digest_of_file,
)


class ManifestFile(BaseModel):
    """One object of the shard set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[^/]+(/[^/]+)*$")
    size: int = Field(ge=0)
    crc64nvme: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{16}$", exclude_if=lambda value: value is None
    )
    sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", exclude_if=lambda value: value is None
    )
    kind: Literal["shard", "config"]

    @model_validator(mode="after")
    def _has_a_checksum(self) -> ManifestFile:
        if self.crc64nvme is None and self.sha256 is None:
            raise ValueError(f"{self.name} has neither a crc64nvme nor a sha256")
        return self

    @property
    def checksum(self) -> tuple[Algorithm, str]:
        """The algorithm the file is checked by, and its recorded digest."""
        if self.crc64nvme is not None:
            return CRC64NVME, self.crc64nvme
        assert self.sha256 is not None  # noqa: S101 - the validator requires one of the two
        return SHA256, self.sha256

    def matches_bytes(self, body: bytes) -> bool:
        """Whether `body` has the recorded checksum."""
        algorithm, expected = self.checksum
        return digest_of_bytes(body, algorithm) == expected

    def matches_file(self, path: Path) -> bool:
        """Whether the local file has the recorded checksum."""
        algorithm, expected = self.checksum
        return digest_of_file(path, algorithm) == expected


class ReshardedFrom(BaseModel):
    """Where a resharded set's tensors came from: the set `preshard reshard` read."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    uri: str = Field(min_length=1)
    artifact_key: str = Field(alias="artifactKey", min_length=1)
    tensor_parallel_size: int = Field(alias="tensorParallelSize", ge=1)


class Manifest(BaseModel):
    """The `manifest.json` of a shard set."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    format_version: Literal[1, 2] = Field(default=MANIFEST_FORMAT, alias="formatVersion")
    artifact_key: str = Field(alias="artifactKey", min_length=1)
    model: str = Field(min_length=1)
    revision: str | None = None
    tensor_parallel_size: int = Field(alias="tensorParallelSize", ge=1)
    dtype: str
    vllm_version: str = Field(alias="vllmVersion")
    tensorizer_version: str = Field(alias="tensorizerVersion")
    encrypted: bool
    created: str
    files: tuple[ManifestFile, ...]
    resharded_from: ReshardedFrom | None = Field(default=None, alias="reshardedFrom")
    """Set only on a set `preshard reshard` made; absent from the JSON otherwise, so a set
    serialized by vLLM has the manifest it always had."""

    @property
    def shards(self) -> list[ManifestFile]:
        """The rank files, in rank order."""
        return sorted((f for f in self.files if f.kind == "shard"), key=lambda f: f.name)

    @property
    def config_files(self) -> list[ManifestFile]:
        """The non-weight files vLLM reads from its model directory."""
        return [f for f in self.files if f.kind == "config"]

    @property
    def total_bytes(self) -> int:
        """The size of every file the manifest lists."""
        return sum(f.size for f in self.files)

    def expected_shard_names(self) -> list[str]:
        """The rank file names a set of this TP size must hold."""
        return rank_file_names(self.tensor_parallel_size)

    def to_json(self) -> str:
        """The manifest as stored: camelCase keys, stable order."""
        exclude = {"resharded_from"} if self.resharded_from is None else None
        return self.model_dump_json(by_alias=True, indent=2, exclude=exclude) + "\n"
