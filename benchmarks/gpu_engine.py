"""The engine tier on a GPU: vLLM (CUDA) serializes the tiny Llama and serves the patched argv.

The GPU variant of `tests/e2e/test_real_vllm.py` and `tests/dataplane/test_real_vllm.py`, for a
machine with CUDA GPUs and vLLM installed (the serializer image, or any Python with `vllm` and
`tensorizer`), no S3 and no cluster needed:

1. the tiny Llama is written from a seed (`preshard_devenv.tinymodel`);
2. `vllm serve` of the safetensors directory answers greedy completions (the baseline);
3. preshard's production engine (`VllmEngine`: vLLM's `tensorize_vllm_model`, TP = N) writes
   one rank file per GPU;
4. `vllm serve` with the command line preshard's rewriter writes for that set (local rank
   files instead of S3) must answer with the same token ids.

It prints one JSON line with the timings (engine start to `/health`, serialization, first
completion) and exits 1 if any answer differs. Without CUDA it says so and exits 0.

    python benchmarks/gpu_engine.py [--tensor-parallel-size N] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

if __package__ in (None, ""):
    # Run as a script: make the repository's packages importable.
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "operator")]

from preshard.builders.vllm_args import TensorizerLoad, rewrite_vllm_command
from preshard.contract.layout import RANK_FILE_TEMPLATE, rank_file_name
from preshard.dataplane.engine import EngineRequest
from preshard_devenv.engine import TINY_LLAMA, Completion, VllmServer, complete
from preshard_devenv.tinymodel import CONFIG_FILES, write_tiny_llama

SERVED: Final = "org/tiny"
PROMPTS: Final = ((5, 17, 33, 100), (300, 4, 77))
GPU_ARGS: Final = ("--dtype", "float16", "--max-model-len", "256", "--enforce-eager")


def serve(args: Sequence[str], log_dir: Path, name: str) -> tuple[VllmServer, float]:
    """Start this Python's `vllm serve ARGS` and wait for /health; the server and its seconds."""
    vllm = shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm"
    started = time.monotonic()
    server = VllmServer.launch(Path(vllm), args, log_dir, env=None, name=name, timeout=900)
    return server, time.monotonic() - started


def answers(server: VllmServer) -> dict[tuple[int, ...], Completion]:
    """Greedy completions of the fixed prompts."""
    return {p: complete(server.url(""), SERVED, p) for p in PROMPTS}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the GPU engine check; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=0, help="default: min(2, GPUs)")
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    import torch  # noqa: PLC0415 - heavy

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA device: the GPU engine check needs one; nothing was run")
        return 0
    tp = args.tensor_parallel_size or min(2, gpus)
    work = args.work or Path(tempfile.mkdtemp(prefix="preshard-gpu-engine-"))
    model = work / "model"
    write_tiny_llama(model, **TINY_LLAMA)
    figures: dict[str, float | int | bool] = {"tensorParallelSize": tp}

    server, figures["baselineHealthSeconds"] = serve(
        [str(model), "--served-model-name", SERVED, *GPU_ARGS], work, "vllm-baseline"
    )
    try:
        expected = answers(server)
    finally:
        server.stop()

    from preshard.dataplane.vllm_engine import VllmEngine  # noqa: PLC0415 - needs vLLM

    shards = work / "shards"
    started = time.monotonic()
    VllmEngine().serialize(
        EngineRequest(
            model=str(model),
            revision=None,
            tensor_parallel_size=tp,
            dtype="float16",
            max_model_len=256,
            output_dir=shards,
        )
    )
    figures["serializeSeconds"] = time.monotonic() - started
    config = work / "config"
    config.mkdir(exist_ok=True)
    for name in CONFIG_FILES:
        shutil.copy(model / name, config / name)
    uri = str(shards / (RANK_FILE_TEMPLATE if tp > 1 else rank_file_name(0)))
    load = TensorizerLoad(
        model_dir=str(config), tensor_parallel_size=tp, tensorizer_uri=uri, num_readers=8
    )
    rewritten = rewrite_vllm_command(["vllm", "serve"], [SERVED, *GPU_ARGS], load)
    server, figures["patchedHealthSeconds"] = serve(rewritten.args or [], work, "vllm-patched")
    try:
        started = time.monotonic()
        got = answers(server)
        figures["completionSeconds"] = time.monotonic() - started
    finally:
        server.stop()
    figures["identical"] = got == expected
    print(json.dumps(figures, sort_keys=True))
    subprocess.run(["nvidia-smi", "-L"], check=False)
    return 0 if figures["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
