"""Rank files of TP N in, rank files of TP M out, one tensor at a time.

For each tensor, in the order of the source files (vLLM's module order, the same at every TP
size), the N source pieces are read, checked against the layout (`preshard.dataplane.tp_layout`:
names, shapes, dtypes; replicated tensors and replicated KV heads must be equal byte for
byte), and the M target pieces are cut from them and written, with the module index and
tensor type the source recorded. Only one tensor's pieces are in memory at a time: about
the largest tensor's size plus one target piece, whatever the model's size.

Each source tensor is read through its own `TensorDeserializer` restricted to that tensor:
a deserializer keeps every tensor it has read, so one per file would end up holding the
whole file.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from preshard.dataplane.logs import human_bytes, logger
from preshard.dataplane.tp_layout import (
    FLOAT_DTYPES,
    ModelShape,
    TensorRule,
    UnsupportedLayoutError,
    copy_plan,
    replica_checks,
)

if TYPE_CHECKING:
    import torch

_NAMED: Final = 5


@dataclass(frozen=True)
class ReshardResult:
    """What one reshard wrote."""

    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float


@dataclass(frozen=True)
class _Piece:
    module_index: int
    tensor_type: int
    tensor: torch.Tensor


def tensor_names(path: Path, *, key: bytes | None = None) -> list[str]:
    """The tensor names of a rank file, in file order (reads only its index)."""
    from tensorizer import TensorDeserializer  # noqa: PLC0415 - heavy, data plane only

    with TensorDeserializer(
        str(path), device="cpu", lazy_load=True, num_readers=1, encryption=_decryption(key)
    ) as deserializer:
        return [str(name) for name in deserializer]


def reshard_rank_files(
    sources: Sequence[Path],
    targets: Sequence[Path],
    shape: ModelShape,
    *,
    key: bytes | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReshardResult:
    """Write `targets` (one per target rank) from `sources` (one per source rank).

    Raises `UnsupportedLayoutError` before anything is written when a tensor is not one the
    layout knows, and while writing when a tensor does not look the way vLLM writes it (the
    partial target files are removed).
    """
    started = time.monotonic()
    source_tp, target_tp = len(sources), len(targets)
    shape.check_tp(source_tp)
    shape.check_tp(target_tp)
    names = tensor_names(sources[0], key=key)
    for rank, path in enumerate(sources[1:], start=1):
        if tensor_names(path, key=key) != names:
            raise UnsupportedLayoutError(
                f"rank {rank} holds other tensors than rank 0 (or in another order); "
                "not a set vLLM wrote"
            )
    rules = {name: shape.rule(name) for name in names}
    unknown = [name for name, rule in rules.items() if rule is None]
    if unknown:
        raise UnsupportedLayoutError(
            f"{len(unknown)} tensors are not ones preshard knows how vLLM cuts "
            f"({_some(unknown)}): quantized, MoE or another architecture's weights"
        )
    bytes_read = bytes_written = 0
    with _writers(targets, key) as writers:
        for done, name in enumerate(names):
            rule = rules[name]
            assert rule is not None  # noqa: S101 - checked above
            pieces = [_read_tensor(path, name, key) for path in sources]
            bytes_read += sum(_nbytes(p.tensor) for p in pieces)
            first = pieces[0]
            for rank, piece in enumerate(pieces[1:], start=1):
                if (piece.module_index, piece.tensor_type) != (
                    first.module_index,
                    first.tensor_type,
                ) or piece.tensor.dtype != first.tensor.dtype:
                    raise UnsupportedLayoutError(
                        f"{name} on rank {rank} is recorded unlike on rank 0 (module, type or "
                        "dtype)"
                    )
            for rank, tensor in enumerate(_target_tensors(name, rule, pieces, target_tp)):
                writers[rank].write_tensor(
                    first.module_index, name, _tensor_type(first.tensor_type), tensor
                )
                bytes_written += _nbytes(tensor)
            del pieces, first
            if progress is not None:
                progress(done + 1, len(names))
    seconds = time.monotonic() - started
    logger().info(
        "resharded %d tensors from TP %d to TP %d (%s read, %s written) in %.1fs",
        len(names),
        source_tp,
        target_tp,
        human_bytes(bytes_read),
        human_bytes(bytes_written),
        seconds,
    )
    return ReshardResult(len(names), bytes_read, bytes_written, seconds)


def _target_tensors(
    name: str, rule: TensorRule, pieces: Sequence[_Piece], target_tp: int
) -> Iterable[torch.Tensor]:
    """The target pieces of one tensor, made one at a time as the caller writes them."""
    tensors = [p.tensor for p in pieces]
    if rule.kind == "marker":
        return _marker(name, tensors, target_tp)
    if rule.kind == "replicated":
        return _replicated(name, tensors, target_tp)
    return _cut(name, rule, tensors, target_tp)


def _marker(name: str, tensors: Sequence[torch.Tensor], target_tp: int) -> list[torch.Tensor]:
    """vLLM's marker is a meta tensor: written as one again, shape and dtype only."""
    import torch  # noqa: PLC0415

    if any(t.shape != tensors[0].shape for t in tensors):
        raise UnsupportedLayoutError(f"{name} differs between ranks")
    return [torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device="meta")] * target_tp


def _replicated(name: str, tensors: Sequence[torch.Tensor], target_tp: int) -> list[torch.Tensor]:
    for rank, tensor in enumerate(tensors[1:], start=1):
        if not same_bytes(tensor, tensors[0]):
            raise UnsupportedLayoutError(
                f"{name} should be the same on every rank but rank {rank} differs from rank 0"
            )
    return [tensors[0]] * target_tp


def _cut(
    name: str, rule: TensorRule, tensors: Sequence[torch.Tensor], target_tp: int
) -> Iterator[torch.Tensor]:
    import torch  # noqa: PLC0415

    split = rule.split
    assert split is not None  # noqa: S101 - a split rule has its split
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedLayoutError(
            f"{name} is {dtype}; only {', '.join(sorted(FLOAT_DTYPES))} weights are resharded"
        )
    expected = rule.rank_shape(len(tensors))
    for rank, tensor in enumerate(tensors):
        if tuple(tensor.shape) != expected:
            raise UnsupportedLayoutError(
                f"{name} on rank {rank} has the shape {tuple(tensor.shape)}; vLLM's layout at "
                f"TP {len(tensors)} is {expected}"
            )
    for a, b in replica_checks(split, len(tensors)):
        if not same_bytes(
            tensors[a.rank].narrow(split.dim, a.start, a.length),
            tensors[b.rank].narrow(split.dim, b.start, b.length),
        ):
            raise UnsupportedLayoutError(
                f"{name}: the replicated KV heads of ranks {a.rank} and {b.rank} differ"
            )
    for segments in copy_plan(split, len(tensors), target_tp):
        parts = [tensors[s.rank].narrow(split.dim, s.start, s.length) for s in segments]
        yield (parts[0] if len(parts) == 1 else torch.cat(parts, dim=split.dim)).contiguous()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (NaN payloads included)."""
    import torch  # noqa: PLC0415

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch  # noqa: PLC0415

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(tensor: torch.Tensor) -> int:
    return 0 if tensor.is_meta else tensor.numel() * tensor.element_size()


def _read_tensor(path: Path, name: str, key: bytes | None) -> _Piece:
    from tensorizer import TensorDeserializer  # noqa: PLC0415

    with TensorDeserializer(
        str(path),
        device="cpu",
        filter_func=lambda candidate: candidate == name,
        lazy_load=True,
        num_readers=1,
        encryption=_decryption(key),
    ) as deserializer:
        found = list(deserializer.read_tensors())
    if len(found) != 1:
        raise UnsupportedLayoutError(f"{path.name} holds {len(found)} tensors named {name}")
    module_index, tensor_type, _, tensor = found[0]
    return _Piece(int(module_index), int(tensor_type), tensor.detach())


@contextlib.contextmanager
def _writers(targets: Sequence[Path], key: bytes | None) -> Iterator[list[Any]]:
    from tensorizer import EncryptionParams, TensorSerializer  # noqa: PLC0415

    writers: list[Any] = []
    ok = False
    try:
        for path in targets:
            path.parent.mkdir(parents=True, exist_ok=True)
            encryption = EncryptionParams(key=key) if key is not None else None
            writers.append(TensorSerializer(str(path), encryption=encryption))
        yield writers
        ok = True
    finally:
        for writer in writers:
            with contextlib.suppress(Exception) if not ok else contextlib.nullcontext():
                writer.close()
        if not ok:
            for path in targets:
                path.unlink(missing_ok=True)


def _tensor_type(value: int) -> object:
    from tensorizer.serialization import TensorType  # noqa: PLC0415

    return TensorType(value)


def _decryption(key: bytes | None) -> object:
    if key is None:
        return None
    from tensorizer import DecryptionParams  # noqa: PLC0415

    return DecryptionParams.from_key(key)


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMED])
    return f"{shown} and {len(names) - _NAMED} more" if len(names) > _NAMED else shown
