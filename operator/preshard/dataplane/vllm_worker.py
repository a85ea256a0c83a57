"""Runs inside every vLLM worker process of `preshard serialize` (vLLM's `worker_extension_cls`).

vLLM's `serialize_vllm_model` ends each rank by calling `serialize_extra_artifacts`, which
downloads the model's non-weight files from the Hugging Face Hub by `served_model_name` and
writes them beside the shard. For a local model directory that name is a path, which the Hub
refuses, so the rank fails after its shard was written; on an air-gapped cluster it fails for
any model; and every rank repeats it. preshard uploads those files itself, once, so the
extension turns that step off in each worker before any rank serializes.
"""

from __future__ import annotations

from typing import Any, Final

EXTENSION_QUALNAME: Final = "preshard.dataplane.vllm_worker.SkipExtraArtifacts"


def _skip_extra_artifacts(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for vLLM's `serialize_extra_artifacts`: preshard stores those files itself."""


class SkipExtraArtifacts:
    """Mixed into vLLM's worker class; vLLM calls the hook once the worker's device is up."""

    def init_worker_extension(self) -> None:
        """Replace `serialize_extra_artifacts` in this worker process (`self` is the worker)."""
        from vllm.model_executor.model_loader import tensorizer  # noqa: PLC0415 - worker only

        tensorizer.serialize_extra_artifacts = _skip_extra_artifacts
