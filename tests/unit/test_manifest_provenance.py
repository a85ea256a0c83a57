"""The manifest's optional provenance: set by `preshard reshard`, absent everywhere else."""

from __future__ import annotations

import json

from preshard.dataplane.manifest import Manifest, ManifestFile, ReshardedFrom

DIGEST = "0" * 64


def manifest(**extra: object) -> Manifest:
    return Manifest.model_validate(
        {
            "artifactKey": "k2",
            "model": "org/model",
            "tensorParallelSize": 1,
            "dtype": "bfloat16",
            "vllmVersion": "0.34.0",
            "tensorizerVersion": "2.10.1",
            "encrypted": False,
            "created": "2026-12-01T00:00:00Z",
            "files": [
                ManifestFile(name="model-rank-000.tensors", size=5, sha256=DIGEST, kind="shard")
            ],
            **extra,
        }
    )


def test_a_manifest_without_provenance_is_written_as_before() -> None:
    plain = manifest()
    assert plain.resharded_from is None
    assert "reshardedFrom" not in json.loads(plain.to_json())
    assert Manifest.model_validate_json(plain.to_json()) == plain


def test_a_resharded_set_records_where_it_came_from() -> None:
    made = manifest(
        reshardedFrom=ReshardedFrom(uri="s3://b/p/k1/", artifact_key="k1", tensor_parallel_size=2)
    )
    stored = json.loads(made.to_json())
    assert stored["reshardedFrom"] == {
        "uri": "s3://b/p/k1/",
        "artifactKey": "k1",
        "tensorParallelSize": 2,
    }
    assert Manifest.model_validate_json(made.to_json()) == made
