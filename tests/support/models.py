"""Tiny models in S3 for data-plane tests, and checks of the shards made from them.

`upload_model` puts a tiny model (`preshard_devenv.tinymodel.make_tiny_model`) under an S3
prefix as a model source; `assert_shards_match` loads rank files back with tensorizer's
`TensorDeserializer`, reassembles them the way tensor parallelism cut them and compares every
tensor exactly with the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from preshard.contract.layout import S3Location
from preshard.contract.outcome import Outcome
from preshard_devenv.cpuengine import split_dim
from preshard_devenv.tinymodel import TinyModel

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from preshard_devenv.s3server import S3Bucket


def upload_model(model: TinyModel, client: S3Client, bucket: str, prefix: str) -> str:
    """Put every file of the model directory under `s3://bucket/prefix/`; returns that URI."""
    prefix = prefix.strip("/")
    for path in sorted(p for p in model.path.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(model.path).as_posix()}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}/"


def download_prefix(client: S3Client, bucket: str, prefix: str, directory: Path) -> dict[str, Path]:
    """Fetch every object under `prefix/` into `directory`; returns name -> local path."""
    base = prefix.strip("/") + "/"
    found: dict[str, Path] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(base) :]
            target = directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(target))
            found[name] = target
    return found


def load_rank_files(
    paths: Sequence[Path], *, key: bytes | None = None
) -> list[dict[str, torch.Tensor]]:
    """Every tensor of each rank file, in rank order, decrypted with `key` when given."""
    from tensorizer import DecryptionParams, TensorDeserializer  # noqa: PLC0415

    ranks: list[dict[str, torch.Tensor]] = []
    for path in paths:
        decryption = DecryptionParams.from_key(key) if key is not None else None
        deserializer = TensorDeserializer(str(path), device="cpu", encryption=decryption)
        try:
            ranks.append({name: t.detach().clone() for name, t in deserializer.items()})
        finally:
            deserializer.close()
    return ranks


def reassemble(ranks: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Undo the tensor-parallel split: concatenate split weights, check replicated ones agree."""
    names = set(ranks[0])
    for rank, tensors in enumerate(ranks):
        if set(tensors) != names:
            raise AssertionError(f"rank {rank} holds different tensor names than rank 0")
    whole: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        parts = [tensors[name] for tensors in ranks]
        dim = split_dim(name)
        if dim is None:
            for rank, part in enumerate(parts[1:], start=1):
                if not torch.equal(part, parts[0]):
                    raise AssertionError(f"replicated {name} differs on rank {rank}")
            whole[name] = parts[0]
        else:
            whole[name] = torch.cat(parts, dim=dim)
    return whole


def assert_shards_match(
    model: TinyModel, rank_paths: Sequence[Path], *, dtype: str = "auto", key: bytes | None = None
) -> None:
    """Fail unless the rank files hold exactly the model's tensors, split and cast for `dtype`."""
    expected = model.tensors(dtype)
    actual = reassemble(load_rank_files(rank_paths, key=key))
    if set(actual) != set(expected):
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        raise AssertionError(f"tensor names differ: missing {missing[:5]}, extra {extra[:5]}")
    for name, tensor in expected.items():
        got = actual[name]
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(got, tensor):
            raise AssertionError(
                f"{name}: got {got.dtype} {tuple(got.shape)}, expected {tensor.dtype} "
                f"{tuple(tensor.shape)} (or the values differ)"
            )


@dataclass(frozen=True)
class StoredSet:
    """A shard set in S3, as its manifest describes it, and its rank files fetched here."""

    location: S3Location
    outcome: Outcome
    manifest: dict[str, object]
    rank_files: list[Path]

    def checksums(self) -> dict[str, str]:
        """Each rank file's CRC64/NVME as the manifest records it."""
        files = self.manifest["files"]
        assert isinstance(files, list)
        return {f["name"]: f["crc64nvme"] for f in files if f["kind"] == "shard"}


def fetch_set(
    bucket: S3Bucket, location: S3Location, outcome: Outcome, directory: Path
) -> StoredSet:
    """The manifest and rank files of a stored set."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(
        bucket.client.get_object(Bucket=bucket.name, Key=location.key("manifest.json"))[
            "Body"
        ].read()
    )
    paths = []
    for rank in range(int(manifest["tensorParallelSize"])):
        name = f"model-rank-{rank:03d}.tensors"
        bucket.client.download_file(bucket.name, location.key(name), str(directory / name))
        paths.append(directory / name)
    return StoredSet(location, outcome, manifest, paths)
