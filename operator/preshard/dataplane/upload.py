"""Parallel multipart upload of a shard set's files, checksummed once as they are sent.

One pool of network threads (`concurrency`) carries every part of every file; a few reader
threads read files part by part and hand each part to the pool, so every byte is read from
disk once. A byte budget bounds the parts in memory to about `(concurrency + readers) x part
size`. The network thread takes each part's CRC64/NVME and sends it as the part's checksum
header, which the server checks where it supports checksums; the parts' values combine into
the whole file's (`preshard.dataplane.checksums`), which the manifest records. Each part is
retried with backoff on its own, and a failed file aborts its multipart upload. The file's
checksum is only known once the last part was sent, after the object's metadata was fixed at
`CreateMultipartUpload`, so it is stored as an object tag (`preshard-crc64nvme`) after
completion; a re-run skips objects whose tag and size match.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

from preshard.contract import reasons
from preshard.contract.layout import S3Location
from preshard.dataplane.checksums import (
    CRC64NVME,
    combine,
    crc64nvme,
    digest_of_file,
    s3_header,
    to_hex,
)
from preshard.dataplane.errors import DataplaneError, classify_s3_error, s3_error_code
from preshard.dataplane.logs import Progress, human_bytes, logger
from preshard.dataplane.s3 import RetryPolicy, call_with_retries

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

T = TypeVar("T")

MIB: Final = 1 << 20
MIN_PART_SIZE: Final = 5 * MIB
MAX_PART_SIZE: Final = 5 * 1024 * MIB
MAX_PARTS: Final = 10_000
DEFAULT_PART_SIZE: Final = 32 * MIB
DEFAULT_CONCURRENCY: Final = 16
CHECKSUM_TAG: Final = "preshard-crc64nvme"

FileKind = Literal["shard", "config"]


@dataclass(frozen=True)
class LocalFile:
    """A file to store under the shard-set prefix as `name`."""

    name: str
    path: Path
    kind: FileKind

    @property
    def size(self) -> int:
        """The file's size on disk."""
        return self.path.stat().st_size


@dataclass(frozen=True)
class StoredFile:
    """A file as it now lies in S3."""

    name: str
    size: int
    crc64nvme: str
    kind: FileKind
    uploaded: bool


@dataclass(frozen=True)
class TransferSettings:
    """How the uploader uses the network."""

    concurrency: int = DEFAULT_CONCURRENCY
    part_size: int = DEFAULT_PART_SIZE
    retry: RetryPolicy = field(default_factory=RetryPolicy)


def part_size_for(file_size: int, part_size: int) -> int:
    """The part size for one file: the requested size, raised (to whole MiB) where the file
    would otherwise need more than S3's 10,000 parts."""
    needed = -(-file_size // MAX_PARTS)
    needed = -(-needed // MIB) * MIB
    return max(part_size, needed)


class _CancelledError(Exception):
    """Another file of the same transfer failed first."""


class Uploader:
    """Uploads a set of local files under one prefix (see the module docstring); one
    `upload` call per instance."""

    def __init__(self, client: S3Client, location: S3Location, settings: TransferSettings) -> None:
        self._client = client
        self._location = location
        self._settings = settings
        self._stop = threading.Event()
        self._tagging = True
        self._tag_lock = threading.Lock()
        self._readers = 1
        self._budget = threading.Semaphore(1)
        self._network: concurrent.futures.ThreadPoolExecutor | None = None
        self._progress: Progress | None = None

    def upload(self, files: Sequence[LocalFile], existing: Mapping[str, int]) -> list[StoredFile]:
        """Upload `files`; `existing` (name -> size, from one LIST) finds objects to skip."""
        if not files:
            return []
        self._stop = threading.Event()
        ordered = sorted(files, key=lambda f: f.size, reverse=True)
        self._readers = max(1, min(len(ordered), max(2, self._settings.concurrency // 4)))
        self._budget = threading.Semaphore(self._settings.concurrency + self._readers)
        total = sum(f.size for f in ordered)
        logger().info(
            "uploading %d files (%s) to %s: %d connections, %s parts",
            len(ordered),
            human_bytes(total),
            self._location.uri,
            self._settings.concurrency,
            human_bytes(self._settings.part_size),
        )
        results: dict[str, StoredFile] = {}
        with (
            Progress("upload", total, total_files=len(ordered)) as progress,
            concurrent.futures.ThreadPoolExecutor(
                self._settings.concurrency, thread_name_prefix="s3-part"
            ) as network,
            concurrent.futures.ThreadPoolExecutor(
                self._readers, thread_name_prefix="s3-file"
            ) as readers,
        ):
            self._network, self._progress = network, progress
            futures = {
                readers.submit(self._upload_file, f, existing.get(f.name)): f for f in ordered
            }
            try:
                first_error = self._wait(futures, results)
            except BaseException:
                self._stop.set()
                raise
        logger().info("%s", progress.line())
        if first_error is not None:
            raise first_error
        return [results[f.name] for f in files]

    def _wait(
        self,
        futures: Mapping[concurrent.futures.Future[StoredFile], LocalFile],
        results: dict[str, StoredFile],
    ) -> BaseException | None:
        first_error: BaseException | None = None
        for future in concurrent.futures.as_completed(futures):
            try:
                stored = future.result()
            except _CancelledError:
                continue
            except Exception as exc:  # noqa: BLE001 - re-raised once the other files stopped
                self._stop.set()
                first_error = first_error or exc
                continue
            results[stored.name] = stored
        return first_error

    def _upload_file(self, local: LocalFile, existing_size: int | None) -> StoredFile:
        if self._stop.is_set():
            raise _CancelledError
        size = local.size
        if existing_size == size and self._tagging:
            reused = self._reuse(local, size)
            if reused is not None:
                return reused
        part_size = part_size_for(size, self._settings.part_size)
        if size <= part_size:
            stored = self._put_whole(local, size)
        else:
            stored = self._put_multipart(local, size, part_size)
        self._tag(stored)
        assert self._progress is not None  # noqa: S101 - set by upload()
        self._progress.file_done()
        return stored

    def _reuse(self, local: LocalFile, size: int) -> StoredFile | None:
        stored_checksum = self._read_tag(local.name)
        if stored_checksum is None:
            return None
        checksum = digest_of_file(local.path, CRC64NVME)
        if checksum != stored_checksum:
            return None
        logger().info("%s is already stored with the same size and checksum; skipping", local.name)
        assert self._progress is not None  # noqa: S101 - set by upload()
        self._progress.add(size)
        self._progress.file_done()
        return StoredFile(local.name, size, checksum, local.kind, uploaded=False)

    def _put_whole(self, local: LocalFile, size: int) -> StoredFile:
        self._acquire_budget()
        try:
            data = local.path.read_bytes()
        except BaseException:
            self._budget.release()
            raise
        crc = crc64nvme(data)
        key = self._location.key(local.name)

        def put() -> None:
            try:
                self._request(
                    lambda: self._client.put_object(
                        Bucket=self._location.bucket,
                        Key=key,
                        Body=data,
                        ChecksumCRC64NVME=s3_header(crc),
                    ),
                    f"uploading {local.name}",
                )
            finally:
                self._budget.release()

        assert self._network is not None  # noqa: S101 - set by upload()
        assert self._progress is not None  # noqa: S101
        self._network.submit(put).result()
        self._progress.add(len(data))
        if len(data) != size:
            raise DataplaneError(
                reasons.SERIALIZATION_FAILED, f"{local.name} changed size while it was uploaded"
            )
        return StoredFile(local.name, size, to_hex(crc), local.kind, uploaded=True)

    def _put_multipart(self, local: LocalFile, size: int, part_size: int) -> StoredFile:
        key = self._location.key(local.name)
        created = self._request(
            lambda: self._client.create_multipart_upload(
                Bucket=self._location.bucket, Key=key, ChecksumAlgorithm="CRC64NVME"
            ),
            f"starting the upload of {local.name}",
        )
        upload_id = created["UploadId"]
        try:
            parts, checksum, read = self._send_parts(local, key, upload_id, part_size)
            if read != size:
                raise DataplaneError(
                    reasons.SERIALIZATION_FAILED, f"{local.name} changed size while it was uploaded"
                )
            self._request(
                lambda: self._client.complete_multipart_upload(
                    Bucket=self._location.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
                f"completing the upload of {local.name}",
                stoppable=False,
            )
        except BaseException:
            self._stop.set()
            self._abort(key, upload_id, local.name)
            raise
        return StoredFile(local.name, size, checksum, local.kind, uploaded=True)

    def _send_parts(
        self, local: LocalFile, key: str, upload_id: str, part_size: int
    ) -> tuple[list[CompletedPartTypeDef], str, int]:
        assert self._network is not None  # noqa: S101 - set by upload()
        futures: list[concurrent.futures.Future[tuple[CompletedPartTypeDef, int, int]]] = []
        read = 0
        with local.path.open("rb") as fh:
            number = 0
            while not self._stop.is_set():
                self._acquire_budget()
                try:
                    data = fh.read(part_size)
                except BaseException:
                    self._budget.release()
                    raise
                if not data:
                    self._budget.release()
                    break
                read += len(data)
                number += 1
                futures.append(
                    self._network.submit(self._send_part, key, upload_id, number, data, local.name)
                )
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        failure = next((f.exception() for f in futures if f in done and f.exception()), None)
        if failure is not None:
            for pending in futures:
                pending.cancel()
            concurrent.futures.wait(futures)
            raise failure
        if self._stop.is_set():
            raise _CancelledError
        sent = [f.result() for f in futures]
        return [part for part, _, _ in sent], combine((c, n) for _, c, n in sent), read

    def _send_part(
        self, key: str, upload_id: str, number: int, data: bytes, name: str
    ) -> tuple[CompletedPartTypeDef, int, int]:
        """Send one part with its CRC64/NVME; returns the completed part, that CRC and the
        part's length, from which the whole file's checksum is combined."""
        try:
            crc = crc64nvme(data)
            response = self._request(
                lambda: self._client.upload_part(
                    Bucket=self._location.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumCRC64NVME=s3_header(crc),
                ),
                f"uploading part {number} of {name}",
            )
            assert self._progress is not None  # noqa: S101 - set by upload()
            self._progress.add(len(data))
        except BaseException:
            # Stop the readers of every file at once rather than after this file's last part.
            self._stop.set()
            raise
        finally:
            self._budget.release()
        part: CompletedPartTypeDef = {"PartNumber": number, "ETag": response["ETag"]}
        # A server without checksum support neither checks nor echoes the header; completing
        # with a checksum it never recorded would be refused.
        if response.get("ChecksumCRC64NVME"):
            part["ChecksumCRC64NVME"] = response["ChecksumCRC64NVME"]
        return part, crc, len(data)

    def _request(self, call: Callable[[], T], what: str, *, stoppable: bool = True) -> T:
        """One request of the transfer, retried by its policy; `stoppable` ones give up early
        once another part of the transfer failed (completing an upload is not one)."""
        return call_with_retries(
            call, what=what, policy=self._settings.retry, stop=self._stop if stoppable else None
        )

    def _acquire_budget(self) -> None:
        while not self._budget.acquire(timeout=0.5):
            if self._stop.is_set():
                raise _CancelledError

    def _abort(self, key: str, upload_id: str, name: str) -> None:
        try:
            call_with_retries(
                lambda: self._client.abort_multipart_upload(
                    Bucket=self._location.bucket, Key=key, UploadId=upload_id
                ),
                what=f"aborting the upload of {name}",
                policy=RetryPolicy(attempts=2, base_delay_s=0.5),
            )
        except DataplaneError as exc:
            logger().warning(
                "could not abort the incomplete upload of %s (%s); the next run or "
                "`preshard delete` removes it",
                name,
                exc.reason,
            )

    def _tag(self, stored: StoredFile) -> None:
        if not self._tagging or self._stop.is_set():
            return
        try:
            call_with_retries(
                lambda: self._client.put_object_tagging(
                    Bucket=self._location.bucket,
                    Key=self._location.key(stored.name),
                    Tagging={"TagSet": [{"Key": CHECKSUM_TAG, "Value": stored.crc64nvme}]},
                ),
                what=f"tagging {stored.name}",
                policy=RetryPolicy(attempts=3, base_delay_s=0.5),
                stop=self._stop,
            )
        except DataplaneError as exc:
            self._tag_failed(exc.reason, f"tag {stored.name}")

    def _read_tag(self, name: str) -> str | None:
        try:
            response: Any = call_with_retries(
                lambda: self._client.get_object_tagging(
                    Bucket=self._location.bucket, Key=self._location.key(name)
                ),
                what=f"reading the tags of {name}",
                policy=RetryPolicy(attempts=3, base_delay_s=0.5),
                stop=self._stop,
            )
        except DataplaneError as exc:
            self._tag_failed(exc.reason, f"read the tags of {name}")
            return None
        for tag in response.get("TagSet", []):
            if tag.get("Key") == CHECKSUM_TAG:
                return str(tag.get("Value"))
        return None

    def _tag_failed(self, reason: str, what: str) -> None:
        if reason == reasons.UNREACHABLE:
            # A passing fault: only this file loses its tag (a re-run uploads it again).
            logger().warning("could not %s (%s)", what, reason)
            return
        # Denied or not implemented: the same for every file, so say it once and stop asking.
        with self._tag_lock:
            if self._tagging:
                self._tagging = False
                logger().warning(
                    "object tags are not available (%s): uploads go on, but a re-run cannot "
                    "skip files already stored",
                    reason,
                )


def abort_incomplete_uploads(client: S3Client, location: S3Location) -> int:
    """Abort every unfinished multipart upload under `prefix/`; returns how many.

    Best effort where listing uploads is not allowed: an unfinished upload holds storage but
    is never visible as an object.
    """
    base = f"{location.prefix}/"
    aborted = 0
    try:
        paginator = client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=location.bucket, Prefix=base):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=location.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                aborted += 1
    except Exception as exc:
        error = classify_s3_error(exc, f"listing unfinished uploads under {location.uri}")
        code, _ = s3_error_code(exc)
        if error.reason == reasons.ACCESS_DENIED or code in ("NotImplemented", "NoSuchUpload"):
            logger().warning("could not clean unfinished uploads under %s (%s)", location.uri, code)
            return aborted
        raise error from exc
    if aborted:
        logger().info("aborted %d unfinished uploads under %s", aborted, location.uri)
    return aborted
