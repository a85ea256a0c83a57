"""The layout math of `preshard reshard`: copy plans against vLLM's own cuts, on tiny tensors.

`preshard_devenv.vllm_layout` states vLLM's weight loaders independently; every plan from TP N
to TP M must turn vLLM's TP N pieces into exactly vLLM's TP M pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

from preshard.dataplane.tp_layout import (
    MARKER_NAME,
    Block,
    ModelShape,
    Segment,
    Split,
    UnsupportedLayoutError,
    copy_plan,
    model_shape,
    pad_vocab_size,
    replica_checks,
)
from preshard_devenv.vllm_layout import merged_rank, qkv_rank, row_rank, vocab_rank

HIDDEN = 8
HEAD_DIM = 4


def shape(heads: int, kv_heads: int, *, vocab: int = 500, inter: int = 24) -> ModelShape:
    return ModelShape(
        architecture="LlamaForCausalLM",
        hidden_size=HIDDEN,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        intermediate_size=inter,
        vocab_size=vocab,
    )


def numbered(*size: int) -> torch.Tensor:
    """A tensor whose every element is its own index: any misplaced element shows."""
    return torch.arange(torch.Size(size).numel(), dtype=torch.float32).reshape(size)


def apply(split: Split, pieces: Sequence[torch.Tensor], target_tp: int) -> list[torch.Tensor]:
    """Run a copy plan on tensors."""
    return [
        torch.cat(
            [pieces[s.rank].narrow(split.dim, s.start, s.length) for s in segments], split.dim
        )
        for segments in copy_plan(split, len(pieces), target_tp)
    ]


def assert_same(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for rank, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.shape == b.shape, f"rank {rank}: {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a, b), f"rank {rank} holds other values"


# (heads, kv_heads, TP sizes vLLM accepts for them)
ATTENTION = [
    (4, 2, (1, 2, 4)),  # the tiny model: KV heads replicated at TP 4
    (8, 8, (1, 2, 4, 8)),  # multi-head attention
    (8, 1, (1, 2, 4, 8)),  # multi-query: one KV head on every rank
    (8, 2, (1, 2, 4, 8)),  # KV heads replicated 2 and 4 times
    (6, 6, (1, 2, 3, 6)),  # TP 3 and 6
    (6, 3, (1, 3, 6)),  # KV heads replicated twice at TP 6
]
PAIRS = [
    (heads, kv, n, m) for heads, kv, sizes in ATTENTION for n, m in itertools.permutations(sizes, 2)
]


@pytest.mark.parametrize(("heads", "kv_heads", "source_tp", "target_tp"), PAIRS)
def test_qkv_plan_gives_vllms_pieces(
    heads: int, kv_heads: int, source_tp: int, target_tp: int
) -> None:
    model = shape(heads, kv_heads)
    q = numbered(heads * HEAD_DIM, HIDDEN)
    k = numbered(kv_heads * HEAD_DIM, HIDDEN) + 10_000
    v = numbered(kv_heads * HEAD_DIM, HIDDEN) + 20_000

    def cut(tp: int, *, bias: bool = False) -> list[torch.Tensor]:
        parts = (q[:, 0], k[:, 0], v[:, 0]) if bias else (q, k, v)
        return [
            qkv_rank(*parts, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, rank=r, tp=tp)
            for r in range(tp)
        ]

    split = model.blocks()["qkv"]
    assert_same(apply(split, cut(source_tp), target_tp), cut(target_tp))
    assert_same(apply(split, cut(source_tp, bias=True), target_tp), cut(target_tp, bias=True))
    rule = model.rule("model.layers.3.self_attn.qkv_proj.weight")
    assert rule is not None
    assert rule.rank_shape(target_tp) == tuple(cut(target_tp)[0].shape)


@pytest.mark.parametrize(
    ("source_tp", "target_tp"), list(itertools.permutations((1, 2, 3, 4, 6), 2))
)
def test_mlp_and_row_parallel_plans_give_vllms_pieces(source_tp: int, target_tp: int) -> None:
    model = shape(12, 12, inter=24)
    gate, up = numbered(24, HIDDEN), numbered(24, HIDDEN) + 10_000
    down, o = numbered(HIDDEN, 24), numbered(HIDDEN, 12 * HEAD_DIM)

    def merged(tp: int) -> list[torch.Tensor]:
        return [merged_rank([gate, up], rank=r, tp=tp) for r in range(tp)]

    def rows(weight: torch.Tensor, tp: int) -> list[torch.Tensor]:
        return [row_rank(weight, rank=r, tp=tp) for r in range(tp)]

    splits = model.blocks()
    assert_same(apply(splits["gate_up"], merged(source_tp), target_tp), merged(target_tp))
    assert_same(apply(splits["down"], rows(down, source_tp), target_tp), rows(down, target_tp))
    assert_same(apply(splits["o"], rows(o, source_tp), target_tp), rows(o, target_tp))


@pytest.mark.parametrize("vocab", [500, 512, 100, 1])
@pytest.mark.parametrize(("source_tp", "target_tp"), list(itertools.permutations((1, 2, 4, 8), 2)))
def test_vocabulary_plan_keeps_vllms_padding(vocab: int, source_tp: int, target_tp: int) -> None:
    model = shape(8, 8, vocab=vocab)
    table = numbered(vocab, HIDDEN) + 1  # no real row is all zeros

    def cut(tp: int) -> list[torch.Tensor]:
        return [vocab_rank(table, rank=r, tp=tp) for r in range(tp)]

    assert_same(apply(model.blocks()["vocab"], cut(source_tp), target_tp), cut(target_tp))
    rule = model.rule("lm_head.weight")
    assert rule is not None
    assert rule.rank_shape(target_tp) == (pad_vocab_size(vocab) // target_tp, HIDDEN)


def test_a_padded_vocabulary_ends_in_zero_rows_on_the_last_rank() -> None:
    pieces = [vocab_rank(numbered(500, HIDDEN) + 1, rank=r, tp=2) for r in range(2)]
    assert [tuple(p.shape) for p in pieces] == [(256, HIDDEN), (256, HIDDEN)]
    assert not pieces[1][244:].any()
    assert pieces[1][243].all()


def test_replicated_kv_heads_are_checked_between_their_holders() -> None:
    split = shape(4, 2).blocks()["qkv"]
    pairs = replica_checks(split, 4)
    # Each rank holds one query head (rows 0-3), one key head (4-7), one value head (8-11);
    # ranks 0 and 1 share KV head 0, ranks 2 and 3 KV head 1.
    assert [(a.rank, b.rank, a.start, a.length) for a, b in pairs] == [
        (0, 1, 4, 4),
        (2, 3, 4, 4),
        (0, 1, 8, 4),
        (2, 3, 8, 4),
    ]
    assert replica_checks(split, 2) == []
    assert replica_checks(split, 1) == []


def test_plans_read_each_source_range_in_as_few_segments_as_possible() -> None:
    split = shape(8, 8).blocks()["qkv"]
    # TP 4 -> TP 2: target rank 0 is ranks 0 and 1's query rows, then their key rows, then
    # their value rows: six segments, none of them one head long.
    plan = copy_plan(split, 4, 2)
    assert [(s.rank, s.start, s.length) for s in plan[0]] == [
        (0, 0, 8),
        (1, 0, 8),
        (0, 8, 8),
        (1, 8, 8),
        (0, 16, 8),
        (1, 16, 8),
    ]
    assert copy_plan(Split(0, (Block("rows", 12),)), 1, 3) == [
        [Segment(0, 0, 4)],
        [Segment(0, 4, 4)],
        [Segment(0, 8, 4)],
    ]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "words"),
    [
        (4, 2, 3, "query heads do not split 3 ways"),
        (8, 4, 8 * 3, "query heads do not split"),
        (12, 4, 6, "TP 6 is not a multiple of the 4 key heads"),
        (6, 3, 2, "the 3 key heads do not split 2 ways"),
    ],
)
def test_a_tp_size_vllm_refuses_is_refused(heads: int, kv_heads: int, tp: int, words: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=words):
        shape(heads, kv_heads, inter=48 * 4).check_tp(tp)


def test_a_vocabulary_that_does_not_divide_is_refused() -> None:
    model = shape(6, 6, vocab=500, inter=36)
    model.check_tp(2)
    with pytest.raises(UnsupportedLayoutError, match="512 padded vocabulary rows"):
        model.check_tp(3)


def test_every_tensor_vllm_writes_for_llama_has_a_rule() -> None:
    model = shape(4, 2)
    layer = "model.layers.17"
    kinds = {
        MARKER_NAME: "marker",
        "model.embed_tokens.weight": "split",
        "lm_head.weight": "split",
        f"{layer}.self_attn.qkv_proj.weight": "split",
        f"{layer}.self_attn.qkv_proj.bias": "split",
        f"{layer}.self_attn.o_proj.weight": "split",
        f"{layer}.self_attn.o_proj.bias": "replicated",
        f"{layer}.mlp.gate_up_proj.weight": "split",
        f"{layer}.mlp.gate_up_proj.bias": "split",
        f"{layer}.mlp.down_proj.weight": "split",
        f"{layer}.mlp.down_proj.bias": "replicated",
        f"{layer}.input_layernorm.weight": "replicated",
        f"{layer}.post_attention_layernorm.weight": "replicated",
        "model.norm.weight": "replicated",
        f"{layer}.self_attn.rotary_emb.cos_sin_cache": "replicated",
        f"{layer}.self_attn.attn._k_scale": "replicated",
        f"{layer}.self_attn.attn._prob_scale": "replicated",
    }
    for name, kind in kinds.items():
        rule = model.rule(name)
        assert rule is not None, name
        assert rule.kind == kind, name


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.qkv_proj.weight_scale",  # fp8
        "model.layers.0.self_attn.qkv_proj.qweight",  # GPTQ / AWQ
        "model.layers.0.mlp.experts.w13_weight",  # fused MoE
        "model.layers.0.mlp.gate.weight",  # MoE router
        "model.layers.0.self_attn.q_norm.weight",  # Qwen3-style QK norm
        "model.layers.0.ada_rms_norm_t_cond.0.weight",
        "model.embed_tokens.weight.extra",
        "lm_head.bias",
    ],
)
def test_unknown_tensors_have_no_rule(name: str) -> None:
    assert shape(4, 2).rule(name) is None


LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}


def test_model_shape_reads_the_config() -> None:
    llama = model_shape(LLAMA_CONFIG)
    assert (llama.head_dim, llama.num_kv_heads, llama.padded_vocab_size) == (128, 8, 128256)
    mistral_nemo = model_shape(
        LLAMA_CONFIG
        | {"architectures": ["MistralForCausalLM"], "hidden_size": 5120, "head_dim": 128}
    )
    assert mistral_nemo.head_dim == 128  # not 5120 / 32
    assert model_shape(LLAMA_CONFIG | {"head_dim": None}).head_dim == 128
    # vLLM's Qwen2 divides whatever the config says.
    qwen2 = model_shape(LLAMA_CONFIG | {"architectures": ["Qwen2ForCausalLM"], "head_dim": 64})
    assert qwen2.head_dim == 128
    no_kv = {k: v for k, v in LLAMA_CONFIG.items() if k != "num_key_value_heads"}
    assert model_shape(no_kv).num_kv_heads == 32


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2MoeForCausalLM is not one"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "has not been checked"),
        ({"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]}, "exactly one"),
        ({"architectures": None}, "exactly one"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
        ({"num_local_experts": 8}, "experts"),
        ({"hidden_size": "4096"}, "hidden_size is '4096'"),
        ({"vocab_size": 0}, "vocab_size is 0"),
    ],
)
def test_model_shape_refuses_what_it_does_not_cover(change: dict[str, object], words: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=words):
        model_shape(LLAMA_CONFIG | change)


def test_pad_vocab_size_is_vllms() -> None:
    assert [pad_vocab_size(v) for v in (1, 64, 65, 500, 32000, 128256, 151936)] == [
        64,
        64,
        128,
        512,
        32000,
        128256,
        151936,
    ]
