"""The production engine: vLLM's own `tensorize_vllm_model`, with TP = N and PP = DP = 1.

vLLM builds an engine over N GPUs and every tensor-parallel worker writes its rank's file
(`model-rank-%03d.tensors`) into the scratch directory. Two things differ from vLLM's example
script, each for a reason:

* an encryption key is never generated: `generate_keyfile=False` makes every rank read the
  user's key from the mounted key file (`serialize_vllm_model` opens `encryption_keyfile`
  and builds `EncryptionParams(key=...)` from it);
* vLLM's per-rank upload of extra artifacts from the Hub is switched off in the workers (see
  `preshard.dataplane.vllm_worker`); `serialize` uploads those files itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from preshard.contract import reasons
from preshard.dataplane.engine import EngineRequest, EngineVersions
from preshard.dataplane.errors import DataplaneError
from preshard.dataplane.vllm_worker import EXTENSION_QUALNAME


def build_engine_kwargs(request: EngineRequest) -> dict[str, Any]:
    """The keyword arguments of vLLM's `EngineArgs` for a request.

    Extra engine args come first so that the fields preshard controls always win; CUDA graphs
    are off by default because serialization runs no inference.
    """
    kwargs: dict[str, Any] = {"enforce_eager": True}
    kwargs.update(request.extra_engine_args)
    kwargs.update(
        model=request.model,
        revision=request.revision,
        tensor_parallel_size=request.tensor_parallel_size,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        dtype=request.dtype,
        worker_extension_cls=EXTENSION_QUALNAME,
    )
    if request.max_model_len is not None:
        kwargs["max_model_len"] = request.max_model_len
    return kwargs


def build_tensorizer_kwargs(request: EngineRequest) -> dict[str, Any]:
    """The keyword arguments of vLLM's `TensorizerConfig` for a request: a local `%03d`
    template under the output directory, and the user's key file when encrypting."""
    kwargs: dict[str, Any] = {"tensorizer_uri": request.output_template}
    if request.encryption_keyfile is not None:
        kwargs["encryption_keyfile"] = str(request.encryption_keyfile)
    return kwargs


class VllmEngine:
    """Serializes with the installed vLLM (needs `tensor_parallel_size` GPUs)."""

    def versions(self) -> EngineVersions:
        """The installed vLLM and tensorizer versions."""
        import tensorizer  # noqa: PLC0415 - heavy, data-plane only
        import vllm  # noqa: PLC0415

        return EngineVersions(vllm=str(vllm.__version__), tensorizer=str(tensorizer.__version__))

    def serialize(self, request: EngineRequest) -> None:
        """Run `tensorize_vllm_model` for the request."""
        from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - heavy, data-plane only
        from vllm.model_executor.model_loader.tensorizer import (  # noqa: PLC0415
            TensorizerConfig,
            tensorize_vllm_model,
        )

        kwargs = build_engine_kwargs(request)
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise DataplaneError(
                reasons.INVALID_ARGUMENTS,
                f"vLLM's EngineArgs has no field {', '.join(unknown)} (--engine-args-json)",
            )
        try:
            engine_args = EngineArgs(**kwargs)
        except (TypeError, ValueError) as exc:
            raise DataplaneError(
                reasons.INVALID_ARGUMENTS, f"vLLM refused the engine arguments: {exc}"
            ) from exc
        tensorizer_config = TensorizerConfig(**build_tensorizer_kwargs(request))
        tensorize_vllm_model(engine_args, tensorizer_config, generate_keyfile=False)
