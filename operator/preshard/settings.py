"""The operator's settings, read once at start-up from `PRESHARD_*` environment variables.

The Helm chart sets them from `values.yaml`; every one has a default that works in the local
development environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from preshard import __version__
from preshard.contract.quantity import QuantityError, whole_bytes

ENV_PREFIX: Final = "PRESHARD_"
MAX_PORT: Final = 65535


class SettingsError(ValueError):
    """A setting has a value the operator cannot use."""


@dataclass(frozen=True)
class Settings:
    """What the controller needs beyond the ShardedModel spec."""

    serializer_image: str = f"ghcr.io/preshard/preshard-serializer:{__version__}"
    """Default image of the GPU serialization Job (vLLM + tensorizer + preshard)."""

    serializer_vllm_version: str = "0.34.0"
    """The vLLM release the default serializer image is built on (the `FROM` of the
    Dockerfile's serializer stage). The artifact key of its sets names this release, not the
    image, so a preshard upgrade on the same vLLM re-serializes nothing; change it with the
    image when that moves to another vLLM."""

    tools_image: str = f"ghcr.io/preshard/preshard:{__version__}"
    """Image of the verify and delete Jobs and of the fetch-config init container."""

    image_pull_policy: str = "IfNotPresent"
    """Pull policy of every container preshard adds."""

    gpu_resource_name: str = "nvidia.com/gpu"
    """Default extended resource name of GPUs."""

    max_gpus_per_job: int = 8
    """The most GPUs one node (and so one serialization Job) offers; larger TP sizes are refused."""

    scratch_size: str = "200Gi"
    """Default size of the serialization Job's scratch volume (a Kubernetes quantity of at least
    one byte, read as the spec's `scratchSize` is)."""

    num_readers: int = 8
    """Default tensorizer `num_readers` written into patched Deployments."""

    model_dir: str = "/var/run/preshard/model"
    """Where the fetch-config init container puts the config and tokenizer files."""

    tensorizer_dir: str = "/var/run/preshard/tensorizer"
    """Where the init container puts the bundled tensorizer, on the vLLM container's
    `PYTHONPATH` (the stock vLLM image has no tensorizer)."""

    namespaces: tuple[str, ...] = field(default_factory=tuple)
    """Namespaces to watch; empty means the whole cluster."""

    cleanup_timeout_seconds: int = 900
    """How long deletion waits for cleanup before it gives up and releases the finalizer."""

    retry_backoff_seconds: int = 30
    """First delay before a transient failure (unreachable store) is tried again; doubles."""

    retry_backoff_max_seconds: int = 600
    """Longest delay between retries of a transient failure."""

    log_format: str = "text"
    """`text` or `json`."""

    metrics_port: int = 0
    """Port of the Prometheus endpoint `/metrics` on every address of the operator; 0 serves
    none. Off unless set, so operators started side by side on one machine (tests, `make run`)
    never contend for a port; the Helm chart sets it (9090 by default)."""

    progress_seconds: int = 15
    """How often the log of a running serialize or reshard Job's pod is read for its progress
    (`status.shardSets[].progress`); 0 reads none."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from `PRESHARD_*` variables; unset ones keep their defaults."""
        env = os.environ if environ is None else environ
        defaults = cls()

        def text(name: str, default: str) -> str:
            return env.get(ENV_PREFIX + name, "").strip() or default

        def number(name: str, default: int, minimum: int) -> int:
            raw = env.get(ENV_PREFIX + name, "").strip()
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise SettingsError(f"{ENV_PREFIX}{name}={raw!r} is not an integer") from None
            if value < minimum:
                raise SettingsError(f"{ENV_PREFIX}{name} must be at least {minimum}")
            return value

        serializer_vllm_version = text("SERIALIZER_VLLM_VERSION", defaults.serializer_vllm_version)
        if not re.match(r"^v?\d+\.\d+\.\d+", serializer_vllm_version):
            raise SettingsError(
                f"{ENV_PREFIX}SERIALIZER_VLLM_VERSION={serializer_vllm_version!r} is not a vLLM "
                "release such as 0.34.0"
            )
        scratch_size = text("SCRATCH_SIZE", defaults.scratch_size)
        try:
            whole_bytes(scratch_size)
        except QuantityError as error:
            raise SettingsError(f"{ENV_PREFIX}SCRATCH_SIZE: {error}") from None
        log_format = text("LOG_FORMAT", defaults.log_format)
        if log_format not in ("text", "json"):
            raise SettingsError(f"{ENV_PREFIX}LOG_FORMAT must be text or json, not {log_format!r}")
        metrics_port = number("METRICS_PORT", defaults.metrics_port, 0)
        if metrics_port > MAX_PORT:
            raise SettingsError(f"{ENV_PREFIX}METRICS_PORT must be at most {MAX_PORT}")
        namespaces = tuple(
            sorted(
                {n.strip() for n in env.get(ENV_PREFIX + "NAMESPACES", "").split(",") if n.strip()}
            )
        )
        return cls(
            serializer_image=text("SERIALIZER_IMAGE", defaults.serializer_image),
            serializer_vllm_version=serializer_vllm_version,
            tools_image=text("TOOLS_IMAGE", defaults.tools_image),
            image_pull_policy=text("IMAGE_PULL_POLICY", defaults.image_pull_policy),
            gpu_resource_name=text("GPU_RESOURCE_NAME", defaults.gpu_resource_name),
            max_gpus_per_job=number("MAX_GPUS_PER_JOB", defaults.max_gpus_per_job, 1),
            scratch_size=scratch_size,
            num_readers=number("NUM_READERS", defaults.num_readers, 1),
            model_dir=text("MODEL_DIR", defaults.model_dir),
            tensorizer_dir=text("TENSORIZER_DIR", defaults.tensorizer_dir),
            namespaces=namespaces,
            cleanup_timeout_seconds=number(
                "CLEANUP_TIMEOUT_SECONDS", defaults.cleanup_timeout_seconds, 0
            ),
            retry_backoff_seconds=number(
                "RETRY_BACKOFF_SECONDS", defaults.retry_backoff_seconds, 1
            ),
            retry_backoff_max_seconds=number(
                "RETRY_BACKOFF_MAX_SECONDS", defaults.retry_backoff_max_seconds, 1
            ),
            log_format=log_format,
            metrics_port=metrics_port,
            progress_seconds=number("PROGRESS_SECONDS", defaults.progress_seconds, 0),
        )
