"""`preshard verify`, `fetch-config` and `delete`: the small commands around a shard set."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Final

from preshard.contract import reasons
from preshard.contract.layout import MANIFEST_NAME, S3Location
from preshard.contract.outcome import Command, Outcome
from preshard.dataplane.download import PARTIAL_SUFFIX, local_path, stream_digest
from preshard.dataplane.errors import DataplaneError, classify_s3_error
from preshard.dataplane.logs import human_bytes, logger
from preshard.dataplane.manifest import ManifestFile
from preshard.dataplane.s3 import list_sizes, require_prefix
from preshard.dataplane.shardset import CheckedSet, check_shard_set, deep_check, set_outcome
from preshard.dataplane.upload import abort_incomplete_uploads

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# S3's limit of keys in one DeleteObjects request.
DELETE_BATCH: Final = 1000
DELETE_PASSES: Final = 3
CHECK_CONCURRENCY: Final = 8
# Where the tools image keeps the tensorizer it hands to vLLM images that have none
# (`pip install --target`, pure Python: tensorizer and the two imports it needs that vLLM's
# image lacks). The image sets the variable; the Dockerfile is the source of truth.
TENSORIZER_BUNDLE_ENV: Final = "PRESHARD_TENSORIZER_BUNDLE"


def _summary(command: Command, reason: str, message: str, checked: CheckedSet) -> Outcome:
    return set_outcome(command, reason, message, checked.location.uri, checked.manifest)


def verify(
    client: S3Client,
    location: S3Location,
    *,
    tensor_parallel_size: int,
    artifact_key: str | None,
    deep: bool,
) -> Outcome:
    """Check that the shard set at `location` is complete for `tensor_parallel_size`."""
    require_prefix(location, "verify")
    checked = check_shard_set(
        client, location, tensor_parallel_size=tensor_parallel_size, artifact_key=artifact_key
    )
    if deep:
        deep_check(client, checked, concurrency=CHECK_CONCURRENCY)
    manifest = checked.manifest
    how = "sizes and checksums" if deep else "sizes"
    message = (
        f"complete: {len(manifest.files)} files, {human_bytes(manifest.total_bytes)}, "
        f"TP {manifest.tensor_parallel_size} ({how} checked)"
    )
    logger().info("%s is %s", location.uri, message)
    return _summary("verify", reasons.VERIFIED, message, checked)


def fetch_config(
    client: S3Client,
    location: S3Location,
    directory: Path,
    *,
    tensorizer_dir: Path | None = None,
) -> Outcome:
    """Copy the non-weight files of a complete shard set into `directory`, each checked
    against its manifest checksum.

    With `tensorizer_dir`, also copy this image's tensorizer bundle there: the stock vLLM
    image has no tensorizer, and the patched container finds it on its `PYTHONPATH`.
    """
    require_prefix(location, "fetch-config")
    bundle = _tensorizer_bundle() if tensorizer_dir is not None else None
    checked = check_shard_set(client, location, tensor_parallel_size=None)
    configs = checked.manifest.config_files
    directory.mkdir(parents=True, exist_ok=True)
    targets = {entry.name: local_path(directory, entry.name) for entry in configs}

    def fetch(entry: ManifestFile) -> None:
        target = targets[entry.name]
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        try:
            algorithm, expected = entry.checksum
            digest, size = stream_digest(client, location, entry.name, algorithm, target=partial)
            if digest != expected or size != entry.size:
                raise DataplaneError(
                    reasons.HASH_MISMATCH,
                    f"{entry.name} under {location.uri} does not match its manifest entry",
                )
            partial.replace(target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()

    with concurrent.futures.ThreadPoolExecutor(CHECK_CONCURRENCY) as pool:
        for future in [pool.submit(fetch, entry) for entry in configs]:
            future.result()
    total = sum(entry.size for entry in configs)
    message = f"copied {len(configs)} config files ({human_bytes(total)}) into {directory}"
    if bundle is not None and tensorizer_dir is not None:
        shutil.copytree(bundle, tensorizer_dir, dirs_exist_ok=True)
        message += f", and tensorizer into {tensorizer_dir}"
    logger().info("%s", message)
    outcome = _summary("fetch-config", reasons.CONFIG_FETCHED, message, checked)
    return outcome.model_copy(update={"files": len(configs), "total_bytes": total})


def _tensorizer_bundle() -> Path:
    """The tools image's tensorizer bundle; checked before any file is copied."""
    configured = os.environ.get(TENSORIZER_BUNDLE_ENV)
    bundle = Path(configured) if configured else None
    if bundle is None or not (bundle / "tensorizer" / "__init__.py").is_file():
        raise DataplaneError(
            reasons.INTERNAL_ERROR,
            f"--tensorizer-dir: this image has no tensorizer bundle (${TENSORIZER_BUNDLE_ENV}"
            f"={configured or ''}); use a preshard tools image built from its Dockerfile",
        )
    return bundle


def delete(client: S3Client, location: S3Location) -> Outcome:
    """Remove one shard set: its manifest first, then every object under `prefix/`."""
    require_prefix(location, "delete")
    try:
        listing = list_sizes(client, location)
    except DataplaneError as exc:
        if exc.reason != reasons.BUCKET_NOT_FOUND:
            raise
        return Outcome(
            command="delete",
            ok=True,
            reason=reasons.DELETED,
            message=f"the bucket of {location.uri} does not exist; nothing to delete",
            uri=location.uri,
            files=0,
        )
    # Unconditionally: a manifest written after the LIST must not outlive its files.
    _delete_keys(client, location, [MANIFEST_NAME])
    abort_incomplete_uploads(client, location)
    removed, removed_bytes = len(listing), sum(listing.values())
    remaining = {n: s for n, s in listing.items() if n != MANIFEST_NAME}
    for _ in range(DELETE_PASSES):
        if not remaining:
            break
        _delete_keys(client, location, sorted(remaining))
        remaining = list_sizes(client, location)
        removed += len(remaining)
        removed_bytes += sum(remaining.values())
    if remaining:
        raise DataplaneError(
            reasons.INTERNAL_ERROR,
            f"objects keep appearing under {location.uri}; is a serializer still writing?",
        )
    message = f"deleted {removed} objects ({human_bytes(removed_bytes)}) under {location.uri}"
    logger().info("%s", message)
    return Outcome.model_validate(
        {
            "command": "delete",
            "ok": True,
            "reason": reasons.DELETED,
            "message": message,
            "uri": location.uri,
            "files": removed,
            "totalBytes": removed_bytes,
        }
    )


def _delete_keys(client: S3Client, location: S3Location, names: list[str]) -> None:
    for start in range(0, len(names), DELETE_BATCH):
        batch = names[start : start + DELETE_BATCH]
        try:
            response = client.delete_objects(
                Bucket=location.bucket,
                Delete={"Objects": [{"Key": location.key(n)} for n in batch], "Quiet": True},
            )
        except Exception as exc:
            raise classify_s3_error(exc, f"deleting objects under {location.uri}") from exc
        errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            codes = sorted({str(e.get("Code")) for e in errors})
            reason = reasons.ACCESS_DENIED if "AccessDenied" in codes else reasons.INTERNAL_ERROR
            raise DataplaneError(
                reason,
                f"could not delete {len(errors)} objects under {location.uri} ({', '.join(codes)})",
            )
