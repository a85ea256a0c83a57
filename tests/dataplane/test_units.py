"""Pure parts of the data plane: file selection, part sizes, argument and error mapping."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest

from preshard.cli import main
from preshard.contract import reasons
from preshard.contract.engine_args import RESERVED_ENGINE_ARGS
from preshard.contract.outcome import Outcome, exit_code
from preshard.dataplane.checksums import CRC64NVME, combine, crc64nvme, digest_of_bytes, s3_header
from preshard.dataplane.cli import parse_size
from preshard.dataplane.engine import (
    EngineRequest,
    load_engine,
    parse_engine_args,
)
from preshard.dataplane.errors import DataplaneError, classify_s3_error, is_transient
from preshard.dataplane.logs import redact
from preshard.dataplane.s3 import RetryPolicy
from preshard.dataplane.scratch import ScratchEstimate, check_room
from preshard.dataplane.source import select_files
from preshard.dataplane.upload import MAX_PARTS, MIB, part_size_for
from preshard.dataplane.vllm_engine import build_engine_kwargs, build_tensorizer_kwargs
from preshard.dataplane.vllm_worker import EXTENSION_QUALNAME
from preshard_devenv import cpuengine


def _no_index(name: str) -> bytes:
    raise AssertionError(f"{name} should not be read")


def test_select_files_prefers_safetensors_and_keeps_every_non_weight_file() -> None:
    listing = {
        "model.safetensors": 100,
        "pytorch_model.bin": 100,
        "config.json": 1,
        "tokenizer.model": 2,
        "chat_template.jinja": 3,
        "original/params.json": 4,
        "original/consolidated.00.pth": 50,
        ".gitattributes": 5,
        ".cache/huggingface/x.lock": 0,
    }

    plan = select_files(listing, "m", None, _no_index)

    assert plan.weights == {"model.safetensors": 100}
    assert plan.configs == {
        "config.json": 1,
        "tokenizer.model": 2,
        "chat_template.jinja": 3,
        "original/params.json": 4,
    }
    assert plan.download_bytes == 110
    assert plan.weight_bytes == 100


def test_select_files_follows_the_safetensors_index() -> None:
    listing = {
        "consolidated.safetensors": 200,
        "model-00001-of-00002.safetensors": 100,
        "model-00002-of-00002.safetensors": 100,
        "model.safetensors.index.json": 1,
        "config.json": 1,
    }
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }

    plan = select_files(listing, "m", None, lambda name: json.dumps(index).encode())

    assert sorted(plan.weights) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert plan.engine_files == {"model.safetensors.index.json": 1}
    assert "model.safetensors.index.json" not in plan.configs


def test_select_files_falls_back_to_bin_weights() -> None:
    plan = select_files({"pytorch_model.bin": 10, "config.json": 1}, "m", "abc", _no_index)

    assert plan.weights == {"pytorch_model.bin": 10}
    assert plan.revision == "abc"


@pytest.mark.parametrize(
    ("listing", "words"),
    [
        ({"config.json": 1, "sub/model.safetensors": 5}, "has no weights"),
        ({"model.safetensors": 5, "tokenizer.json": 1}, "has no config.json"),
    ],
)
def test_select_files_refuses_what_is_not_a_model(listing: dict[str, int], words: str) -> None:
    with pytest.raises(DataplaneError) as caught:
        select_files(listing, "m", None, _no_index)

    assert caught.value.reason == reasons.MODEL_NOT_FOUND
    assert words in caught.value.message


def test_part_size_grows_only_past_ten_thousand_parts() -> None:
    assert part_size_for(10 * MIB, 32 * MIB) == 32 * MIB
    huge = 1 << 40
    size = part_size_for(huge, 32 * MIB)
    assert size % MIB == 0
    assert -(-huge // size) <= MAX_PARTS


def test_crc64nvme_and_its_header_are_s3s() -> None:
    assert crc64nvme(b"123456789") == 0xAE8B14860A799888
    assert s3_header(crc64nvme(b"hello")) == "M3eFcAZSQlc="


def test_parts_checksums_combine_into_the_whole_files() -> None:
    data = bytes(range(256)) * 5000 + b"tail"
    cuts = [0, 1, 70_000, 70_001, 900_000, len(data)]
    parts = [(crc64nvme(data[a:b]), b - a) for a, b in itertools.pairwise(cuts)]
    assert combine(parts) == digest_of_bytes(data, CRC64NVME)
    assert combine(parts[::-1]) != digest_of_bytes(data, CRC64NVME)


def test_retry_delays_grow_and_stay_bounded() -> None:
    policy = RetryPolicy(attempts=6, base_delay_s=0.5, max_delay_s=4.0)

    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 4.0)]:
        assert ceiling / 2 <= policy.delay(attempt) <= ceiling


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "GetObject")


@pytest.mark.parametrize(
    ("error", "reason", "transient"),
    [
        (_client_error("AccessDenied", 403), reasons.ACCESS_DENIED, False),
        (_client_error("SignatureDoesNotMatch", 403), reasons.ACCESS_DENIED, False),
        (_client_error("InvalidAccessKeyId", 403), reasons.ACCESS_DENIED, False),
        (_client_error("403", 403), reasons.ACCESS_DENIED, False),
        (_client_error("NoSuchBucket", 404), reasons.BUCKET_NOT_FOUND, False),
        (_client_error("SlowDown", 503), reasons.UNREACHABLE, True),
        (_client_error("BadDigest", 400), reasons.UNREACHABLE, True),
        (_client_error("InvalidPart", 400), reasons.INTERNAL_ERROR, False),
        (
            botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"),
            reasons.UNREACHABLE,
            True,
        ),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), reasons.UNREACHABLE, True),
        (botocore.exceptions.NoCredentialsError(), reasons.ACCESS_DENIED, False),
    ],
)
def test_s3_errors_map_to_reasons(error: Exception, reason: str, transient: bool) -> None:
    assert classify_s3_error(error, "testing").reason == reason
    assert is_transient(error) is transient


def test_engine_args_accept_plain_values() -> None:
    parsed = parse_engine_args(
        '{"quantization": "fp8", "enforce_eager": false, "x": [1, "a", null]}'
    )

    assert parsed == {"quantization": "fp8", "enforce_eager": False, "x": [1, "a", None]}
    assert parse_engine_args(None) == {}


@pytest.mark.parametrize("reserved", sorted(RESERVED_ENGINE_ARGS))
def test_every_reserved_engine_arg_is_refused(reserved: str) -> None:
    with pytest.raises(DataplaneError) as caught:
        parse_engine_args(json.dumps({reserved: 1}))

    assert caught.value.reason == reasons.INVALID_ARGUMENTS


def _request(tmp_path: Path, **changes: object) -> EngineRequest:
    fields: dict[str, object] = {
        "model": str(tmp_path / "model"),
        "revision": None,
        "tensor_parallel_size": 4,
        "dtype": "bfloat16",
        "max_model_len": None,
        "output_dir": tmp_path / "shards",
        "extra_engine_args": {"quantization": "fp8", "enforce_eager": False},
    }
    return EngineRequest(**(fields | changes))  # type: ignore[arg-type]


def test_engine_kwargs(tmp_path: Path) -> None:
    kwargs = build_engine_kwargs(_request(tmp_path, max_model_len=4096))

    assert kwargs == {
        "model": str(tmp_path / "model"),
        "revision": None,
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "quantization": "fp8",
        "enforce_eager": False,
        "worker_extension_cls": EXTENSION_QUALNAME,
    }
    assert build_engine_kwargs(_request(tmp_path, extra_engine_args={}))["enforce_eager"] is True
    assert "max_model_len" not in build_engine_kwargs(_request(tmp_path))


def test_tensorizer_kwargs(tmp_path: Path) -> None:
    plain = build_tensorizer_kwargs(_request(tmp_path))
    keyed = build_tensorizer_kwargs(_request(tmp_path, encryption_keyfile=tmp_path / "key"))

    assert plain == {"tensorizer_uri": str(tmp_path / "shards" / "model-rank-%03d.tensors")}
    assert keyed == plain | {"encryption_keyfile": str(tmp_path / "key")}


def test_load_engine_by_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRESHARD_ENGINE", cpuengine.SPEC)

    assert isinstance(load_engine(), cpuengine.CpuTestEngine)
    with pytest.raises(DataplaneError):
        load_engine("preshard_devenv.cpuengine")
    with pytest.raises(DataplaneError):
        load_engine("preshard_devenv.cpuengine:NoSuchEngine")


def test_scratch_limit_counts_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "old").write_bytes(b"x" * 600_000)
    estimate = ScratchEstimate(source_bytes=300_000, shard_bytes=300_000, reusable_bytes=100_000)

    check_room(tmp_path, estimate, size_limit=1_200_000)
    with pytest.raises(DataplaneError) as caught:
        check_room(tmp_path, estimate, size_limit=1_000_000)

    assert caught.value.reason == reasons.INSUFFICIENT_SCRATCH
    assert "needs about 488.28 KiB" in caught.value.message


def test_redact_hides_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-123")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijk")

    assert redact("a s3cr3t-value-123 b hf_abcdefghijk") == "a *** b ***"


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (
            "serialize",
            ["HF_TOKEN", "AWS_ENDPOINT_URL_S3", "30  InsufficientScratch", "--scratch-dir"],
        ),
        ("verify", ["AWS_SECRET_ACCESS_KEY", "14  TPMismatch", "13  HashMismatch", "--deep"]),
        ("fetch-config", ["checksum", "11  ShardMissing", "20  AccessDenied"]),
        ("delete", ["s3://b/p/key2/", "21  Unreachable"]),
    ],
)
def test_help_explains_environment_and_exit_codes(
    command: str, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])

    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "exit codes:" in text
    for word in words:
        assert word in text


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("67108864", 67108864),
        ("32Mi", 32 << 20),
        ("200G", 200 * 10**9),
        ("1.5Ti", 3 << 39),
        ("1k", 1000),
        # What the CRD accepts for scratchSize is read too.
        ("1e11", 10**11),
        ("+100Gi", 100 << 30),
        (".5Ti", 1 << 39),
        ("1.G", 10**9),
        ("1E3", 1000),
    ],
)
def test_sizes_are_kubernetes_quantities(text: str, size: int) -> None:
    assert parse_size(text, "--part-size") == size


@pytest.mark.parametrize("text", ["", "12 MB", "1m", "-5", "Mi", "0", "1e1.5", "1K"])
def test_other_sizes_are_refused(text: str) -> None:
    with pytest.raises(DataplaneError) as caught:
        parse_size(text, "--part-size")

    assert caught.value.reason == reasons.INVALID_ARGUMENTS


def test_an_unknown_flag_still_ends_with_an_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PRESHARD_TERMINATION_LOG", str(log))
    code = main(["verify", "s3://bucket/set/", "--tensor-parallel-size", "2", "--no-such-flag"])
    assert code == exit_code(reasons.INVALID_ARGUMENTS)
    outcome = Outcome.from_message(log.read_text())
    assert outcome is not None
    assert (outcome.command, outcome.reason) == ("verify", reasons.INVALID_ARGUMENTS)
    assert "--no-such-flag" in outcome.message
    assert capsys.readouterr().out.strip() == log.read_text()
