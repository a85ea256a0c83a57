"""The artifact key: the content identity of one shard set.

Two shard sets with the same key hold the same bytes, so a second ShardedModel with the same
inputs (or a re-created one) reuses a set without a GPU. The key hashes everything that changes
the bytes: the model and revision, TP size, dtype, the serializer image (the vLLM version),
extra engine arguments, the layout version, and the encryption key's identity.

Beyond the design brief, the encryption input is the key's Secret reference with its namespace,
not only "on/off": two namespaces encrypting with different keys under one storage prefix must
not share a set they cannot both decrypt. `maxModelLen` is left out: it sizes the KV cache of
the serializing engine and does not change the weights.
"""

from __future__ import annotations

import hashlib
import json
from typing import Final

from preshard.api.models import ShardedModelSpec

# Bump when the files or manifest of a shard set change shape: old sets then get new keys.
LAYOUT_VERSION: Final = 1
KEY_LENGTH: Final = 20


def normalise_engine_args(extra: dict[str, str]) -> dict[str, str]:
    """Engine argument names with `-` and `_` spelled one way (vLLM accepts both)."""
    return {name.replace("-", "_"): value for name, value in sorted(extra.items())}


def artifact_key(
    spec: ShardedModelSpec, tensor_parallel_size: int, *, namespace: str, serializer_image: str
) -> str:
    """The key of the shard set this spec makes for one TP size (hex, lower case)."""
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
        "image": serializer_image,
        "engineArgs": normalise_engine_args(spec.serialization.extra_engine_args),
        "encryption": encryption,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return digest[:KEY_LENGTH]
