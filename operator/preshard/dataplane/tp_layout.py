"""How vLLM cuts each tensor of a Llama-family model over tensor-parallel ranks.

`preshard reshard` turns the rank files of a TP N shard set into those vLLM itself would write
at TP M. That is exact only if every tensor's cut is known, so this module holds vLLM's rules
(vLLM 0.32 to 0.34, `model_executor/layers/linear.py` and `vocab_parallel_embedding.py`) for
the one model family whose per-rank state dict preshard has compared with vLLM's own files,
and refuses everything else. Pure: shapes and index ranges, no torch.

A cut tensor is split along one dimension into blocks that vLLM divides over the ranks on
their own, each rank holding its part of every block, in block order:

- `qkv_proj` (`QKVParallelLinear`, dim 0): query heads, key heads, value heads. Each rank
  holds `heads / tp` query heads and `kv_heads / tp` key and value heads; when `tp` exceeds
  the KV head count, each rank holds one KV head, rank `r` the head `r // (tp / kv_heads)`
  (KV heads are replicated).
- `gate_up_proj` (`MergedColumnParallelLinear`, dim 0): the gate rows, then the up rows.
- `o_proj`, `down_proj` (`RowParallelLinear`): split on the input dimension (dim 1); a bias
  is whole on every rank.
- `embed_tokens`, `lm_head` (`VocabParallelEmbedding`, `ParallelLMHead`, dim 0): the
  vocabulary padded to a multiple of 64 (`pad_vocab_size`), then divided by `tp`; padding
  rows are zero and sit at the end of the padded vocabulary, so the padded table is the same
  for every TP size.
- norms, the rotary `cos_sin_cache` (shared by every layer, written once under layer 0), the
  attention's scale buffers and vLLM's `.vllm_tensorized_marker` (a meta tensor that marks a
  file as vLLM's): the same on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

# vLLM's DEFAULT_VOCAB_PADDING_SIZE.
VOCAB_PADDING: Final = 64
MARKER_NAME: Final = ".vllm_tensorized_marker"
# The dtypes a cut tensor may have: anything else is quantized or not a weight.
FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})


class UnsupportedLayoutError(Exception):
    """preshard cannot prove it reproduces vLLM's layout for this model, tensor or TP size."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """vLLM's `pad_vocab_size`: the vocabulary rounded up to a multiple of `pad_to`."""
    return -(-vocab_size // pad_to) * pad_to


@dataclass(frozen=True)
class Block:
    """A run of `units` units of `unit_size` elements each along the split dimension, which
    vLLM divides over the ranks on its own (a block of heads, rows or columns)."""

    name: str
    units: int
    unit_size: int = 1
    replicable: bool = False
    """KV heads: when TP reaches their count, each rank holds one, replicated."""

    def units_per_rank(self, tp: int) -> int:
        """How many units each of `tp` ranks holds; refuses a TP size vLLM refuses."""
        if self.replicable and tp >= self.units:
            if tp % self.units:
                raise UnsupportedLayoutError(
                    f"TP {tp} is not a multiple of the {self.units} {self.name} "
                    "(vLLM replicates them only a whole number of times)"
                )
            return 1
        if self.units % tp:
            raise UnsupportedLayoutError(f"the {self.units} {self.name} do not split {tp} ways")
        return self.units // tp

    def replicas(self, tp: int) -> int:
        """How many ranks hold each unit (1 unless KV heads are replicated)."""
        return tp // self.units if self.replicable and tp >= self.units else 1

    def first_unit(self, rank: int, tp: int) -> int:
        """The first unit rank `rank` of `tp` holds (vLLM's `tp_rank // num_kv_head_replicas`
        for KV heads)."""
        return (rank // self.replicas(tp)) * self.units_per_rank(tp)

    def holder(self, unit: int, tp: int) -> int:
        """The lowest rank of `tp` that holds `unit`."""
        return (unit // self.units_per_rank(tp)) * self.replicas(tp)


@dataclass(frozen=True)
class Split:
    """A tensor cut along `dim`: each rank holds its part of every block, in block order."""

    dim: int
    blocks: tuple[Block, ...]

    def rank_length(self, tp: int) -> int:
        """The length of one rank's tensor along the split dimension."""
        return sum(b.units_per_rank(tp) * b.unit_size for b in self.blocks)

    def block_offset(self, index: int, tp: int) -> int:
        """Where block `index` starts in a rank's tensor along the split dimension."""
        return sum(b.units_per_rank(tp) * b.unit_size for b in self.blocks[:index])


@dataclass(frozen=True)
class Segment:
    """`length` elements along the split dimension of source rank `rank`, from `start`."""

    rank: int
    start: int
    length: int


def copy_plan(split: Split, source_tp: int, target_tp: int) -> list[list[Segment]]:
    """For each target rank, the source segments whose concatenation along the split
    dimension is that rank's tensor, in order (adjacent segments of one rank merged)."""
    plans: list[list[Segment]] = []
    for target in range(target_tp):
        segments: list[Segment] = []
        for index, block in enumerate(split.blocks):
            first = block.first_unit(target, target_tp)
            for unit in range(first, first + block.units_per_rank(target_tp)):
                source = block.holder(unit, source_tp)
                start = (
                    split.block_offset(index, source_tp)
                    + (unit - block.first_unit(source, source_tp)) * block.unit_size
                )
                _append(segments, Segment(source, start, block.unit_size))
        plans.append(segments)
    return plans


def replica_checks(split: Split, tp: int) -> list[tuple[Segment, Segment]]:
    """Pairs of segments of a TP `tp` set that vLLM fills with the same values (replicated KV
    heads): the first holder of each unit, and every other holder."""
    pairs: list[tuple[Segment, Segment]] = []
    for index, block in enumerate(split.blocks):
        replicas = block.replicas(tp)
        if replicas == 1:
            continue
        offset = split.block_offset(index, tp)
        length = block.units_per_rank(tp) * block.unit_size
        for rank in range(tp):
            first = (rank // replicas) * replicas
            if rank != first:
                pairs.append((Segment(first, offset, length), Segment(rank, offset, length)))
    return pairs


def _append(segments: list[Segment], segment: Segment) -> None:
    last = segments[-1] if segments else None
    if last is not None and last.rank == segment.rank and last.start + last.length == segment.start:
        segments[-1] = Segment(last.rank, last.start, last.length + segment.length)
    else:
        segments.append(segment)


Kind = Literal["split", "replicated", "marker"]


@dataclass(frozen=True)
class TensorRule:
    """How one tensor lies over the ranks."""

    kind: Kind
    split: Split | None = None
    full_shape: tuple[int, ...] | None = None
    """The whole (padded) tensor's shape, for a cut tensor."""

    def rank_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one rank's tensor has at `tp` (cut tensors only)."""
        if self.split is None or self.full_shape is None:
            raise ValueError("only a cut tensor has a per-rank shape")
        shape = list(self.full_shape)
        shape[self.split.dim] = self.split.rank_length(tp)
        return tuple(shape)


REPLICATED: Final = TensorRule("replicated")
MARKER: Final = TensorRule("marker")

_LAYER: Final = r"model\.layers\.\d+\."


@dataclass(frozen=True)
class ModelShape:
    """What the layout depends on, from the model's `config.json`."""

    architecture: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary as vLLM pads it."""
        return pad_vocab_size(self.vocab_size)

    def blocks(self) -> dict[str, Split]:
        """The splits of this model's cut tensors, by kind."""
        d = self.head_dim
        return {
            "qkv": Split(
                0,
                (
                    Block("query heads", self.num_heads, d),
                    Block("key heads", self.num_kv_heads, d, replicable=True),
                    Block("value heads", self.num_kv_heads, d, replicable=True),
                ),
            ),
            "o": Split(1, (Block("attention input columns", self.num_heads * d),)),
            "gate_up": Split(
                0,
                (
                    Block("gate rows", self.intermediate_size),
                    Block("up rows", self.intermediate_size),
                ),
            ),
            "down": Split(1, (Block("MLP input columns", self.intermediate_size),)),
            "vocab": Split(0, (Block("padded vocabulary rows", self.padded_vocab_size),)),
        }

    def check_tp(self, tp: int) -> None:
        """Refuse a TP size vLLM itself would refuse for this model."""
        for split in self.blocks().values():
            split.rank_length(tp)

    def rule(self, name: str) -> TensorRule | None:
        """How the tensor `name` lies over the ranks; None for a tensor preshard does not know."""
        h, d, hidden = self.num_heads, self.head_dim, self.hidden_size
        kv, inter, vocab = self.num_kv_heads, self.intermediate_size, self.padded_vocab_size
        splits = self.blocks()
        qkv_rows = (h + 2 * kv) * d
        table: Sequence[tuple[str, TensorRule]] = (
            (re.escape(MARKER_NAME), MARKER),
            (
                r"model\.embed_tokens\.weight|lm_head\.weight",
                TensorRule("split", splits["vocab"], (vocab, hidden)),
            ),
            (
                _LAYER + r"self_attn\.qkv_proj\.weight",
                TensorRule("split", splits["qkv"], (qkv_rows, hidden)),
            ),
            (
                _LAYER + r"self_attn\.qkv_proj\.bias",
                TensorRule("split", splits["qkv"], (qkv_rows,)),
            ),
            (
                _LAYER + r"self_attn\.o_proj\.weight",
                TensorRule("split", splits["o"], (hidden, h * d)),
            ),
            (
                _LAYER + r"mlp\.gate_up_proj\.weight",
                TensorRule("split", splits["gate_up"], (2 * inter, hidden)),
            ),
            (
                _LAYER + r"mlp\.gate_up_proj\.bias",
                TensorRule("split", splits["gate_up"], (2 * inter,)),
            ),
            (
                _LAYER + r"mlp\.down_proj\.weight",
                TensorRule("split", splits["down"], (hidden, inter)),
            ),
            (
                _LAYER + r"(self_attn\.o_proj|mlp\.down_proj)\.bias"
                r"|" + _LAYER + r"(input_layernorm|post_attention_layernorm)\.weight"
                r"|model\.norm\.weight"
                r"|" + _LAYER + r"self_attn\.rotary_emb\.cos_sin_cache"
                r"|" + _LAYER + r"self_attn\.attn\._(k|v|q|prob)_scale",
                REPLICATED,
            ),
        )
        for pattern, rule in table:
            if re.fullmatch(pattern, name):
                return rule
        return None


# The architectures whose vLLM model classes build exactly the modules above: llama.py, and
# mistral.py, which subclasses it, take `head_dim` from the config when it is set, else
# hidden_size / num_attention_heads; qwen2.py builds the same layers (with a bias on
# `qkv_proj`) but always divides, whatever the config says. Each is compared with vLLM's own
# files (tests/dataplane/test_reshard.py, test_reshard_qwen2.py). Qwen2's optional QK norms
# (`qk_norm`) are tensors this table does not know, so such a model is refused.
SUPPORTED_ARCHITECTURES: Final = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
HEAD_DIM_FROM_CONFIG: Final = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


def model_shape(config: Mapping[str, object]) -> ModelShape:
    """The layout inputs of a model's `config.json`; refuses what this module does not cover."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise UnsupportedLayoutError(
            f"config.json names the architectures {architectures!r}; preshard reshards exactly "
            f"one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = str(architectures[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedLayoutError(
            f"the architecture {architecture} is not one preshard reshards "
            f"({', '.join(SUPPORTED_ARCHITECTURES)}): its vLLM layout has not been checked"
        )
    if config.get("quantization_config") is not None:
        raise UnsupportedLayoutError(
            "the model is quantized (config.json has a quantization_config); quantized "
            "weights are packed per rank in ways preshard does not reshard"
        )
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            raise UnsupportedLayoutError(f"the model has experts ({key}); MoE is not resharded")
    hidden = _positive(config, "hidden_size")
    heads = _positive(config, "num_attention_heads")
    kv_heads = _positive(config, "num_key_value_heads", default=heads)
    head_dim_value = config.get("head_dim")
    head_dim = (
        _positive(config, "head_dim")
        if head_dim_value is not None and architecture in HEAD_DIM_FROM_CONFIG
        else _whole(hidden, heads, "hidden_size / num_attention_heads")
    )
    return ModelShape(
        architecture=architecture,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_positive(config, "intermediate_size"),
        vocab_size=_positive(config, "vocab_size"),
    )


def _positive(config: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedLayoutError(f"config.json {key} is {value!r}, not a positive integer")
    return value


def _whole(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise UnsupportedLayoutError(f"{what} is not a whole number")
    return numerator // denominator
