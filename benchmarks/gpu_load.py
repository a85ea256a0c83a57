"""Loading one rank's shard into GPU memory: tensorizer's readers against the copy ceiling.

One tensorizer file the size of one tensor-parallel rank of a large model (16 GB by default:
Llama-70B layer shapes split eight ways, bf16, with as many layers as fit the size), and the
same tensors as a `.safetensors` file, are written to local disk and read once, so that every
load below reads from the page cache, not the disk. Then, each timed best of `--repeats`:

- `TensorDeserializer(device=..., num_readers=k)` for each k of `--readers`;
- `safetensors.torch.load_file(device=...)`;
- one page-cache read of the tensorizer file into host memory (one thread);
- the host-to-device ceiling: a pinned host buffer of the same number of bytes copied with
  `.to(device, non_blocking=True)` (on `--device cpu`: an ordinary CPU-to-CPU copy).

Each prints GB/s (10^9 bytes per second) and its ratio to the ceiling. Without a CUDA device
the script says so and exits 0, unless `--device cpu` asks for the CPU path, which runs the
same code (the smoke test uses it with a tiny size).

    python benchmarks/gpu_load.py [--size-gb 16] [--readers 1,2,4,8,16] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save_file
from tensorizer import TensorDeserializer, TensorSerializer

if __package__ in (None, ""):
    # Run as a script (`python benchmarks/gpu_load.py`): make the repository importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common

NAME: Final = "gpu_load"
DTYPE: Final = torch.bfloat16
SCRATCH: Final = common.ROOT / "benchmarks" / "scratch" / NAME
READ_CHUNK: Final = 64 * 1024 * 1024


@dataclass(frozen=True)
class Shape:
    """One rank's share of a Llama-style decoder (column- and row-parallel splits)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def layer(self, index: int) -> dict[str, tuple[int, ...]]:
        """The tensors of one decoder layer."""
        prefix = f"model.layers.{index}"
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return {
            f"{prefix}.input_layernorm.weight": (self.hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q, self.hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv, self.hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv, self.hidden),
            f"{prefix}.self_attn.o_proj.weight": (self.hidden, q),
            f"{prefix}.post_attention_layernorm.weight": (self.hidden,),
            f"{prefix}.mlp.gate_proj.weight": (self.intermediate, self.hidden),
            f"{prefix}.mlp.up_proj.weight": (self.intermediate, self.hidden),
            f"{prefix}.mlp.down_proj.weight": (self.hidden, self.intermediate),
        }

    def outside_layers(self) -> dict[str, tuple[int, ...]]:
        """Embedding, final norm and LM head."""
        return {
            "model.embed_tokens.weight": (self.vocab, self.hidden),
            "model.norm.weight": (self.hidden,),
            "lm_head.weight": (self.vocab, self.hidden),
        }

    def halved(self) -> Shape:
        """The same architecture at half the width."""
        return Shape(
            hidden=max(self.hidden // 2, 8),
            intermediate=max(self.intermediate // 2, 8),
            heads=max(self.heads // 2, 1),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab=max(self.vocab // 2, 8),
        )


# Llama-3-70B (hidden 8192, MLP 28672, 64 query and 8 KV heads of 128, vocabulary 128256) as
# tensor-parallel rank 0 of 8 holds it: the weights of a 16 GB rank file.
RANK_OF_70B: Final = Shape(
    hidden=8192, intermediate=28672 // 8, heads=64 // 8, kv_heads=1, head_dim=128, vocab=128256 // 8
)


def nbytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of these tensors in bf16."""
    total = 0
    for shape in shapes.values():
        elements = 1
        for dim in shape:
            elements *= dim
        total += elements * DTYPE.itemsize
    return total


def plan_tensors(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes that add up to about `size_bytes`: as many full layers as fit.

    Sizes too small for two layers of the real width get a narrower model of the same shape.
    """
    shape = RANK_OF_70B
    while nbytes(shape.layer(0)) * 2 + nbytes(shape.outside_layers()) > size_bytes and (
        shape.hidden > 8
    ):
        shape = shape.halved()
    per_layer = nbytes(shape.layer(0))
    layers = max(1, (size_bytes - nbytes(shape.outside_layers())) // per_layer)
    tensors = dict(shape.outside_layers())
    for index in range(layers):
        tensors.update(shape.layer(index))
    return tensors


def make_tensors(shapes: dict[str, tuple[int, ...]], device: str) -> dict[str, torch.Tensor]:
    """Random bf16 tensors in host memory (drawn on the device when it is a GPU: faster)."""
    generator_device = device if device.startswith("cuda") else "cpu"
    tensors = {}
    for name, shape in shapes.items():
        values = torch.empty(shape, dtype=DTYPE, device=generator_device).normal_(std=0.02)
        tensors[name] = values.cpu()
    return tensors


def write_files(tensors: dict[str, torch.Tensor], directory: Path) -> dict[str, Any]:
    """The tensorizer and safetensors files; returns their paths, sizes and write times."""
    directory.mkdir(parents=True, exist_ok=True)
    tensorized = directory / "model.tensors"
    safetensors = directory / "model.safetensors"
    watch = common.Stopwatch()
    serializer = TensorSerializer(str(tensorized))
    serializer.write_state_dict(tensors)
    serializer.close()
    tensorizer_s = watch.elapsed
    watch.restart()
    save_file(tensors, str(safetensors))
    safetensors_s = watch.elapsed
    return {
        "tensorizer": {
            "path": tensorized,
            "bytes": tensorized.stat().st_size,
            "write_s": round(tensorizer_s, 2),
        },
        "safetensors": {
            "path": safetensors,
            "bytes": safetensors.stat().st_size,
            "write_s": round(safetensors_s, 2),
        },
    }


def read_through(path: Path) -> int:
    """Read a whole file into one reused buffer (to fill the page cache); returns its bytes."""
    view = memoryview(bytearray(max(1, min(READ_CHUNK, path.stat().st_size))))
    total = 0
    with path.open("rb", buffering=0) as file:
        while True:
            count = file.readinto(view)
            if not count:
                return total
            total += count


class Loads:
    """Timed loads onto one device, each waiting for the device and freeing what it loaded."""

    def __init__(self, device: str, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        """Wait for every queued device operation."""
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        """Give cached device memory back between runs."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def best(self, load: Callable[[], object]) -> float:
        """The best of `repeats` timed loads; what each loaded is freed, untimed, after it."""
        times = []
        for _ in range(self.repeats):
            self.sync()
            watch = common.Stopwatch()
            loaded = load()
            self.sync()
            times.append(watch.elapsed)
            del loaded
            self.free()
        return min(times)

    def tensorizer(self, path: Path, readers: int) -> float:
        """`TensorDeserializer` with `num_readers=readers`, every tensor loaded at once."""

        def load() -> object:
            deserializer = TensorDeserializer(
                str(path), device=self.device, num_readers=readers, lazy_load=False
            )
            self.sync()
            deserializer.close()
            return deserializer

        return self.best(load)

    def safetensors(self, path: Path) -> float:
        """`safetensors.torch.load_file` straight to the device."""

        return self.best(lambda: load_file(str(path), device=self.device))

    def ceiling(self, size: int) -> float:
        """One pinned host buffer of `size` bytes copied to the device (CPU: a plain copy)."""
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        host.fill_(1)
        if self.cuda:
            return self.best(lambda: host.to(self.device, non_blocking=True))
        # Touched once first, so the timed copies do not fault its pages in.
        target = torch.zeros_like(host)
        return self.best(lambda: target.copy_(host))


def device_info(device: str) -> dict[str, Any]:
    """The device and the software that drives it."""
    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "tensorizer": _version("tensorizer"),
        "safetensors": _version("safetensors"),
    }
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(device)
        info |= {
            "name": torch.cuda.get_device_name(device),
            "memory_gib": round(properties.total_memory / 1024**3, 1),
            "cuda_runtime": torch.version.cuda,
            "driver": _driver_version(),
        }
    else:
        info["name"] = "cpu"
    return info


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_load.py",
        description="Load one rank-sized tensorizer file into GPU memory; compare with the "
        "host-to-device copy ceiling and with safetensors.",
    )
    parser.add_argument(
        "--size-gb", type=float, default=16.0, help="file size in GB (default: %(default)s)"
    )
    parser.add_argument(
        "--readers",
        default="1,2,4,8,16",
        type=lambda text: [int(part) for part in text.split(",") if part.strip()],
        help="tensorizer num_readers values, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for the smoke path")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per load; the best counts (default: 3)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=SCRATCH,
        help="where the files are written, on local disk (default: benchmarks/scratch/gpu_load)",
    )
    parser.add_argument(
        "--keep-files", action="store_true", help="leave the written files in --dir"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=common.RESULTS_DIR / f"{NAME}.json",
        help="result file (default: benchmarks/results/gpu_load.json)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the files, time every load, print the table and write the result file."""
    args = parse_args(argv)
    device: str = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device (use --device cpu for the CPU path)")
        return 0
    started = common.utc_now()
    size = int(args.size_gb * common.GB)
    shapes = plan_tensors(size)
    directory: Path = args.dir
    print(f"writing {len(shapes)} tensors, about {args.size_gb:g} GB each file, to {directory}")
    tensors = make_tensors(shapes, device)
    written = write_files(tensors, directory)
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    del tensors
    loads = Loads(device, args.repeats)
    # The tensors drawn on the device stay in its allocator's cache until freed.
    loads.free()
    try:
        # Every load below reads the files from the page cache, none from the disk.
        for entry in written.values():
            read_through(entry["path"])
        ceiling_s = loads.ceiling(tensor_bytes)
        timings: list[tuple[str, float, int]] = [
            ("host-to-device copy (ceiling)" if loads.cuda else "CPU copy (ceiling)", ceiling_s, 0)
        ]
        tensorized: Path = written["tensorizer"]["path"]
        timings.append(
            (
                "page-cache read, 1 thread",
                common.best_of(args.repeats, lambda: read_through(tensorized)),
                0,
            )
        )
        for readers in args.readers:
            print(f"tensorizer num_readers={readers}", flush=True)
            timings.append(
                (
                    f"tensorizer num_readers={readers}",
                    loads.tensorizer(tensorized, readers),
                    readers,
                )
            )
        print("safetensors", flush=True)
        timings.append(
            ("safetensors load_file", loads.safetensors(written["safetensors"]["path"]), 0)
        )
    finally:
        if not args.keep_files:
            for entry in written.values():
                entry["path"].unlink(missing_ok=True)
    ceiling_gbps = tensor_bytes / ceiling_s / common.GB
    rows = []
    for label, seconds, readers in timings:
        gbps = tensor_bytes / seconds / common.GB
        rows.append(
            {
                "load": label,
                "num_readers": readers or None,
                "seconds": round(seconds, 4),
                "gb_per_s": round(gbps, 3),
                "ratio_to_ceiling": round(gbps / ceiling_gbps, 3),
            }
        )
    common.print_table(
        f"Loading {tensor_bytes / common.GB:.2f} GB onto {device} from the page cache "
        f"(best of {args.repeats})",
        ["load", "seconds", "GB/s", "ratio to ceiling"],
        [[r["load"], r["seconds"], r["gb_per_s"], r["ratio_to_ceiling"]] for r in rows],
    )
    path = common.write_result(
        NAME,
        {
            "device": device_info(device),
            "tensor_bytes": tensor_bytes,
            "tensors": len(shapes),
            "files": {
                kind: {"bytes": entry["bytes"], "write_s": entry["write_s"]}
                for kind, entry in written.items()
            },
            "source": "page cache (each file read once before the timed loads)",
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "loads": rows,
        },
        path=args.output,
        started=started,
    )
    print(f"\nresults written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
