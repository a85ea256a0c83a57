"""Downloads from S3: parallel ranged GETs for model sources, hashed streams for checks.

A large file is fetched as byte ranges by a pool of threads, each writing its range in place
into a preallocated `.partial` file that is renamed once complete, so a file with its final
name always has all its bytes (a re-run skips it when the size matches). Each thread takes its
range's CRC64/NVME as the bytes arrive; the ranges' values combine into the file's, so a
caller can check a download against a manifest without reading the file back.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from preshard.contract import reasons
from preshard.contract.layout import S3Location
from preshard.dataplane.checksums import Algorithm, combine, crc64nvme, new_hasher
from preshard.dataplane.errors import DataplaneError
from preshard.dataplane.logs import Progress, human_bytes, logger
from preshard.dataplane.s3 import RetryPolicy, call_with_retries

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MIB: Final = 1 << 20
DEFAULT_RANGE_SIZE: Final = 32 * MIB
STREAM_CHUNK: Final = 8 * MIB
PARTIAL_SUFFIX: Final = ".partial"


def local_path(directory: Path, name: str) -> Path:
    """Where object `name` goes under `directory`; refuses names that would leave it."""
    target = (directory / name).resolve()
    root = directory.resolve()
    if target == root or root not in target.parents:
        raise DataplaneError(
            reasons.MANIFEST_INVALID, f"the file name {name!r} points outside {directory}"
        )
    return target


def download_files(
    client: S3Client,
    location: S3Location,
    files: Mapping[str, int],
    directory: Path,
    *,
    concurrency: int,
    range_size: int = DEFAULT_RANGE_SIZE,
    retry: RetryPolicy | None = None,
) -> dict[str, str]:
    """Fetch `files` (name -> size) from under `location` into `directory`, in parallel;
    returns the CRC64/NVME of each file it fetched (not of those already there)."""
    policy = retry or RetryPolicy()
    wanted = {}
    for name, size in files.items():
        target = local_path(directory, name)
        if target.is_file() and target.stat().st_size == size:
            continue
        wanted[name] = (target, size)
    if len(wanted) < len(files):
        logger().info("%d source files are already in %s", len(files) - len(wanted), directory)
    if not wanted:
        return {}
    total = sum(size for _, size in wanted.values())
    logger().info(
        "downloading %d files (%s) from %s", len(wanted), human_bytes(total), location.uri
    )
    stop = threading.Event()
    with (
        Progress("download", total, total_files=len(wanted)) as progress,
        concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="s3-get") as pool,
    ):
        jobs: list[tuple[str, Path, Path, list[concurrent.futures.Future[tuple[int, int]]]]] = []
        checksums: dict[str, str] = {}
        try:
            for name, (target, size) in wanted.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(target.name + PARTIAL_SUFFIX)
                with partial.open("wb") as fh:
                    fh.truncate(size)
                ranges = [
                    (start, min(size, start + range_size)) for start in range(0, size, range_size)
                ]
                futures = [
                    pool.submit(
                        _fetch_range,
                        client,
                        location,
                        name,
                        partial,
                        start,
                        end,
                        policy,
                        stop,
                        progress,
                    )
                    for start, end in ranges
                ]
                jobs.append((name, target, partial, futures))
            for name, target, partial, futures in jobs:
                checksums[name] = combine(future.result() for future in futures)
                if partial.stat().st_size != wanted[name][1]:
                    raise DataplaneError(
                        reasons.SERIALIZATION_FAILED, f"{name} changed size while downloading"
                    )
                partial.replace(target)
                progress.file_done()
        except BaseException:
            stop.set()
            raise
    logger().info("%s", progress.line())
    return checksums


def _fetch_range(
    client: S3Client,
    location: S3Location,
    name: str,
    partial: Path,
    start: int,
    end: int,
    policy: RetryPolicy,
    stop: threading.Event,
    progress: Progress,
) -> tuple[int, int]:
    """Fetch one range into place; its CRC64/NVME and length."""
    if end <= start:
        return 0, 0
    key = location.key(name)

    def get() -> bytes:
        response = client.get_object(
            Bucket=location.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
        )
        return response["Body"].read()

    try:
        data = call_with_retries(get, what=f"downloading {name}", policy=policy, stop=stop)
    except BaseException:
        stop.set()
        raise
    if len(data) != end - start:
        stop.set()
        raise DataplaneError(
            reasons.UNREACHABLE,
            f"short read of {name}: got {len(data)} of {end - start} bytes at offset {start}",
        )
    fd = os.open(partial, os.O_WRONLY)
    try:
        os.pwrite(fd, data, start)
    finally:
        os.close(fd)
    progress.add(len(data))
    return crc64nvme(data), len(data)


def stream_digest(
    client: S3Client,
    location: S3Location,
    name: str,
    algorithm: Algorithm,
    *,
    target: Path | None = None,
    policy: RetryPolicy | None = None,
) -> tuple[str, int]:
    """The digest and size of an object, read as one stream; also written to `target` if given.

    The whole read is retried on a transient fault, so a half-read never counts.
    """
    key = location.key(name)

    def read() -> tuple[str, int]:
        digest = new_hasher(algorithm)
        size = 0
        response = client.get_object(Bucket=location.bucket, Key=key)
        body = response["Body"]
        sink = target.open("wb") if target is not None else None
        try:
            for chunk in body.iter_chunks(STREAM_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink.write(chunk)
        finally:
            body.close()
            if sink is not None:
                sink.close()
        return digest.hexdigest(), size

    return call_with_retries(read, what=f"reading {name}", policy=policy or RetryPolicy())
