"""Tiny deterministic models for data-plane tests, and checks of the shards made from them.

`make_tiny_model` writes a Llama-shaped model directory (config, tokenizer, generation config,
safetensors weights of a few MB by default) from a seed; `upload_model` puts it under an S3
prefix as a model source; `assert_shards_match` loads rank files back with tensorizer's
`TensorDeserializer`, reassembles them the way tensor parallelism cut them and compares every
tensor exactly with the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch

from tests.support.engine import cast, load_checkpoint, split_dim

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

CONFIG_FILES: Final = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class TinyModel:
    """A model directory written by `make_tiny_model`."""

    path: Path
    weight_files: tuple[str, ...]
    config_files: tuple[str, ...]

    @property
    def weight_bytes(self) -> int:
        """The size of the safetensors files."""
        return sum((self.path / name).stat().st_size for name in self.weight_files)

    def tensors(self, dtype: str = "auto") -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, cast as an engine serving `dtype` would cast them."""
        return {name: cast(t, dtype) for name, t in load_checkpoint(self.path).items()}


def llama_config(
    *, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> dict[str, object]:
    """A `LlamaForCausalLM` config.json of the given shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def make_tiny_model(
    directory: Path,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int = 4,
    vocab: int = 512,
    weight_shards: int = 1,
    seed: int = 0,
) -> TinyModel:
    """Write a deterministic Llama-shaped model into `directory` (about 3 MB by default).

    Every dimension a tensor-parallel split cuts is divisible by 4 at the defaults. With
    `weight_shards > 1` the weights are spread over `model-0000i-of-0000n.safetensors` files
    with a `model.safetensors.index.json`, the layout of larger models.
    """
    from safetensors.torch import save_file  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // heads
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weight(vocab, hidden_size)}
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.self_attn.q_proj.weight": weight(heads * head_dim, hidden_size),
            f"{p}.self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden_size),
            f"{p}.self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden_size),
            f"{p}.self_attn.o_proj.weight": weight(hidden_size, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": weight(intermediate_size, hidden_size),
            f"{p}.mlp.up_proj.weight": weight(intermediate_size, hidden_size),
            f"{p}.mlp.down_proj.weight": weight(hidden_size, intermediate_size),
            f"{p}.input_layernorm.weight": 1 + weight(hidden_size),
            f"{p}.post_attention_layernorm.weight": 1 + weight(hidden_size),
        }
    tensors["model.norm.weight"] = 1 + weight(hidden_size)
    tensors["lm_head.weight"] = weight(vocab, hidden_size)

    names = sorted(tensors)
    if weight_shards == 1:
        weight_files: tuple[str, ...] = ("model.safetensors",)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        files = [
            f"model-{i + 1:05d}-of-{weight_shards:05d}.safetensors" for i in range(weight_shards)
        ]
        weight_map = {name: files[n % weight_shards] for n, name in enumerate(names)}
        for file in files:
            part = {name: tensors[name] for name in names if weight_map[name] == file}
            save_file(part, directory / file, metadata={"format": "pt"})
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        weight_files = tuple(files)

    config = llama_config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
    )
    _write_json(directory / "config.json", config)
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False},
    )
    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    _write_json(
        directory / "tokenizer.json",
        {
            "version": "1.0",
            "added_tokens": [],
            "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": None,
            "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocabulary, "unk_token": "<unk>"},
        },
    )
    _write_json(
        directory / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 512},
    )
    return TinyModel(directory, weight_files, CONFIG_FILES)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


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
