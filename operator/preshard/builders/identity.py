"""The artifact key: the content identity of one shard set.

Two shard sets with the same key hold the same bytes, so a second ShardedModel with the same
inputs (or a re-created one) reuses a set without a GPU. The key hashes everything that changes
the bytes: the model and revision, TP size, dtype, the serializer (the vLLM version, which pins
the tensorizer version), extra engine arguments, the layout version, and the encryption key's
identity; and nothing else, so that a new preshard release re-serializes nothing.

preshard's own serializer image is keyed on the vLLM version it is built on (a setting that
follows the image's `FROM`), not on its reference, whose tag is preshard's version: an operator
upgrade on the same vLLM keeps every key. A user's `serialization.image` is keyed on its
reference, as preshard cannot know what is inside it.

Beyond the design brief, the encryption input is the key's Secret reference with its namespace,
not only "on/off": two namespaces encrypting with different keys under one storage prefix must
not share a set they cannot both decrypt. `maxModelLen` is left out: it sizes the KV cache of
the serializing engine and does not change the weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Final

from preshard.api.models import ShardedModelSpec
from preshard.settings import Settings

# Bump when the files or manifest of a shard set change shape: old sets then get new keys.
LAYOUT_VERSION: Final = 1
KEY_LENGTH: Final = 20
# A vLLM version as its images' tags and `vllm.__version__` spell it: `v0.34.0`, `0.34.0`,
# `0.10.1.1`, `0.11.0rc1`, `0.4.0.post1`; what follows `+`, `-` or `_` is a build of the same
# release (`0.32.0+cpu`, `v0.9.0-cu128`).
_VLLM_VERSION: Final = re.compile(
    r"^v?(\d+\.\d+\.\d+(?:\.\d+)*(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?)(?:[-_+].*)?$",
    re.IGNORECASE,
)


def normalise_engine_args(extra: dict[str, str]) -> dict[str, str]:
    """Engine argument names with `-` and `_` spelled one way (vLLM accepts both)."""
    return {name.replace("-", "_"): value for name, value in sorted(extra.items())}


def vllm_release(version: str | None) -> str | None:
    """The vLLM release a version string or image tag names, without its build suffix; None
    when it names none (`latest`, `nightly`, a date).

    Two builds of one release (`+cu126`, `+cpu`, `-cu128`) run the same Python code, which lays
    out the weights, so they write and read the same shards; any other difference, a patch or
    a release candidate included, may change a model's parameters and counts as another vLLM.
    """
    match = _VLLM_VERSION.match((version or "").strip())
    return match.group(1).lower() if match else None


def image_tag(image: str) -> str | None:
    """The tag of an image reference (`vllm/vllm-openai:v0.34.0@sha256:…` → `v0.34.0`)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def serializer_vllm_version(spec: ShardedModelSpec, settings: Settings) -> str | None:
    """The vLLM release the spec's serializer image writes with, as far as its reference says:
    the setting for preshard's own image, the tag of a user's image (None when it names no
    release)."""
    if spec.serialization.image:
        tag = image_tag(spec.serialization.image)
        return vllm_release(tag) if tag else None
    return vllm_release(settings.serializer_vllm_version)


def shard_set_key(
    spec: ShardedModelSpec, tensor_parallel_size: int, *, namespace: str, settings: Settings
) -> str:
    """The key the operator (and `preshard render`) give the spec's set for one TP size."""
    own = spec.serialization.image
    return artifact_key(
        spec,
        tensor_parallel_size,
        namespace=namespace,
        serializer_image=own or settings.serializer_image,
        serializer_vllm_version=None if own else settings.serializer_vllm_version,
    )


def artifact_key(
    spec: ShardedModelSpec,
    tensor_parallel_size: int,
    *,
    namespace: str,
    serializer_image: str,
    serializer_vllm_version: str | None = None,
) -> str:
    """The key of the shard set this spec makes for one TP size (hex, lower case).

    With `serializer_vllm_version` (preshard's own image, whose vLLM is known) the key names
    that release instead of the image's reference; without, the reference itself.
    """
    encryption = (
        {
            "namespace": namespace,
            "secret": spec.encryption.secret_ref.name,
            "key": spec.encryption.secret_ref.key,
        }
        if spec.encryption
        else None
    )
    identity = {
        "layout": LAYOUT_VERSION,
        "model": spec.model.name,
        "revision": spec.model.revision,
        "tensorParallelSize": tensor_parallel_size,
        "dtype": spec.serialization.dtype,
        "engineArgs": normalise_engine_args(spec.serialization.extra_engine_args),
        "encryption": encryption,
    }
    if serializer_vllm_version is None:
        identity["image"] = serializer_image
    else:
        release = vllm_release(serializer_vllm_version)
        identity["serializerVllm"] = release or serializer_vllm_version
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return digest[:KEY_LENGTH]
