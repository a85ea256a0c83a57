"""What vLLM's weight loaders give each tensor-parallel rank, and rank files laid out as
vLLM's `serialize_vllm_model` writes them, for tests and benchmarks without vLLM.

The cuts are written from vLLM's own loaders (`model_executor/layers/linear.py`:
`QKVParallelLinear.weight_loader`, `MergedColumnParallelLinear.weight_loader`,
`RowParallelLinear.weight_loader`; `vocab_parallel_embedding.py`:
`VocabParallelEmbedding.weight_loader` and `_get_indices`), not from preshard's copy plans, so
a test that compares the two compares independent statements of the same rule. The engine
tier compares preshard's output with vLLM's own files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

VOCAB_PADDING: Final = 64
MARKER: Final = ".vllm_tensorized_marker"
PARAM: Final = 0
BUFFER: Final = 1


def _split(size: int, tp: int, what: str) -> int:
    """`size / tp`, which must divide."""
    if size % tp:
        raise ValueError(f"{size} ({what}) does not split {tp} ways")
    return size // tp


def qkv_rank(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rank: int,
    tp: int,
) -> torch.Tensor:
    """Rank `rank`'s fused `qkv_proj` (weight or bias): vLLM's per-shard loader for q, k, v."""
    num_heads = _split(heads, tp, "heads")
    if tp >= kv_heads:
        num_kv_heads, replicas = 1, _split(tp, kv_heads, "the TP size, by KV heads")
    else:
        num_kv_heads, replicas = _split(kv_heads, tp, "KV heads"), 1
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    shard_rank = rank // replicas
    return torch.cat(
        [
            q.narrow(0, rank * q_size, q_size),
            k.narrow(0, shard_rank * kv_size, kv_size),
            v.narrow(0, shard_rank * kv_size, kv_size),
        ]
    )


def merged_rank(parts: Sequence[torch.Tensor], *, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s `gate_up_proj`: each part's rows `rank * n / tp` onwards, in order."""
    pieces = []
    for part in parts:
        size = _split(part.shape[0], tp, "a merged part's rows")
        pieces.append(part.narrow(0, rank * size, size))
    return torch.cat(pieces)


def row_rank(weight: torch.Tensor, *, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s row-parallel weight (`o_proj`, `down_proj`): its input columns."""
    size = _split(weight.shape[1], tp, "a row-parallel weight's columns")
    return weight.narrow(1, rank * size, size).contiguous()


def vocab_rank(weight: torch.Tensor, *, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s `embed_tokens` or `lm_head`: its slice of the vocabulary padded to 64,
    rows past the real vocabulary zero."""
    vocab = weight.shape[0]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = _split(padded, tp, "the padded vocabulary")
    start, end = min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)
    shard = torch.zeros((per_rank, *weight.shape[1:]), dtype=weight.dtype)
    shard[: end - start] = weight[start:end]
    return shard


@dataclass(frozen=True)
class Entry:
    """One tensor of a rank file: module index, tensor type (0 parameter, 1 buffer), name."""

    module_index: int
    tensor_type: int
    name: str
    tensor: torch.Tensor


def rank_entries(
    checkpoint: Mapping[str, torch.Tensor], config: Mapping[str, object], *, rank: int, tp: int
) -> list[Entry]:
    """Rank `rank`'s tensors in the order and with the kinds vLLM's Llama writes them
    (marker, embedding, per layer attention then MLP then norms, the rotary cache once under
    layer 0, the attention's scale buffers, final norm, `lm_head` unless tied)."""
    heads, kv_heads = (
        int(str(config["num_attention_heads"])),
        int(str(config["num_key_value_heads"])),
    )
    hidden = int(str(config["hidden_size"]))
    head_dim = hidden // heads
    layers = int(str(config["num_hidden_layers"]))
    entries = [
        Entry(0, PARAM, MARKER, torch.empty((1,), dtype=torch.int64, device="meta")),
        Entry(
            2,
            PARAM,
            "model.embed_tokens.weight",
            vocab_rank(checkpoint["model.embed_tokens.weight"], rank=rank, tp=tp),
        ),
    ]
    cache = torch.arange(512 * head_dim, dtype=torch.float32).reshape(512, head_dim) / 7
    module = 3
    for layer in range(layers):
        p = f"model.layers.{layer}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        qkv = qkv_rank(
            checkpoint[f"{attn}.q_proj.weight"],
            checkpoint[f"{attn}.k_proj.weight"],
            checkpoint[f"{attn}.v_proj.weight"],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rank=rank,
            tp=tp,
        )
        entries += [
            Entry(module + 2, PARAM, f"{attn}.qkv_proj.weight", qkv),
            Entry(
                module + 3,
                PARAM,
                f"{attn}.o_proj.weight",
                row_rank(checkpoint[f"{attn}.o_proj.weight"], rank=rank, tp=tp),
            ),
        ]
        if layer == 0:
            entries.append(Entry(module + 4, BUFFER, f"{attn}.rotary_emb.cos_sin_cache", cache))
        entries += [
            Entry(module + 5, BUFFER, f"{attn}.attn._{scale}_scale", torch.tensor(1.0))
            for scale in ("k", "v", "q", "prob")
        ]
        entries += [
            Entry(
                module + 7,
                PARAM,
                f"{mlp}.gate_up_proj.weight",
                merged_rank(
                    [checkpoint[f"{mlp}.gate_proj.weight"], checkpoint[f"{mlp}.up_proj.weight"]],
                    rank=rank,
                    tp=tp,
                ),
            ),
            Entry(
                module + 8,
                PARAM,
                f"{mlp}.down_proj.weight",
                row_rank(checkpoint[f"{mlp}.down_proj.weight"], rank=rank, tp=tp),
            ),
            Entry(module + 10, PARAM, f"{p}.input_layernorm.weight", _norm(checkpoint, p, "input")),
            Entry(
                module + 11,
                PARAM,
                f"{p}.post_attention_layernorm.weight",
                _norm(checkpoint, p, "post_attention"),
            ),
        ]
        module += 12
    entries.append(Entry(module, PARAM, "model.norm.weight", checkpoint["model.norm.weight"]))
    if "lm_head.weight" in checkpoint:
        entries.append(
            Entry(
                module + 2,
                PARAM,
                "lm_head.weight",
                vocab_rank(checkpoint["lm_head.weight"], rank=rank, tp=tp),
            )
        )
    return entries


def _norm(checkpoint: Mapping[str, torch.Tensor], prefix: str, which: str) -> torch.Tensor:
    return checkpoint[f"{prefix}.{which}_layernorm.weight"]


def write_rank_file(path: Path, entries: Sequence[Entry], *, key: bytes | None = None) -> Path:
    """Write one rank file with tensorizer, tensor by tensor in order."""
    from tensorizer import EncryptionParams, TensorSerializer  # noqa: PLC0415
    from tensorizer.serialization import TensorType  # noqa: PLC0415

    path.parent.mkdir(parents=True, exist_ok=True)
    serializer = TensorSerializer(
        str(path), encryption=EncryptionParams(key=key) if key is not None else None
    )
    for entry in entries:
        serializer.write_tensor(
            entry.module_index, entry.name, TensorType(entry.tensor_type), entry.tensor
        )
    serializer.close()
    return path


def write_vllm_set(
    checkpoint: Mapping[str, torch.Tensor],
    config: Mapping[str, object],
    directory: Path,
    *,
    tp: int,
    key: bytes | None = None,
) -> list[Path]:
    """`model-rank-%03d.tensors` for every rank of `tp`, laid out as vLLM's."""
    return [
        write_rank_file(
            directory / f"model-rank-{rank:03d}.tensors",
            rank_entries(checkpoint, config, rank=rank, tp=tp),
            key=key,
        )
        for rank in range(tp)
    ]
