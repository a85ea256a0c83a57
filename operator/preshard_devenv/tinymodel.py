"""A tiny deterministic Llama, written from a seed: what every tier serializes and serves.

No download: config, a word-level tokenizer (`t3`, `t4`, ... so any token id decodes to a
word), generation config and safetensors weights of a few MB. Every dimension tensor
parallelism cuts is divisible by 4 at the defaults. vLLM's CPU build serves it.
`make_tiny_model` writes one and says where (`TinyModel`), for the tests and benchmarks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    import torch

CONFIG_FILES: Final = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


Architecture = Literal["llama", "qwen2"]
# The two layouts the tiny model takes: Qwen2 is Llama's with biases on q, k and v.
ARCHITECTURES: Final[dict[str, str]] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def llama_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    tie_word_embeddings: bool = False,
    architecture: Architecture = "llama",
) -> dict[str, object]:
    """A `LlamaForCausalLM` (or `Qwen2ForCausalLM`) config.json of the given shape."""
    return {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
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
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_tiny_llama(
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
    scale: float = 0.02,
    tie_word_embeddings: bool = False,
    architecture: Architecture = "llama",
) -> tuple[str, ...]:
    """Write a deterministic Llama-shaped model into `directory` (about 3 MB by default) and
    return the names of its weight files.

    With `weight_shards > 1` the weights are spread over `model-0000i-of-0000n.safetensors`
    files with a `model.safetensors.index.json`, the layout of larger models. `scale` is the
    weights' standard deviation; with tied embeddings there is no `lm_head.weight`.
    """
    import torch  # noqa: PLC0415 - heavy, only where a model is made
    from safetensors.torch import save_file  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // heads
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

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
        if architecture == "qwen2":
            tensors |= {
                f"{p}.self_attn.q_proj.bias": weight(heads * head_dim),
                f"{p}.self_attn.k_proj.bias": weight(kv_heads * head_dim),
                f"{p}.self_attn.v_proj.bias": weight(kv_heads * head_dim),
            }
    tensors["model.norm.weight"] = 1 + weight(hidden_size)
    if not tie_word_embeddings:
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
        tie_word_embeddings=tie_word_embeddings,
        architecture=architecture,
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
    return weight_files


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
        from preshard_devenv.cpuengine import cast, load_checkpoint  # noqa: PLC0415 - torch

        return {name: cast(t, dtype) for name, t in load_checkpoint(self.path).items()}


def make_tiny_model(directory: Path, **shape: Any) -> TinyModel:
    """Write a deterministic Llama-shaped model into `directory` (see `write_tiny_llama`)."""
    return TinyModel(directory, write_tiny_llama(directory, **shape), CONFIG_FILES)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
