"""Asks the installed vLLM's own layers how they cut each tensor, and checks `tp_layout` by it.

Run as `python -m tests.vllm.layout_probe` with `VLLM_TARGET_DEVICE=cpu`. For several attention
and vocabulary shapes and every TP size from 1 to 8, it builds vLLM's `QKVParallelLinear`,
`MergedColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` and
`ParallelLMHead` for each rank (with vLLM's tensor-parallel rank and size functions answering
for that rank, no process group), loads whole numbered weights through each parameter's own
`weight_loader` as vLLM's model loader does (q, k, v and gate, up by shard id), and then checks
`preshard.dataplane.tp_layout` against what vLLM put on each rank:

- the TP sizes vLLM's layers accept are the ones `ModelShape.check_tp` accepts;
- each cut parameter's `output_dim` or `input_dim` is the layout's split dimension, and its
  per-rank shape the layout's;
- every copy plan from TP N to TP M turns vLLM's N pieces into exactly vLLM's M pieces;
- what the layout calls replicated is the same on every rank.

Prints one JSON line: the counts checked and every disagreement.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from preshard.dataplane.tp_layout import ModelShape, UnsupportedLayoutError, copy_plan

# Each shape: heads, KV heads, head size, hidden size, intermediate size, vocabulary.
SHAPES = (
    (4, 2, 32, 128, 256, 500),  # the engine tier's tiny Llama, padded vocabulary
    (8, 8, 4, 32, 48, 1000),  # multi-head
    (8, 1, 4, 32, 48, 64),  # multi-query
    (8, 2, 4, 32, 48, 130),  # KV heads replicated at TP 4 and 8
    (6, 3, 4, 24, 36, 100),  # TP 3 and 6; KV heads replicated at TP 6
    (12, 4, 4, 48, 24, 320),  # TP 3 and 6 with 4 KV heads: vLLM refuses TP 6
)
TP_RANGE = range(1, 9)


def patch_parallel_state(state: dict[str, int]) -> None:
    """Make every vLLM module answer the tensor-parallel rank and size from `state`."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        if hasattr(module, "get_tensor_model_parallel_world_size"):
            module.get_tensor_model_parallel_world_size = lambda: state["tp"]  # type: ignore[attr-defined]
        if hasattr(module, "get_tensor_model_parallel_rank"):
            module.get_tensor_model_parallel_rank = lambda: state["rank"]  # type: ignore[attr-defined]


def numbered(*size: int, offset: float = 0) -> torch.Tensor:
    return torch.arange(torch.Size(size).numel(), dtype=torch.float32).reshape(size) + offset


def vllm_ranks(shape: tuple[int, ...], tp: int, state: dict[str, int]) -> dict[str, Any] | None:
    """Every rank's tensors as vLLM's layers load them at `tp`; None when vLLM refuses `tp`."""
    from vllm.model_executor.layers import linear  # noqa: PLC0415
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab  # noqa: PLC0415

    heads, kv_heads, head_dim, hidden, inter, vocab_size = shape
    q = numbered(heads * head_dim, hidden)
    k = numbered(kv_heads * head_dim, hidden, offset=1e5)
    v = numbered(kv_heads * head_dim, hidden, offset=2e5)
    gate, up = numbered(inter, hidden, offset=3e5), numbered(inter, hidden, offset=4e5)
    o, down = numbered(hidden, heads * head_dim), numbered(hidden, inter, offset=5e5)
    table = numbered(vocab_size, hidden, offset=1)
    ranks: list[dict[str, torch.Tensor]] = []
    dims: dict[str, int | None] = {}
    for rank in range(tp):
        state.update(tp=tp, rank=rank)
        try:
            qkv = linear.QKVParallelLinear(
                hidden, head_dim, heads, kv_heads, bias=True, params_dtype=torch.float32
            )
            gate_up = linear.MergedColumnParallelLinear(
                hidden, [inter, inter], bias=True, params_dtype=torch.float32
            )
            o_proj = linear.RowParallelLinear(
                heads * head_dim, hidden, bias=True, params_dtype=torch.float32
            )
            down_proj = linear.RowParallelLinear(inter, hidden, params_dtype=torch.float32)
            embed = vocab.VocabParallelEmbedding(vocab_size, hidden, params_dtype=torch.float32)
            head = vocab.ParallelLMHead(vocab_size, hidden, params_dtype=torch.float32)
        except (AssertionError, ValueError):
            return None
        loads: list[tuple[str, Any, list[tuple[torch.Tensor, Any]]]] = [
            ("qkv.weight", qkv.weight, [(q, "q"), (k, "k"), (v, "v")]),
            ("qkv.bias", qkv.bias, [(q[:, 0], "q"), (k[:, 0], "k"), (v[:, 0], "v")]),
            ("gate_up.weight", gate_up.weight, [(gate, 0), (up, 1)]),
            ("gate_up.bias", gate_up.bias, [(gate[:, 0], 0), (up[:, 0], 1)]),
            ("o.weight", o_proj.weight, [(o, None)]),
            ("o.bias", o_proj.bias, [(o[:, 0], None)]),
            ("down.weight", down_proj.weight, [(down, None)]),
            ("embed.weight", embed.weight, [(table, None)]),
            ("lm_head.weight", head.weight, [(table + 7, None)]),
        ]
        tensors = {}
        for name, param, parts in loads:
            loader: Callable[..., None] = param.weight_loader
            with torch.no_grad():
                param.data.fill_(-1.0)
                for tensor, shard in parts:
                    if shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
            tensors[name] = param.data.clone()
            if "bias" not in name:
                output_dim = getattr(param, "output_dim", None)
                input_dim = getattr(param, "input_dim", None)
                dims[name] = input_dim if name in ("o.weight", "down.weight") else output_dim
        ranks.append(tensors)
    return {"ranks": ranks, "dims": dims}


LAYOUT_NAMES = {
    "qkv.weight": "model.layers.0.self_attn.qkv_proj.weight",
    "qkv.bias": "model.layers.0.self_attn.qkv_proj.bias",
    "gate_up.weight": "model.layers.0.mlp.gate_up_proj.weight",
    "gate_up.bias": "model.layers.0.mlp.gate_up_proj.bias",
    "o.weight": "model.layers.0.self_attn.o_proj.weight",
    "o.bias": "model.layers.0.self_attn.o_proj.bias",
    "down.weight": "model.layers.0.mlp.down_proj.weight",
    "embed.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
}


def check_tp_size(
    shape: tuple[int, ...],
    layout: ModelShape,
    tp: int,
    got: dict[str, Any] | None,
    problems: list[str],
) -> None:
    """vLLM and the layout agree on whether `tp` is possible, the dims and the shapes."""
    try:
        layout.check_tp(tp)
        ours = True
    except UnsupportedLayoutError:
        ours = False
    if ours != (got is not None):
        problems.append(f"{shape} TP {tp}: vLLM accepts={got is not None}, ours={ours}")
    if got is None:
        return
    for short, name in LAYOUT_NAMES.items():
        rule = layout.rule(name)
        if rule is None:
            problems.append(f"{name} has no rule")
            continue
        pieces = [r[short] for r in got["ranks"]]
        if rule.kind == "replicated":
            if any(not torch.equal(p, pieces[0]) for p in pieces):
                problems.append(f"{shape} TP {tp} {short}: not the same on every rank")
            continue
        assert rule.split is not None
        if short in got["dims"] and got["dims"][short] != rule.split.dim:
            problems.append(f"{short}: vLLM's dim {got['dims'][short]}, ours {rule.split.dim}")
        if tuple(pieces[0].shape) != rule.rank_shape(tp):
            problems.append(
                f"{shape} TP {tp} {short}: vLLM {tuple(pieces[0].shape)}, "
                f"ours {rule.rank_shape(tp)}"
            )


def check_plans(
    shape: tuple[int, ...],
    layout: ModelShape,
    source: dict[str, Any],
    target: dict[str, Any],
    problems: list[str],
) -> int:
    """Every copy plan from the source TP to the target TP gives vLLM's target pieces."""
    source_tp, target_tp = len(source["ranks"]), len(target["ranks"])
    checked = 0
    for short, name in LAYOUT_NAMES.items():
        rule = layout.rule(name)
        if rule is None or rule.split is None:
            continue
        split = rule.split
        pieces = [r[short] for r in source["ranks"]]
        for rank, segments in enumerate(copy_plan(split, source_tp, target_tp)):
            made = torch.cat(
                [pieces[s.rank].narrow(split.dim, s.start, s.length) for s in segments],
                split.dim,
            )
            expected = target["ranks"][rank][short]
            checked += 1
            if made.shape != expected.shape or not torch.equal(made, expected):
                problems.append(f"{shape} {short} TP {source_tp} -> {target_tp} rank {rank}")
    return checked


def main() -> int:
    """Run every check; print the counts and the disagreements as one JSON line."""
    import vllm  # noqa: PLC0415
    import vllm.model_executor.layers.linear  # noqa: PLC0415
    import vllm.model_executor.layers.vocab_parallel_embedding  # noqa: PLC0415

    state = {"tp": 1, "rank": 0}
    patch_parallel_state(state)
    problems: list[str] = []
    counts = {"tp_sizes": 0, "refused": 0, "plans": 0, "tensors": 0}
    for shape in SHAPES:
        heads, kv_heads, head_dim, hidden, inter, vocab_size = shape
        layout = ModelShape(
            "LlamaForCausalLM", hidden, heads, kv_heads, head_dim, inter, vocab_size
        )
        loaded: dict[int, dict[str, Any]] = {}
        for tp in TP_RANGE:
            got = vllm_ranks(shape, tp, state)
            counts["tp_sizes"] += 1
            counts["refused"] += got is None
            check_tp_size(shape, layout, tp, got, problems)
            if got is not None:
                loaded[tp] = got
        for source, target in itertools.permutations(sorted(loaded), 2):
            counts["tensors"] += check_plans(
                shape, layout, loaded[source], loaded[target], problems
            )
            counts["plans"] += 1
    print(json.dumps({"vllm": str(vllm.__version__), "counts": counts, "problems": problems}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
