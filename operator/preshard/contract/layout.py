"""Where a shard set's files live: one fact shared by the controller and the data plane.

A shard set is one prefix, `<storage prefix>/<artifact key>/`, holding
`model-rank-000.tensors` … one file per tensor-parallel rank, the model's non-weight files
(config, tokenizer, generation config) and `manifest.json`, written last as the commit marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

RANK_FILE_TEMPLATE: Final = "model-rank-%03d.tensors"
MANIFEST_NAME: Final = "manifest.json"
# The newest format of `manifest.json` this release writes and reads: 1 recorded each file's
# sha256, 2 its CRC64/NVME. The controller compares it with what the init container's image of a
# patched Deployment reads (an older image refuses a newer format).
MANIFEST_FORMAT: Final = 2

# An S3 bucket name (the DNS-compatible rules) and a key prefix made of safe path segments:
# no empty segments, none made only of dots (so no `.` or `..`), printable ASCII only. RE2 and
# Rust regexes have no look-ahead, so "not only dots" is "dots, then one other character".
# The CRD schema uses the same pattern.
S3_URI_PATTERN: Final = (
    r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
    r"(/\.*[A-Za-z0-9!_*'()+=@,:-][A-Za-z0-9!_.*'()+=@,:-]*)*/?$"
)
_S3_URI = re.compile(S3_URI_PATTERN)


class InvalidURIError(ValueError):
    """A string is not an `s3://bucket/prefix` URI preshard accepts."""


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix without leading or trailing slashes ("" for the bucket root)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        """Parse and validate `s3://bucket[/prefix][/]`."""
        if not _S3_URI.match(uri):
            raise InvalidURIError(
                f"{uri!r} is not a valid s3://bucket/prefix URI "
                "(lower-case bucket name; no empty, '.' or '..' path segments)"
            )
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return cls(bucket=bucket, prefix=prefix.strip("/"))

    def child(self, name: str) -> S3Location:
        """The location one path segment below this one."""
        return S3Location(self.bucket, f"{self.prefix}/{name}" if self.prefix else name)

    def key(self, name: str) -> str:
        """The object key of a file directly under this prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def uri(self) -> str:
        """The URI, with a trailing slash so it reads as a prefix."""
        return f"s3://{self.bucket}/{self.prefix}/" if self.prefix else f"s3://{self.bucket}/"


def rank_file_name(rank: int) -> str:
    """The file name of one tensor-parallel rank's shard."""
    return RANK_FILE_TEMPLATE % rank


def rank_file_names(tensor_parallel_size: int) -> list[str]:
    """The file names of every rank of a shard set, in rank order."""
    return [rank_file_name(rank) for rank in range(tensor_parallel_size)]


def shard_set_location(storage_uri: str, artifact_key: str) -> S3Location:
    """The prefix that holds the shard set with this artifact key."""
    return S3Location.parse(storage_uri).child(artifact_key)


def tensorizer_uri(shard_set: S3Location, tensor_parallel_size: int) -> str:
    """The `tensorizer_uri` a vLLM server at this TP size is given.

    vLLM's loader substitutes the rank into the `%03d` template only when TP > 1; a TP 1
    server opens the URI as written, so at TP 1 it names the one rank file itself.
    """
    name = RANK_FILE_TEMPLATE if tensor_parallel_size > 1 else rank_file_name(0)
    return f"s3://{shard_set.bucket}/{shard_set.key(name)}"
