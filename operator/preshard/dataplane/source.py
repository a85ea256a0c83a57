"""Where `preshard serialize` gets the model: a Hugging Face Hub repo or an `s3://` prefix.

Either way the model lands in a local directory on the scratch volume and the engine loads it
from there, so the engine never needs the Hub or S3 credentials, and the non-weight files
uploaded with the shards are exactly the ones the engine saw.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from preshard.contract import reasons
from preshard.contract.layout import InvalidURIError, S3Location
from preshard.dataplane.download import download_files
from preshard.dataplane.errors import DataplaneError, classify_hub_error, classify_s3_error
from preshard.dataplane.logs import heartbeat, human_bytes, logger
from preshard.dataplane.s3 import get_small_object, list_sizes
from preshard.dataplane.scratch import directory_bytes

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# File name endings of model weights in any format a model repository may carry.
WEIGHT_SUFFIXES: Final = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".h5",
    ".msgpack",
    ".onnx",
    ".onnx_data",
    ".tflite",
    ".ot",
    ".npz",
)
# Indexes of sharded weights: the engine reads them, a tensorizer shard set does not need them.
INDEX_SUFFIXES: Final = (".safetensors.index.json", ".bin.index.json")
SAFETENSORS_INDEX: Final = "model.safetensors.index.json"
# vLLM loads `*.safetensors` from the model directory's top level, else `*.bin` / `*.pt`.
_PREFERRED_WEIGHTS: Final = ((".safetensors",), (".bin", ".pt", ".pth"))
HUB_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def is_hidden(name: str) -> bool:
    """Whether any segment of a relative path starts with a dot (`.cache/`, `.gitattributes`)."""
    return any(part.startswith(".") for part in name.split("/"))


def is_weight_file(name: str) -> bool:
    """Whether a file holds weights (or indexes them) rather than config or tokenizer data."""
    lowered = name.lower()
    return lowered.endswith(WEIGHT_SUFFIXES) or lowered.endswith(INDEX_SUFFIXES)


@dataclass(frozen=True)
class SourcePlan:
    """What to fetch: the files the engine loads weights from, and the non-weight files."""

    description: str
    weights: Mapping[str, int]
    engine_files: Mapping[str, int]
    configs: Mapping[str, int]
    revision: str | None

    @property
    def downloads(self) -> dict[str, int]:
        """Every file to fetch into the local model directory, name -> size."""
        return {**self.weights, **self.engine_files, **self.configs}

    @property
    def download_bytes(self) -> int:
        """The bytes the local model directory will hold."""
        return sum(self.downloads.values())

    @property
    def weight_bytes(self) -> int:
        """The size of the weights, about the size of the shards made from them."""
        return sum(self.weights.values())


def select_files(
    listing: Mapping[str, int],
    description: str,
    revision: str | None,
    read_index: Callable[[str], bytes],
) -> SourcePlan:
    """Pick the weights vLLM would load and every non-weight file from a model's file list."""
    visible = {name: size for name, size in listing.items() if not is_hidden(name)}
    top = {name: size for name, size in visible.items() if "/" not in name}
    weights: dict[str, int] = {}
    for suffixes in _PREFERRED_WEIGHTS:
        weights = {n: s for n, s in top.items() if n.lower().endswith(suffixes)}
        if weights:
            break
    if not weights:
        raise DataplaneError(
            reasons.MODEL_NOT_FOUND,
            f"{description} has no weights (*.safetensors or *.bin) at its top level",
        )
    engine_files = {n: s for n, s in top.items() if n.lower().endswith(INDEX_SUFFIXES)}
    if SAFETENSORS_INDEX in engine_files and all(n.endswith(".safetensors") for n in weights):
        # Repositories like Mistral's carry a consolidated copy beside the indexed files;
        # vLLM loads only what the index names, so only that is fetched.
        indexed = _indexed_files(read_index(SAFETENSORS_INDEX), description)
        if indexed and indexed <= weights.keys():
            weights = {n: s for n, s in weights.items() if n in indexed}
    configs = {n: s for n, s in visible.items() if not is_weight_file(n)}
    if "config.json" not in configs:
        raise DataplaneError(reasons.MODEL_NOT_FOUND, f"{description} has no config.json")
    return SourcePlan(description, weights, engine_files, configs, revision)


def _indexed_files(raw: bytes, description: str) -> set[str]:
    try:
        index = json.loads(raw)
        return {str(name) for name in index["weight_map"].values()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataplaneError(
            reasons.MODEL_NOT_FOUND, f"{description} has an unreadable {SAFETENSORS_INDEX}"
        ) from exc


class ModelSource(Protocol):
    """A place the model's files come from."""

    def plan(self) -> SourcePlan:
        """List the model's files and pick the ones to fetch."""
        ...

    def fetch(self, plan: SourcePlan, directory: Path) -> None:
        """Fetch the planned files into `directory`."""
        ...


@dataclass
class S3ModelSource:
    """Safetensors plus config and tokenizer files under an `s3://` prefix."""

    client: S3Client
    location: S3Location
    revision: str | None
    concurrency: int

    def plan(self) -> SourcePlan:
        """List the prefix once and pick the files."""
        listing = list_sizes(self.client, self.location)
        if not listing:
            raise DataplaneError(
                reasons.MODEL_NOT_FOUND, f"there are no objects under {self.location.uri}"
            )

        def read_index(name: str) -> bytes:
            body = get_small_object(self.client, self.location, name)
            if body is None:
                raise DataplaneError(reasons.MODEL_NOT_FOUND, f"{name} vanished from the source")
            return body

        return select_files(listing, self.location.uri, self.revision, read_index)

    def fetch(self, plan: SourcePlan, directory: Path) -> None:
        """Parallel ranged GETs of every planned file."""
        try:
            download_files(
                self.client, self.location, plan.downloads, directory, concurrency=self.concurrency
            )
        except DataplaneError:
            raise
        except Exception as exc:
            raise classify_s3_error(exc, f"downloading {self.location.uri}") from exc


@dataclass
class HubModelSource:
    """A Hugging Face Hub repository at a revision (`HF_TOKEN` for private or gated ones)."""

    repo_id: str
    revision: str | None
    concurrency: int

    def plan(self) -> SourcePlan:
        """Read the repository's file list with sizes and pin the revision to its commit."""
        from huggingface_hub import HfApi, hf_hub_download  # noqa: PLC0415 - data-plane only

        try:
            info = HfApi().model_info(self.repo_id, revision=self.revision, files_metadata=True)
        except Exception as exc:
            raise classify_hub_error(exc, self.repo_id) from exc
        listing = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        commit = info.sha or self.revision

        def read_index(name: str) -> bytes:
            try:
                path = hf_hub_download(self.repo_id, name, revision=commit)
            except Exception as exc:
                raise classify_hub_error(exc, self.repo_id) from exc
            return Path(path).read_bytes()

        description = f"{self.repo_id}@{commit}" if commit else self.repo_id
        return select_files(listing, description, commit, read_index)

    def fetch(self, plan: SourcePlan, directory: Path) -> None:
        """Download the planned files of the pinned commit into `directory`."""
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - data-plane only
        from huggingface_hub.utils.tqdm import disable_progress_bars  # noqa: PLC0415

        disable_progress_bars()
        logger().info(
            "downloading %d files (%s) of %s from the Hugging Face Hub",
            len(plan.downloads),
            human_bytes(plan.download_bytes),
            plan.description,
        )
        try:
            with heartbeat(
                lambda: (
                    f"download: {human_bytes(directory_bytes(directory))} of "
                    f"{human_bytes(plan.download_bytes)}"
                )
            ):
                snapshot_download(
                    self.repo_id,
                    revision=plan.revision,
                    local_dir=directory,
                    allow_patterns=sorted(plan.downloads),
                    max_workers=self.concurrency,
                )
        except Exception as exc:
            raise classify_hub_error(exc, self.repo_id) from exc


def open_source(
    model: str,
    revision: str | None,
    *,
    client: Callable[[], S3Client],
    concurrency: int,
) -> ModelSource:
    """The source for `--model`: an `s3://` prefix, else a Hub repository id."""
    if model.startswith("s3://"):
        try:
            location = S3Location.parse(model)
        except InvalidURIError as exc:
            raise DataplaneError(reasons.INVALID_ARGUMENTS, f"--model: {exc}") from exc
        return S3ModelSource(client(), location, revision, concurrency)
    if not HUB_ID_PATTERN.match(model):
        raise DataplaneError(
            reasons.INVALID_ARGUMENTS,
            f"--model {model!r} is neither an s3:// prefix nor a Hugging Face repository id",
        )
    return HubModelSource(model, revision, concurrency)
