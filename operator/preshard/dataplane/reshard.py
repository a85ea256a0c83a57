"""`preshard reshard`: a verified TP N shard set in, the TP M set vLLM would write out, no GPU.

The steps, each failing early with its own reason:

1. the destination: a set that already verifies for this key and TP M ends the command at
   once; a manifest that does not is removed first, so a set being rewritten never looks
   complete;
2. the source: its manifest and file sizes (`verify`), its encryption against the key given,
   and its `config.json` (checksum-checked), from which `preshard.dataplane.tp_layout` says
   whether it can reproduce vLLM's layout at TP M (`ReshardUnsupported` when not);
3. the scratch room, then the download of the rank files and config files into
   `<scratch>/source/`, each checked against its checksum in the manifest;
4. the reshard into `<scratch>/shards/`, one tensor at a time (`reshard_tensors`);
5. the upload of the new rank files and the source's config files, then the manifest, last,
   recording the set it was made from.
"""

from __future__ import annotations

import concurrent.futures
import json
import resource
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final

from preshard.contract import reasons
from preshard.contract.layout import S3Location, rank_file_names
from preshard.contract.outcome import Outcome
from preshard.dataplane.checksums import CRC64NVME
from preshard.dataplane.download import download_files, local_path
from preshard.dataplane.errors import DataplaneError
from preshard.dataplane.logs import heartbeat, human_bytes, logger
from preshard.dataplane.manifest import Manifest, ManifestFile, ReshardedFrom
from preshard.dataplane.s3 import get_small_object, require_prefix
from preshard.dataplane.scratch import ScratchEstimate, check_room, directory_bytes
from preshard.dataplane.serialize import (
    S3Clients,
    already_complete,
    read_encryption_key,
    store_files,
    write_manifest,
)
from preshard.dataplane.shardset import CheckedSet, check_shard_set, set_outcome
from preshard.dataplane.tp_layout import ModelShape, UnsupportedLayoutError, model_shape
from preshard.dataplane.upload import LocalFile, TransferSettings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

CONFIG_NAME: Final = "config.json"
_HASH_THREADS: Final = 4


@dataclass(frozen=True)
class ReshardOptions:
    """Everything `preshard reshard` was asked to do."""

    source: S3Location
    tensor_parallel_size: int
    destination: S3Location
    artifact_key: str
    scratch_dir: Path
    encryption_keyfile: Path | None = None
    transfer: TransferSettings = field(default_factory=TransferSettings)
    scratch_size_limit: int | None = None


def reshard(options: ReshardOptions, clients: S3Clients) -> Outcome:
    """Make the TP M set of `options` from its source set (see the module docstring)."""
    started = time.monotonic()
    key = read_encryption_key(options.encryption_keyfile)
    source, destination, tp = options.source, options.destination, options.tensor_parallel_size
    require_prefix(source, "reshard SRC_URI")
    require_prefix(destination, "reshard --dest")
    if source.bucket == destination.bucket and _nested(source.prefix, destination.prefix):
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS,
            f"--dest {destination.uri} and the source {source.uri} overlap; a resharded set "
            "needs a prefix of its own",
        )
    done = _already_complete(clients.control, options)
    if done is not None:
        return done

    checked = check_shard_set(clients.control, source, tensor_parallel_size=None)
    manifest = checked.manifest
    source_tp = manifest.tensor_parallel_size
    if source_tp == tp:
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS,
            f"{source.uri} is already made for TP {tp}; nothing to reshard",
        )
    _check_encryption(manifest, source, key)
    shape = _layout(clients.control, checked, source_tp, tp)
    logger().info(
        "resharding %s (%s, TP %d, %s) to TP %d at %s",
        source.uri,
        manifest.model,
        source_tp,
        manifest.dtype,
        tp,
        destination.uri,
    )

    scratch = options.scratch_dir
    source_dir, shards_dir = scratch / "source", scratch / "shards"
    scratch.mkdir(parents=True, exist_ok=True)
    shard_bytes = sum(f.size for f in manifest.shards)
    estimate = ScratchEstimate(
        source_bytes=manifest.total_bytes,
        shard_bytes=shard_bytes,
        reusable_bytes=directory_bytes(source_dir),
    )
    check_room(scratch, estimate, options.scratch_size_limit)
    _download(clients.transfer, checked, source_dir, options.transfer.concurrency)

    if shards_dir.exists():
        shutil.rmtree(shards_dir)
    targets = [shards_dir / name for name in rank_file_names(tp)]
    sources = [local_path(source_dir, f.name) for f in manifest.shards]
    baseline = _peak_rss()
    written = _reshard_files(sources, targets, shape, key)
    peak = _peak_rss()
    logger().info(
        "peak RSS %s (%s before the reshard) for %s of rank files",
        human_bytes(peak),
        human_bytes(baseline),
        human_bytes(shard_bytes),
    )

    files = [LocalFile(p.name, p, "shard") for p in targets] + [
        LocalFile(f.name, local_path(source_dir, f.name), "config") for f in manifest.config_files
    ]
    stored = store_files(clients, destination, files, options.transfer)
    made = Manifest.model_validate(
        {
            "artifactKey": options.artifact_key,
            "model": manifest.model,
            "revision": manifest.revision,
            "tensorParallelSize": tp,
            "dtype": manifest.dtype,
            "vllmVersion": manifest.vllm_version,
            "tensorizerVersion": written,
            "encrypted": manifest.encrypted,
            "created": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "files": [
                ManifestFile(name=s.name, size=s.size, crc64nvme=s.crc64nvme, kind=s.kind)
                for s in stored
            ],
            "reshardedFrom": ReshardedFrom(
                uri=source.uri, artifact_key=manifest.artifact_key, tensor_parallel_size=source_tp
            ),
        }
    )
    write_manifest(clients.control, destination, made)
    message = (
        f"resharded {source.uri} from TP {source_tp} to TP {tp}: stored {len(stored)} files "
        f"({human_bytes(made.total_bytes)}) and the manifest at {destination.uri}; "
        f"peak RSS {human_bytes(peak)}"
    )
    logger().info("%s in %.1fs", message, time.monotonic() - started)
    return _outcome(options, made, message)


def _outcome(options: ReshardOptions, manifest: Manifest, message: str) -> Outcome:
    return set_outcome("reshard", reasons.RESHARDED, message, options.destination.uri, manifest)


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _already_complete(client: S3Client, options: ReshardOptions) -> Outcome | None:
    found = already_complete(client, options)
    return None if found is None else _outcome(options, *found)


def _check_encryption(manifest: Manifest, source: S3Location, key: bytes | None) -> None:
    if manifest.encrypted and key is None:
        raise DataplaneError(
            reasons.ENCRYPTION_KEY_INVALID,
            f"{source.uri} is encrypted; reshard needs its key (--encryption-keyfile), and "
            "writes the new set encrypted with the same key",
        )
    if key is not None and not manifest.encrypted:
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS,
            f"{source.uri} is not encrypted; reshard keeps a set's encryption as it is, so "
            "--encryption-keyfile is only for an encrypted source",
        )


def _layout(client: S3Client, checked: CheckedSet, source_tp: int, tp: int) -> ModelShape:
    """The model's layout from the set's own config.json; refuses what cannot be resharded."""
    entry = next((f for f in checked.manifest.config_files if f.name == CONFIG_NAME), None)
    if entry is None:
        raise DataplaneError(
            reasons.RESHARD_UNSUPPORTED,
            f"{checked.location.uri} has no {CONFIG_NAME}; the layout cannot be known without it",
        )
    body = get_small_object(client, checked.location, CONFIG_NAME)
    if body is None or not entry.matches_bytes(body):
        raise DataplaneError(
            reasons.HASH_MISMATCH,
            f"{checked.location.uri}{CONFIG_NAME} does not match its manifest entry",
        )
    try:
        config = json.loads(body)
        if not isinstance(config, dict):
            raise UnsupportedLayoutError(f"{CONFIG_NAME} is not a JSON object")
        shape = model_shape(config)
        shape.check_tp(source_tp)
        shape.check_tp(tp)
    except ValueError as exc:
        raise DataplaneError(
            reasons.RESHARD_UNSUPPORTED, f"{CONFIG_NAME} is not valid JSON"
        ) from exc
    except UnsupportedLayoutError as exc:
        raise DataplaneError(
            reasons.RESHARD_UNSUPPORTED, f"cannot reshard to TP {tp}: {exc.message}"
        ) from exc
    return shape


def _download(client: S3Client, checked: CheckedSet, directory: Path, concurrency: int) -> None:
    """Fetch every file of the set into `directory` and check each against its checksum."""
    files = checked.manifest.files
    fetched = download_files(
        client,
        checked.location,
        {f.name: f.size for f in files},
        directory,
        concurrency=concurrency,
    )

    def check(entry: ManifestFile) -> str | None:
        algorithm, expected = entry.checksum
        if algorithm == CRC64NVME and entry.name in fetched:
            # Checksummed as it arrived: nothing to read back.
            matches = fetched[entry.name] == expected
        else:
            matches = entry.matches_file(local_path(directory, entry.name))
        if matches:
            return None
        local_path(directory, entry.name).unlink()
        return entry.name

    with concurrent.futures.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="hash") as pool:
        bad = [name for name in pool.map(check, files) if name is not None]
    if bad:
        raise DataplaneError(
            reasons.HASH_MISMATCH,
            f"{checked.location.uri} has files whose checksum differs from the manifest: "
            f"{', '.join(bad[:5])}",
        )
    logger().info("checked %d files against their checksums", len(files))


def _reshard_files(
    sources: list[Path], targets: list[Path], shape: ModelShape, key: bytes | None
) -> str:
    """Run the reshard; returns the tensorizer version that wrote the files."""
    try:
        import tensorizer  # noqa: PLC0415 - heavy: only the serializer image has it

        from preshard.dataplane.reshard_tensors import reshard_rank_files  # noqa: PLC0415
    except ImportError as exc:
        raise DataplaneError(
            reasons.INTERNAL_ERROR,
            f"reshard needs torch and tensorizer (the serializer image): {exc}",
        ) from exc
    progress = {"done": 0, "total": 0}

    def count(done: int, total: int) -> None:
        progress.update(done=done, total=total)

    try:
        with heartbeat(lambda: f"reshard: {progress['done']} of {progress['total']} tensors"):
            reshard_rank_files(sources, targets, shape, key=key, progress=count)
    except UnsupportedLayoutError as exc:
        raise DataplaneError(reasons.RESHARD_UNSUPPORTED, exc.message) from exc
    except tensorizer.CryptographyError as exc:
        raise DataplaneError(
            reasons.ENCRYPTION_KEY_INVALID,
            "the key in --encryption-keyfile does not decrypt the source's rank files",
        ) from exc
    return str(tensorizer.__version__)


def _peak_rss() -> int:
    """This process's peak resident set size so far, in bytes.

    `VmHWM` (Linux), the high-water mark of this program's own memory: `getrusage`'s maxrss
    would also count what the parent held when it forked this process.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
