"""`preshard reshard` of a Qwen2 model against vLLM itself.

vLLM's Qwen2 builds Llama's parallel layers with a bias on `qkv_proj` (cut like its weight,
query, key and value heads per rank) and takes its head size from hidden_size /
num_attention_heads whatever the config says; its config here also names a `head_dim` that is
wrong for it, so a reshard that believed the config would cut every head at the wrong place.
vLLM serializes a tiny Qwen2 at TP 1 and 2; each set resharded to the other size must be
vLLM's own file, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preshard.dataplane.checksums import CRC64NVME, digest_of_file
from preshard_devenv import engine
from preshard_devenv.s3server import S3Bucket, S3Server
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from tests.support.models import StoredSet, load_rank_files, upload_model
from tests.support.vllm_sets import reshard_set, serialize_with_vllm

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    directory = Path(tmp_path_factory.mktemp("qwen2")) / "model"
    model = make_tiny_model(directory, **engine.TINY_LLAMA, architecture="qwen2")
    config = json.loads((directory / "config.json").read_text())
    # Not what vLLM's Qwen2 uses (128 / 4 = 32): it must be ignored, as vLLM ignores it.
    config["head_dim"] = 16
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return model


@pytest.fixture(scope="module")
def sets(
    s3_server: S3Server,
    s3_bucket: S3Bucket,
    qwen2: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, StoredSet]:
    """vLLM's own sets at TP 1 and 2, and each resharded to the other size."""
    work = tmp_path_factory.mktemp("qwen2-sets")
    source = upload_model(qwen2, s3_bucket.client, s3_bucket.name, "models/qwen2")
    made = {
        f"vllm-{tp}": serialize_with_vllm(s3_server, s3_bucket, source, tp, f"qwen2-tp{tp}", work)
        for tp in (1, 2)
    }
    for source_tp, target_tp in ((1, 2), (2, 1)):
        made[f"from{source_tp}-to{target_tp}"] = reshard_set(
            s3_server,
            s3_bucket,
            made[f"vllm-{source_tp}"],
            target_tp,
            f"qwen2-from{source_tp}-to{target_tp}",
            work,
        )
    return made


@pytest.mark.parametrize(("source_tp", "target_tp"), [(1, 2), (2, 1)])
def test_resharded_qwen2_rank_files_are_vllms_own(
    sets: dict[str, StoredSet], source_tp: int, target_tp: int
) -> None:
    made, own = sets[f"from{source_tp}-to{target_tp}"], sets[f"vllm-{target_tp}"]
    assert made.checksums() == own.checksums()
    for path in made.rank_files:
        assert digest_of_file(path, CRC64NVME) == own.checksums()[path.name]


def test_the_qwen2_layout_has_the_qkv_bias_the_test_is_about(sets: dict[str, StoredSet]) -> None:
    rank0, rank1 = load_rank_files(sets["vllm-2"].rank_files)
    bias = "model.layers.0.self_attn.qkv_proj.bias"
    # TP 2 of 4 query heads and 2 KV heads of 32: 2 query, 1 key and 1 value head a rank.
    assert rank0[bias].shape == rank1[bias].shape == (128,)
    assert rank0[bias].any()
