"""The engine seam: what turns a local model directory into one tensorizer file per rank.

`preshard serialize` prepares the model directory and the scratch volume, calls an `Engine`,
then uploads what it wrote. Production uses vLLM (`preshard.dataplane.vllm_engine`); tests
plug in a CPU engine through `PRESHARD_ENGINE=module:attribute`. This module imports nothing
heavy, so the controller can use `parse_engine_args` to validate a
spec before any Job runs.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol, TypeAlias, runtime_checkable

from preshard.contract import reasons
from preshard.contract.engine_args import RESERVED_ENGINE_ARGS
from preshard.contract.layout import RANK_FILE_TEMPLATE
from preshard.dataplane.errors import DataplaneError

ENGINE_ENV: Final = "PRESHARD_ENGINE"
DEFAULT_ENGINE: Final = "preshard.dataplane.vllm_engine:VllmEngine"

# vLLM's `ModelDType` choices.
DTYPES: Final = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32"})

EngineArgValue: TypeAlias = str | int | float | bool | list[str | int | float | bool | None] | None


@dataclass(frozen=True)
class EngineVersions:
    """The versions a shard set records: shards load only into a matching vLLM."""

    vllm: str
    tensorizer: str


@dataclass(frozen=True)
class EngineRequest:
    """One serialization: the model, the parallel layout and the output."""

    model: str
    """A local model directory (what `serialize` passes) or a Hugging Face repository id."""
    revision: str | None
    tensor_parallel_size: int
    dtype: str
    max_model_len: int | None
    output_dir: Path
    extra_engine_args: Mapping[str, EngineArgValue] = field(default_factory=dict)
    encryption_keyfile: Path | None = None

    @property
    def output_template(self) -> str:
        """The `%03d` path template of the rank files."""
        return str(self.output_dir / RANK_FILE_TEMPLATE)


@runtime_checkable
class Engine(Protocol):
    """Writes `model-rank-%03d.tensors` for every rank of a request into its output dir."""

    def versions(self) -> EngineVersions:
        """The vLLM and tensorizer versions of the files this engine writes."""
        ...

    def serialize(self, request: EngineRequest) -> None:
        """Write one tensorizer file per tensor-parallel rank; raise on failure."""
        ...


def load_engine(spec: str | None = None) -> Engine:
    """The engine named by `module:attribute` (default: `PRESHARD_ENGINE`, else vLLM).

    The attribute is a class or a factory taking no arguments.
    """
    spec = spec or os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS, f"{ENGINE_ENV}={spec!r} is not of the form module:attribute"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise DataplaneError(
            reasons.INTERNAL_ERROR, f"the engine {spec} cannot be loaded: {exc}"
        ) from exc
    engine = factory()
    if not isinstance(engine, Engine):
        raise DataplaneError(reasons.INTERNAL_ERROR, f"{spec} did not make an Engine")
    return engine


def parse_engine_args(text: str | None) -> dict[str, EngineArgValue]:
    """Parse `--engine-args-json`: a JSON object of extra `EngineArgs` fields.

    Keys preshard controls and values that are not JSON scalars or lists of scalars are
    refused with `InvalidArguments`.
    """
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS, f"--engine-args-json is not valid JSON ({exc})"
        ) from exc
    if not isinstance(value, dict):
        raise DataplaneError(reasons.INVALID_ARGUMENTS, "--engine-args-json must be a JSON object")
    reserved = sorted(set(value) & RESERVED_ENGINE_ARGS)
    if reserved:
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS,
            f"--engine-args-json sets {', '.join(reserved)}, which preshard controls",
        )
    result: dict[str, EngineArgValue] = {}
    for key, item in value.items():
        if not key.isidentifier() or key.startswith("_"):
            raise DataplaneError(
                reasons.INVALID_ARGUMENTS, f"--engine-args-json key {key!r} is not a field name"
            )
        if not _is_plain(item):
            raise DataplaneError(
                reasons.INVALID_ARGUMENTS,
                f"--engine-args-json {key}: only strings, numbers, booleans, null and lists "
                "of those are accepted",
            )
        result[key] = item
    return result


def _is_plain(value: object) -> bool:
    scalar = (str, int, float, bool, type(None))
    if isinstance(value, scalar):
        return True
    return isinstance(value, list) and all(isinstance(v, scalar) for v in value)
