"""Checks of a stored shard set: is it complete, and for the tensor-parallel size asked?

A set is complete when its manifest is there and well-formed, lists one rank file per rank of
its TP size, and every file it lists is stored with the recorded size (one GET of the manifest
and one LIST of the prefix). The deep check also re-hashes every file.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from pydantic import ValidationError

from preshard.contract import reasons
from preshard.contract.layout import MANIFEST_NAME, S3Location
from preshard.contract.outcome import Command, Outcome
from preshard.dataplane.download import stream_digest
from preshard.dataplane.errors import DataplaneError
from preshard.dataplane.logs import human_bytes, logger
from preshard.dataplane.manifest import Manifest, ManifestFile
from preshard.dataplane.s3 import get_small_object, list_sizes

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# A message names this many problem files, then counts the rest.
_NAMED_PROBLEMS: Final = 5


@dataclass(frozen=True)
class CheckedSet:
    """A shard set whose manifest and file sizes checked out."""

    location: S3Location
    manifest: Manifest
    listing: dict[str, int]


def read_manifest(client: S3Client, location: S3Location) -> Manifest:
    """The set's manifest; `ManifestMissing` or `ManifestInvalid` when there is none to trust."""
    body = get_small_object(client, location, MANIFEST_NAME)
    if body is None:
        raise DataplaneError(
            reasons.MANIFEST_MISSING, f"there is no {MANIFEST_NAME} under {location.uri}"
        )
    try:
        return Manifest.model_validate(json.loads(body))
    except (ValueError, ValidationError) as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else []
        where = ", ".join(".".join(str(p) for p in e["loc"]) for e in errors[:3])
        detail = f" (bad fields: {where})" if where else ""
        raise DataplaneError(
            reasons.MANIFEST_INVALID,
            f"{location.uri}{MANIFEST_NAME} is not a valid manifest{detail}",
        ) from exc


def check_shard_set(
    client: S3Client,
    location: S3Location,
    *,
    tensor_parallel_size: int | None,
    artifact_key: str | None = None,
) -> CheckedSet:
    """Check manifest, TP size, artifact key and every file's presence and size."""
    manifest = read_manifest(client, location)
    _check_layout(manifest, location, tensor_parallel_size)
    if artifact_key is not None and manifest.artifact_key != artifact_key:
        raise DataplaneError(
            reasons.MANIFEST_INVALID,
            f"{location.uri} holds artifact {manifest.artifact_key}, not {artifact_key}",
        )
    listing = list_sizes(client, location)
    missing = [f.name for f in manifest.files if f.name not in listing]
    if missing:
        raise DataplaneError(reasons.SHARD_MISSING, f"{location.uri} lacks {_name_some(missing)}")
    wrong = [f for f in manifest.files if listing[f.name] != f.size]
    if wrong:
        details = [f"{f.name} (expected {f.size} bytes, found {listing[f.name]})" for f in wrong]
        raise DataplaneError(
            reasons.SIZE_MISMATCH,
            f"{location.uri} has files of the wrong size: {_name_some(details)}",
        )
    return CheckedSet(location, manifest, listing)


def _check_layout(
    manifest: Manifest, location: S3Location, tensor_parallel_size: int | None
) -> None:
    shard_names = [f.name for f in manifest.shards]
    expected = manifest.expected_shard_names()
    if shard_names != expected:
        raise DataplaneError(
            reasons.TP_MISMATCH,
            f"{location.uri}{MANIFEST_NAME} records TP {manifest.tensor_parallel_size} but lists "
            f"{len(shard_names)} rank files ({_name_some(shard_names) or 'none'})",
        )
    if tensor_parallel_size is not None and manifest.tensor_parallel_size != tensor_parallel_size:
        raise DataplaneError(
            reasons.TP_MISMATCH,
            f"{location.uri} was made for tensor-parallel size {manifest.tensor_parallel_size}, "
            f"not {tensor_parallel_size}",
        )


def deep_check(client: S3Client, checked: CheckedSet, *, concurrency: int) -> None:
    """Re-checksum every file of a checked set; `HashMismatch` names the files that differ."""
    files = checked.manifest.files
    logger().info(
        "checksumming %d files (%s) of %s",
        len(files),
        human_bytes(checked.manifest.total_bytes),
        checked.location.uri,
    )

    def matches(entry: ManifestFile) -> bool:
        algorithm, expected = entry.checksum
        digest, _ = stream_digest(client, checked.location, entry.name, algorithm)
        return digest == expected

    with concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="s3-hash") as pool:
        results = list(pool.map(matches, files))
    bad = [entry.name for entry, ok in zip(files, results, strict=True) if not ok]
    if bad:
        raise DataplaneError(
            reasons.HASH_MISMATCH,
            f"{checked.location.uri} has files whose checksum differs from the manifest: "
            f"{_name_some(bad)}",
        )


def _name_some(items: list[str]) -> str:
    named = ", ".join(items[:_NAMED_PROBLEMS])
    rest = len(items) - _NAMED_PROBLEMS
    return f"{named} and {rest} more" if rest > 0 else named


def set_outcome(
    command: Command, reason: str, message: str, uri: str, manifest: Manifest
) -> Outcome:
    """The successful outcome of a command about one shard set, from its manifest."""
    return Outcome.model_validate(
        {
            "command": command,
            "ok": True,
            "reason": reason,
            "message": message,
            "uri": uri,
            "artifactKey": manifest.artifact_key,
            "tensorParallelSize": manifest.tensor_parallel_size,
            "totalBytes": manifest.total_bytes,
            "files": len(manifest.files),
            "vllmVersion": manifest.vllm_version,
            "tensorizerVersion": manifest.tensorizer_version,
            "encrypted": manifest.encrypted,
            "manifestFormat": manifest.format_version,
        }
    )
