"""`preshard serialize`: model in, a complete shard set out, with its manifest written last.

The steps, each failing early with its own reason:

1. the destination: a set that already verifies for this key and TP ends the command at once;
   a manifest that does not is removed first, so a set being rewritten never looks complete;
2. the source's file list, then the scratch room for the download plus the shards;
3. the download into `<scratch>/model/` (files already there with the right size are kept);
4. the engine writes `<scratch>/shards/model-rank-%03d.tensors` (skipped when a marker shows
   that an earlier attempt in the same pod finished the same request);
5. the upload of the rank files and the non-weight files, then the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from preshard.contract import reasons
from preshard.contract.layout import MANIFEST_NAME, S3Location, rank_file_names
from preshard.contract.outcome import Outcome
from preshard.dataplane.engine import (
    Engine,
    EngineArgValue,
    EngineRequest,
    EngineVersions,
    load_engine,
)
from preshard.dataplane.errors import DataplaneError, classify_s3_error
from preshard.dataplane.logs import heartbeat, human_bytes, logger
from preshard.dataplane.manifest import Manifest, ManifestFile
from preshard.dataplane.s3 import list_sizes, require_prefix
from preshard.dataplane.scratch import ScratchEstimate, check_room, directory_bytes
from preshard.dataplane.shardset import CheckedSet, check_shard_set, set_outcome
from preshard.dataplane.source import SourcePlan, open_source
from preshard.dataplane.upload import (
    LocalFile,
    StoredFile,
    TransferSettings,
    Uploader,
    abort_incomplete_uploads,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# tensorizer's XSalsa20 key length: the key file holds exactly these raw bytes.
ENCRYPTION_KEY_BYTES: Final = 32
ENGINE_MARKER: Final = ".preshard-engine.json"
_ERROR_DETAIL_LIMIT: Final = 400


@dataclass(frozen=True)
class SerializeOptions:
    """Everything `preshard serialize` was asked to do."""

    model: str
    revision: str | None
    tensor_parallel_size: int
    dtype: str
    max_model_len: int | None
    destination: S3Location
    artifact_key: str
    scratch_dir: Path
    engine_args: Mapping[str, EngineArgValue] = field(default_factory=dict)
    encryption_keyfile: Path | None = None
    transfer: TransferSettings = field(default_factory=TransferSettings)
    scratch_size_limit: int | None = None


@dataclass(frozen=True)
class S3Clients:
    """`control` retries inside botocore; `transfer` leaves retries to the transfer code."""

    control: S3Client
    transfer: S3Client


def serialize(
    options: SerializeOptions,
    clients: S3Clients,
    *,
    engine_factory: Callable[[], Engine] = load_engine,
) -> Outcome:
    """Make the shard set of `options` (see the module docstring for the steps)."""
    started = time.monotonic()
    key = read_encryption_key(options.encryption_keyfile)
    destination = options.destination
    require_prefix(destination, "serialize --dest")
    done = _already_complete(clients.control, options)
    if done is not None:
        return done

    source = open_source(
        options.model,
        options.revision,
        client=lambda: clients.transfer,
        concurrency=options.transfer.concurrency,
    )
    plan = source.plan()
    scratch = options.scratch_dir
    model_dir, shards_dir = scratch / "model", scratch / "shards"
    scratch.mkdir(parents=True, exist_ok=True)
    estimate = ScratchEstimate(
        source_bytes=plan.download_bytes,
        shard_bytes=plan.weight_bytes,
        reusable_bytes=directory_bytes(model_dir) + directory_bytes(shards_dir),
    )
    check_room(scratch, estimate, options.scratch_size_limit)
    logger().info(
        "model %s: %d weight files (%s), %d config files",
        plan.description,
        len(plan.weights),
        human_bytes(plan.weight_bytes),
        len(plan.configs),
    )

    model_dir.mkdir(exist_ok=True)
    source.fetch(plan, model_dir)

    engine = engine_factory()
    versions = engine.versions()
    request = EngineRequest(
        model=str(model_dir),
        revision=None,
        tensor_parallel_size=options.tensor_parallel_size,
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        output_dir=shards_dir,
        extra_engine_args=dict(options.engine_args),
        encryption_keyfile=options.encryption_keyfile,
    )
    fingerprint = _fingerprint(options, plan, versions, key)
    _run_engine(engine, request, fingerprint)

    files = _files_to_store(options.tensor_parallel_size, shards_dir, model_dir, plan)
    stored = store_files(clients, destination, files, options.transfer)
    manifest = Manifest.model_validate(
        {
            "artifactKey": options.artifact_key,
            "model": options.model,
            "revision": plan.revision,
            "tensorParallelSize": options.tensor_parallel_size,
            "dtype": options.dtype,
            "vllmVersion": versions.vllm,
            "tensorizerVersion": versions.tensorizer,
            "encrypted": key is not None,
            "created": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "files": [
                ManifestFile(name=s.name, size=s.size, crc64nvme=s.crc64nvme, kind=s.kind)
                for s in stored
            ],
        }
    )
    write_manifest(clients.control, destination, manifest)
    seconds = time.monotonic() - started
    uploaded = sum(s.size for s in stored if s.uploaded)
    message = (
        f"stored {len(stored)} files ({human_bytes(manifest.total_bytes)}, "
        f"{human_bytes(uploaded)} uploaded) and the manifest at {destination.uri}"
    )
    logger().info("%s in %.1fs", message, seconds)
    return _outcome(options, manifest, message)


def _outcome(options: SerializeOptions, manifest: Manifest, message: str) -> Outcome:
    return set_outcome("serialize", reasons.SERIALIZED, message, options.destination.uri, manifest)


def read_encryption_key(path: Path | None) -> bytes | None:
    """The raw tensorizer key in `path` (None without one); refused unless it is 32 bytes."""
    if path is None:
        return None
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise DataplaneError(
            reasons.ENCRYPTION_KEY_INVALID,
            f"cannot read the encryption key file {path} ({exc.strerror or type(exc).__name__})",
        ) from exc
    if len(key) != ENCRYPTION_KEY_BYTES:
        raise DataplaneError(
            reasons.ENCRYPTION_KEY_INVALID,
            f"the encryption key file {path} holds {len(key)} bytes; tensorizer needs exactly "
            f"{ENCRYPTION_KEY_BYTES} raw bytes",
        )
    return key


def _already_complete(client: S3Client, options: SerializeOptions) -> Outcome | None:
    found = already_complete(client, options)
    return None if found is None else _outcome(options, *found)


class WritesSet(Protocol):
    """The options of a command that writes a set: where, for which TP size, under which key."""

    @property
    def destination(self) -> S3Location: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def artifact_key(self) -> str: ...


def already_complete(client: S3Client, options: WritesSet) -> tuple[Manifest, str] | None:
    """The manifest of the complete set already where `options` write theirs, and the message
    that says so (logged); None when there is none."""
    checked = _complete_destination(
        client,
        options.destination,
        tensor_parallel_size=options.tensor_parallel_size,
        artifact_key=options.artifact_key,
    )
    if checked is None:
        return None
    message = f"{options.destination.uri} was already complete; nothing to do"
    logger().info("%s", message)
    return checked.manifest, message


def _complete_destination(
    client: S3Client, destination: S3Location, *, tensor_parallel_size: int, artifact_key: str
) -> CheckedSet | None:
    """The complete set already at `destination` for this TP and key, or None.

    An incomplete one (a manifest that does not match what is there) loses its manifest first,
    so a set being rewritten never looks complete.
    """
    try:
        return check_shard_set(
            client,
            destination,
            tensor_parallel_size=tensor_parallel_size,
            artifact_key=artifact_key,
        )
    except DataplaneError as exc:
        if exc.reason == reasons.MANIFEST_MISSING:
            return None
        if exc.reason not in (
            reasons.MANIFEST_INVALID,
            reasons.TP_MISMATCH,
            reasons.SHARD_MISSING,
            reasons.SIZE_MISMATCH,
        ):
            raise
        logger().warning("%s is incomplete (%s); making it again", destination.uri, exc)
        _remove_manifest(client, destination)
        return None


def _remove_manifest(client: S3Client, destination: S3Location) -> None:
    try:
        client.delete_object(Bucket=destination.bucket, Key=destination.key(MANIFEST_NAME))
    except Exception as exc:
        raise classify_s3_error(exc, f"removing the stale manifest of {destination.uri}") from exc


def _fingerprint(
    options: SerializeOptions, plan: SourcePlan, versions: EngineVersions, key: bytes | None
) -> str:
    identity = {
        "model": options.model,
        "revision": plan.revision,
        "source": sorted(plan.downloads.items()),
        "tensorParallelSize": options.tensor_parallel_size,
        "dtype": options.dtype,
        "maxModelLen": options.max_model_len,
        "engineArgs": dict(options.engine_args),
        "versions": [versions.vllm, versions.tensorizer],
        # A digest of a digest: tells keys apart without storing anything derived directly.
        "key": hashlib.sha256(hashlib.sha256(key).digest()).hexdigest() if key else None,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _run_engine(engine: Engine, request: EngineRequest, fingerprint: str) -> None:
    shards_dir = request.output_dir
    expected = rank_file_names(request.tensor_parallel_size)
    marker = shards_dir / ENGINE_MARKER
    if _marker_matches(marker, fingerprint, shards_dir, expected):
        logger().info("the rank files in %s are from an earlier attempt; reusing them", shards_dir)
        return
    if shards_dir.exists():
        shutil.rmtree(shards_dir)
    shards_dir.mkdir(parents=True)
    logger().info(
        "serializing with tensor-parallel size %d into %s",
        request.tensor_parallel_size,
        shards_dir,
    )
    started = time.monotonic()
    try:
        with heartbeat(lambda: f"engine: {human_bytes(directory_bytes(shards_dir))} written"):
            engine.serialize(request)
    except DataplaneError:
        raise
    except Exception as exc:
        logger().exception("the engine failed")
        detail = f"{type(exc).__name__}: {exc}"[:_ERROR_DETAIL_LIMIT]
        raise DataplaneError(reasons.SERIALIZATION_FAILED, f"the engine failed: {detail}") from exc
    present = sorted(p.name for p in shards_dir.glob("model-rank-*.tensors"))
    empty = [
        n for n in expected if (shards_dir / n).is_file() and not (shards_dir / n).stat().st_size
    ]
    if present != expected or empty:
        raise DataplaneError(
            reasons.SERIALIZATION_FAILED,
            f"the engine wrote {', '.join(present) or 'no rank files'}"
            f"{' (empty: ' + ', '.join(empty) + ')' if empty else ''}; expected "
            f"{expected[0]} to {expected[-1]}",
        )
    sizes = {n: (shards_dir / n).stat().st_size for n in expected}
    marker.write_text(json.dumps({"fingerprint": fingerprint, "files": sizes}))
    logger().info(
        "the engine wrote %d rank files (%s) in %.1fs",
        len(expected),
        human_bytes(sum(sizes.values())),
        time.monotonic() - started,
    )


def _marker_matches(marker: Path, fingerprint: str, shards_dir: Path, expected: list[str]) -> bool:
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or recorded.get("fingerprint") != fingerprint:
        return False
    files = recorded.get("files")
    if not isinstance(files, dict) or sorted(files) != expected:
        return False
    with contextlib.suppress(OSError):
        return all((shards_dir / n).stat().st_size == files[n] for n in expected)
    return False


def _files_to_store(
    tensor_parallel_size: int, shards_dir: Path, model_dir: Path, plan: SourcePlan
) -> list[LocalFile]:
    ranks = rank_file_names(tensor_parallel_size)
    files = [LocalFile(name, shards_dir / name, "shard") for name in ranks]
    for name in sorted(plan.configs):
        if name == MANIFEST_NAME or name in ranks:
            logger().warning("not storing the model's own %s: the name is preshard's", name)
            continue
        files.append(LocalFile(name, model_dir / name, "config"))
    return files


def store_files(
    clients: S3Clients, destination: S3Location, files: list[LocalFile], settings: TransferSettings
) -> list[StoredFile]:
    """Upload a set's files (not its manifest) under `destination`, reusing what is stored."""
    client = clients.control
    existing = list_sizes(client, destination)
    existing.pop(MANIFEST_NAME, None)
    abort_incomplete_uploads(client, destination)
    stored = Uploader(clients.transfer, destination, settings).upload(files, existing)
    leftovers = sorted(set(existing) - {f.name for f in files})
    if leftovers:
        logger().info("removing %d objects an earlier attempt left behind", len(leftovers))
        for name in leftovers:
            try:
                client.delete_object(Bucket=destination.bucket, Key=destination.key(name))
            except Exception as exc:
                raise classify_s3_error(exc, f"removing {name} from {destination.uri}") from exc
    return stored


def write_manifest(client: S3Client, destination: S3Location, manifest: Manifest) -> None:
    """Write the manifest, the set's commit marker: only after every other file is stored."""
    try:
        client.put_object(
            Bucket=destination.bucket,
            Key=destination.key(MANIFEST_NAME),
            Body=manifest.to_json().encode(),
            ContentType="application/json",
        )
    except Exception as exc:
        raise classify_s3_error(exc, f"writing the manifest of {destination.uri}") from exc
    logger().info("wrote %s%s", destination.uri, MANIFEST_NAME)
