"""A CPU engine for tests and benchmarks: real tensorizer rank files from a tiny model,
without vLLM or a GPU.

It stands in for vLLM's `tensorize_vllm_model` (which needs N GPUs) behind the same seam. Each
rank gets the slice of every weight that tensor parallelism would give it: column-parallel
and vocabulary-parallel weights split on dim 0, row-parallel weights on dim 1, everything else
(norms) replicated. Encryption uses the key file exactly as vLLM does: the raw 32-byte key
becomes `EncryptionParams(key=...)` for every rank.

Select it with `PRESHARD_ENGINE=preshard_devenv.cpuengine:CpuTestEngine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import torch

from preshard.dataplane.engine import EngineRequest, EngineVersions

SPEC: Final = "preshard_devenv.cpuengine:CpuTestEngine"
VLLM_VERSION: Final = "cpu-test"

# Llama-style module names by how tensor parallelism cuts their weights.
COLUMN_PARALLEL: Final = frozenset(
    {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"}
)
ROW_PARALLEL: Final = frozenset({"o_proj", "down_proj"})

DTYPES: Final[dict[str, torch.dtype | None]] = {
    "auto": None,
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a weight on; None when it is replicated."""
    parts = set(name.split("."))
    if parts & COLUMN_PARALLEL:
        return 0
    if parts & ROW_PARALLEL:
        return 1
    return None


def rank_slice(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The part of `tensor` that rank `rank` of `world` holds."""
    dim = split_dim(name)
    if dim is None or world == 1:
        return tensor.clone()
    if tensor.shape[dim] % world:
        raise ValueError(f"{name} dim {dim} ({tensor.shape[dim]}) does not split {world} ways")
    return tensor.chunk(world, dim=dim)[rank].contiguous()


def cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """`tensor` in the requested serving dtype (`auto` keeps the checkpoint's)."""
    target = DTYPES[dtype]
    if target is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(target)


def load_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the top-level safetensors files of a model directory."""
    from safetensors.torch import load_file  # noqa: PLC0415 - keeps collection light

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return tensors


class CpuTestEngine:
    """Writes real tensorizer rank files on the CPU with `TensorSerializer`."""

    def versions(self) -> EngineVersions:
        """A marker vLLM version and the installed tensorizer's."""
        import tensorizer  # noqa: PLC0415

        return EngineVersions(vllm=VLLM_VERSION, tensorizer=str(tensorizer.__version__))

    def serialize(self, request: EngineRequest) -> None:
        """Split the checkpoint across `tensor_parallel_size` ranks and serialize each."""
        from tensorizer import EncryptionParams, TensorSerializer  # noqa: PLC0415

        checkpoint = load_checkpoint(Path(request.model))
        encryption = None
        if request.encryption_keyfile is not None:
            encryption = EncryptionParams(key=request.encryption_keyfile.read_bytes())
        world = request.tensor_parallel_size
        for rank in range(world):
            shard = {
                name: cast(rank_slice(name, tensor, rank, world), request.dtype)
                for name, tensor in checkpoint.items()
            }
            serializer = TensorSerializer(request.output_template % rank, encryption=encryption)
            serializer.write_state_dict(shard)
            serializer.close()
