"""Rank files in, rank files out: `reshard_rank_files` on sets laid out as vLLM's, no S3.

The sets come from `preshard_devenv.vllm_layout` (vLLM's loaders restated); a resharded set must
be byte for byte the file that layout gives at the target TP size, and anything that does not
look like vLLM's layout must be refused before or while writing, leaving no target file. The
engine tier (`test_reshard.py`) compares with vLLM's own files.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import secrets
from pathlib import Path

import pytest
import torch
from tensorizer import CryptographyError

from preshard.dataplane.reshard_tensors import reshard_rank_files, tensor_names
from preshard.dataplane.tp_layout import UnsupportedLayoutError, model_shape
from preshard_devenv.cpuengine import load_checkpoint
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from preshard_devenv.vllm_layout import Entry, rank_entries, write_rank_file, write_vllm_set
from tests.support.models import load_rank_files

SHAPE = {"layers": 2, "heads": 4, "kv_heads": 2, "vocab": 500}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("reshard-model"), **SHAPE)


def config(model: TinyModel) -> dict[str, object]:
    value: dict[str, object] = json.loads((model.path / "config.json").read_text())
    return value


def targets(directory: Path, tp: int) -> list[Path]:
    return [directory / f"model-rank-{r:03d}.tensors" for r in range(tp)]


@pytest.mark.parametrize(("source_tp", "target_tp"), list(itertools.permutations((1, 2, 4), 2)))
def test_a_resharded_set_is_the_set_vllms_layout_gives_byte_for_byte(
    model: TinyModel, tmp_path: Path, source_tp: int, target_tp: int
) -> None:
    checkpoint, cfg = load_checkpoint(model.path), config(model)
    sources = write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=source_tp)
    expected = write_vllm_set(checkpoint, cfg, tmp_path / "expected", tp=target_tp)
    out = targets(tmp_path / "out", target_tp)

    result = reshard_rank_files(sources, out, model_shape(cfg))

    assert [p.read_bytes() == e.read_bytes() for p, e in zip(out, expected, strict=True)] == [
        True
    ] * target_tp
    assert result.tensors == len(tensor_names(sources[0]))


def test_an_encrypted_set_is_resharded_with_its_key(model: TinyModel, tmp_path: Path) -> None:
    checkpoint, cfg = load_checkpoint(model.path), config(model)
    key = secrets.token_bytes(32)
    sources = write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=2, key=key)
    expected = load_rank_files(write_vllm_set(checkpoint, cfg, tmp_path / "plain", tp=4))
    out = targets(tmp_path / "out", 4)

    reshard_rank_files(sources, out, model_shape(cfg), key=key)

    got = load_rank_files(out, key=key)
    for rank, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert list(mine) == list(theirs)
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype, (rank, name)
            assert torch.equal(mine[name], tensor), (rank, name)
    with pytest.raises(CryptographyError):
        load_rank_files(out[:1])


def rewrite(path: Path, entries: list[Entry], name: str, tensor: torch.Tensor) -> None:
    """Rewrite one rank file with one tensor replaced."""
    replaced = [dataclasses.replace(e, tensor=tensor) if e.name == name else e for e in entries]
    write_rank_file(path, replaced)


QKV = "model.layers.1.self_attn.qkv_proj.weight"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("unknown tensor", "not ones preshard knows how vLLM cuts"),
        ("quantized dtype", "is int8; only bfloat16, float16, float32"),
        ("norm differs", "input_layernorm.weight should be the same on every rank"),
        ("kv replicas differ", "replicated KV heads of ranks 0 and 1 differ"),
        ("wrong shape", "has the shape (128, 128); vLLM's layout at TP 4 is (96, 128)"),
        ("other names", "rank 1 holds other tensors than rank 0"),
    ],
)
def test_what_does_not_look_like_vllms_layout_is_refused_and_leaves_nothing(
    model: TinyModel, tmp_path: Path, case: str, words: str
) -> None:
    checkpoint, cfg = load_checkpoint(model.path), config(model)
    tp = 4
    sources = write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=tp)
    entries = [rank_entries(checkpoint, cfg, rank=r, tp=tp) for r in range(tp)]
    layer_norm = "model.layers.0.input_layernorm.weight"
    if case == "unknown tensor":
        extra = Entry(5, 0, "model.layers.0.self_attn.qkv_proj.weight_scale", torch.ones(1))
        for rank in range(tp):
            write_rank_file(sources[rank], [*entries[rank], extra])
    elif case == "quantized dtype":
        for rank in range(tp):
            rewrite(sources[rank], entries[rank], QKV, torch.ones(96, 128, dtype=torch.int8))
    elif case == "norm differs":
        rewrite(sources[3], entries[3], layer_norm, checkpoint[layer_norm] + 1)
    elif case == "kv replicas differ":
        qkv = next(e.tensor for e in entries[1] if e.name == QKV).clone()
        qkv[40] += 1  # a key row: rows 0-31 are the query head, 32-63 the key head
        rewrite(sources[1], entries[1], QKV, qkv)
    elif case == "wrong shape":
        for rank in range(tp):
            rewrite(sources[rank], entries[rank], QKV, torch.zeros(128, 128))
    else:
        write_rank_file(sources[1], [e for e in entries[1] if e.name != layer_norm])
    out = targets(tmp_path / "out", 2)

    with pytest.raises(UnsupportedLayoutError, match=re.escape(words)):
        reshard_rank_files(sources, out, model_shape(cfg))

    assert not any(p.exists() for p in out)


def test_a_config_that_does_not_match_the_files_is_refused(
    model: TinyModel, tmp_path: Path
) -> None:
    checkpoint, cfg = load_checkpoint(model.path), config(model)
    sources = write_vllm_set(checkpoint, cfg, tmp_path / "source", tp=2)
    other = model_shape(cfg | {"intermediate_size": 512})

    with pytest.raises(
        UnsupportedLayoutError, match=r"gate_up_proj\.weight on rank 0 has the shape"
    ):
        reshard_rank_files(sources, targets(tmp_path / "out", 1), other)
