"""Engine arguments preshard sets itself, in one place for the spec and the data plane.

The controller refuses them in `spec.serialization.extraEngineArgs`; `preshard serialize`
refuses them in `--engine-args-json`. Names use vLLM's `EngineArgs` field spelling; vLLM treats
`-` and `_` alike, and so do both checks.
"""

from __future__ import annotations

from typing import Final

# `EngineArgs` fields preshard sets itself: the model and its revision, the parallel layout
# the shard files are cut for, how weights are loaded and where they come from, the worker
# classes, and credentials (never accepted as arguments).
RESERVED_ENGINE_ARGS: Final = frozenset(
    {
        "model",
        "model_weights",
        "tokenizer",
        "hf_config_path",
        "revision",
        "code_revision",
        "tokenizer_revision",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "data_parallel_size_local",
        "data_parallel_rank",
        "data_parallel_start_rank",
        "prefill_context_parallel_size",
        "decode_context_parallel_size",
        "nnodes",
        "node_rank",
        "load_format",
        "dtype",
        "max_model_len",
        "model_loader_extra_config",
        "download_dir",
        "worker_cls",
        "worker_extension_cls",
        "hf_token",
        "served_model_name",
        "distributed_executor_backend",
    }
)
