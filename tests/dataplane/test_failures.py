"""Incomplete sets, bad input and bad credentials: each ends with its own reason and exit code."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from preshard.contract import reasons
from preshard.contract.outcome import exit_code
from preshard_devenv import procs
from preshard_devenv.s3server import S3Bucket
from tests.dataplane.conftest import Cli, copy_set, serialize_args

pytestmark = pytest.mark.s3


@pytest.fixture
def copied(s3_bucket: S3Bucket, stored_set: str, prefix: str) -> str:
    """A private copy of the shared TP-2 set, free to damage; returns its prefix."""
    copy_set(s3_bucket, stored_set, f"{prefix}/set")
    return f"{prefix}/set"


def _verify(
    run_cli: Cli, bucket: S3Bucket, prefix: str, *extra: str, tp: int = 2
) -> tuple[int, str, str]:
    result = run_cli(
        "verify", f"s3://{bucket.name}/{prefix}/", "--tensor-parallel-size", str(tp), *extra
    )
    assert result.code == exit_code(result.outcome.reason)
    assert result.outcome.ok is (result.code == 0)
    return result.code, result.outcome.reason, result.outcome.message


def test_verify_without_manifest(run_cli: Cli, s3_bucket: S3Bucket, prefix: str) -> None:
    s3_bucket.client.put_object(
        Bucket=s3_bucket.name, Key=f"{prefix}/model-rank-000.tensors", Body=b"x"
    )

    code, reason, message = _verify(run_cli, s3_bucket, prefix)

    assert (code, reason) == (10, reasons.MANIFEST_MISSING)
    assert "manifest.json" in message


def test_verify_rejects_a_malformed_manifest(
    run_cli: Cli, s3_bucket: S3Bucket, copied: str
) -> None:
    s3_bucket.client.put_object(
        Bucket=s3_bucket.name, Key=f"{copied}/manifest.json", Body=json.dumps({"formatVersion": 1})
    )

    code, reason, message = _verify(run_cli, s3_bucket, copied)

    assert (code, reason) == (15, reasons.MANIFEST_INVALID)
    assert "artifactKey" in message


def test_verify_for_another_tp_size(run_cli: Cli, s3_bucket: S3Bucket, stored_set: str) -> None:
    code, reason, message = _verify(run_cli, s3_bucket, stored_set, tp=4)

    assert (code, reason) == (14, reasons.TP_MISMATCH)
    assert "size 2, not 4" in message


def test_verify_for_another_artifact_key(
    run_cli: Cli, s3_bucket: S3Bucket, stored_set: str
) -> None:
    code, reason, message = _verify(run_cli, s3_bucket, stored_set, "--artifact-key", "other")

    assert (code, reason) == (15, reasons.MANIFEST_INVALID)
    assert "other" in message


def test_verify_names_a_removed_rank_file(run_cli: Cli, s3_bucket: S3Bucket, copied: str) -> None:
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=f"{copied}/model-rank-001.tensors")

    code, reason, message = _verify(run_cli, s3_bucket, copied)

    assert (code, reason) == (11, reasons.SHARD_MISSING)
    assert "model-rank-001.tensors" in message


def test_verify_names_a_truncated_rank_file(run_cli: Cli, s3_bucket: S3Bucket, copied: str) -> None:
    key = f"{copied}/model-rank-000.tensors"
    data = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read()
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=data[:1000])

    code, reason, message = _verify(run_cli, s3_bucket, copied)

    assert (code, reason) == (12, reasons.SIZE_MISMATCH)
    assert f"model-rank-000.tensors (expected {len(data)} bytes, found 1000)" in message


def test_deep_verify_finds_changed_bytes(run_cli: Cli, s3_bucket: S3Bucket, copied: str) -> None:
    key = f"{copied}/model-rank-001.tensors"
    data = bytearray(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))

    assert _verify(run_cli, s3_bucket, copied)[0] == 0
    code, reason, message = _verify(run_cli, s3_bucket, copied, "--deep")

    assert (code, reason) == (13, reasons.HASH_MISMATCH)
    assert "model-rank-001.tensors" in message


def test_fetch_config_refuses_an_incomplete_set(
    run_cli: Cli, s3_bucket: S3Bucket, copied: str, tmp_path: Path
) -> None:
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=f"{copied}/model-rank-000.tensors")

    result = run_cli("fetch-config", f"s3://{s3_bucket.name}/{copied}/", str(tmp_path / "dir"))

    assert (result.code, result.outcome.reason) == (11, reasons.SHARD_MISSING)
    assert not (tmp_path / "dir").exists()


def test_fetch_config_checks_hashes(
    run_cli: Cli, s3_bucket: S3Bucket, copied: str, tmp_path: Path
) -> None:
    key = f"{copied}/config.json"
    data = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read()
    s3_bucket.client.put_object(
        Bucket=s3_bucket.name, Key=key, Body=data.replace(b"llama", b"LLAMA")
    )

    result = run_cli("fetch-config", f"s3://{s3_bucket.name}/{copied}/", str(tmp_path / "dir"))

    assert (result.code, result.outcome.reason) == (13, reasons.HASH_MISMATCH)
    assert not (tmp_path / "dir" / "config.json").exists()


def test_wrong_secret_is_access_denied_and_never_printed(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    stored_set: str,
    model_uri: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wrong = "wrong-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    folder, key = stored_set.split("/")

    for argv in (
        ("verify", f"s3://{s3_bucket.name}/{stored_set}/", "--tensor-parallel-size", "2"),
        ("delete", f"s3://{s3_bucket.name}/{stored_set}/"),
        tuple(serialize_args(model_uri, s3_bucket, folder, key, tmp_path / "scratch", tp=2)),
    ):
        result = run_cli(*argv)
        assert (result.code, result.outcome.reason) == (20, reasons.ACCESS_DENIED), result.stderr
        assert "SignatureDoesNotMatch" in result.outcome.message
        termination = result.outcome.to_message()
        for text in (result.stdout, result.stderr, termination):
            assert wrong not in text
    assert s3_bucket.keys(f"{stored_set}/manifest.json")


def test_unknown_bucket(run_cli: Cli) -> None:
    result = run_cli(
        "verify", f"s3://no-such-bucket-{secrets.token_hex(4)}/p/k/", "--tensor-parallel-size", "1"
    )

    assert (result.code, result.outcome.reason) == (22, reasons.BUCKET_NOT_FOUND)


def test_unreachable_endpoint(run_cli: Cli, s3_bucket: S3Bucket, stored_set: str) -> None:
    endpoint = f"http://127.0.0.1:{procs.free_port()}"

    result = run_cli(
        "verify",
        f"s3://{s3_bucket.name}/{stored_set}/",
        "--tensor-parallel-size",
        "2",
        "--endpoint",
        endpoint,
    )

    assert (result.code, result.outcome.reason) == (21, reasons.UNREACHABLE)
    assert endpoint in result.outcome.message


def test_scratch_too_small_fails_before_any_work(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, prefix: str, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    args = serialize_args(
        model_uri, s3_bucket, prefix, "k", scratch, tp=2, extra=["--scratch-size-limit", "1Mi"]
    )

    result = run_cli(*args)

    assert (result.code, result.outcome.reason) == (30, reasons.INSUFFICIENT_SCRATCH)
    assert "needs about" in result.outcome.message
    assert "only 1.00 MiB is free" in result.outcome.message
    assert list(scratch.iterdir()) == []
    assert s3_bucket.keys(prefix + "/") == []


@pytest.mark.parametrize(
    ("engine_args", "words"),
    [
        ('{"tensor_parallel_size": 8}', "tensor_parallel_size, which preshard controls"),
        ('{"load_format": "dummy", "quantization": "fp8"}', "load_format"),
        ('{"hf_overrides": {"a": 1}}', "only strings, numbers"),
        ('["quantization"]', "must be a JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_engine_args_preshard_controls_are_refused(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    model_uri: str,
    prefix: str,
    tmp_path: Path,
    engine_args: str,
    words: str,
) -> None:
    args = serialize_args(
        model_uri,
        s3_bucket,
        prefix,
        "k",
        tmp_path / "scratch",
        tp=1,
        extra=["--engine-args-json", engine_args],
    )

    result = run_cli(*args)

    assert (result.code, result.outcome.reason) == (31, reasons.INVALID_ARGUMENTS)
    assert words in result.outcome.message
    assert s3_bucket.keys(prefix + "/") == []


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"--tensor-parallel-size": "0"}, "at least 1"),
        ({"--dtype": "fp8"}, "--dtype 'fp8' is not one of"),
        ({"--artifact-key": "other"}, "must end with the artifact key other"),
        ({"--model": "not a model id"}, "neither an s3:// prefix"),
        ({"--dest": "s3://Bad_Bucket/x/k/"}, "not a valid s3://bucket/prefix URI"),
        ({"--part-size": "1Mi"}, "--part-size must be between"),
    ],
)
def test_bad_flags_end_in_invalid_arguments(
    run_cli: Cli,
    s3_bucket: S3Bucket,
    model_uri: str,
    prefix: str,
    tmp_path: Path,
    change: dict[str, str],
    words: str,
) -> None:
    args = serialize_args(model_uri, s3_bucket, prefix, "k", tmp_path / "scratch", tp=1)
    for flag, value in change.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]

    result = run_cli(*args)

    assert (result.code, result.outcome.reason) == (31, reasons.INVALID_ARGUMENTS)
    assert words in result.outcome.message


def test_missing_flag_still_writes_an_outcome(run_cli: Cli) -> None:
    result = run_cli("verify", "--tensor-parallel-size", "1")

    assert (result.code, result.outcome.reason) == (31, reasons.INVALID_ARGUMENTS)
    assert result.outcome.message == "URI is required"


def test_delete_refuses_a_bucket_root(run_cli: Cli, s3_bucket: S3Bucket) -> None:
    result = run_cli("delete", f"s3://{s3_bucket.name}/")

    assert (result.code, result.outcome.reason) == (31, reasons.INVALID_ARGUMENTS)
    assert s3_bucket.keys("")


def test_an_engine_failure_is_serialization_failed(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, prefix: str, tmp_path: Path
) -> None:
    # The tiny model's heads do not split three ways, just as vLLM would refuse them.
    result = run_cli(*serialize_args(model_uri, s3_bucket, prefix, "k", tmp_path / "scratch", tp=3))

    assert (result.code, result.outcome.reason) == (40, reasons.SERIALIZATION_FAILED)
    assert "does not split 3 ways" in result.outcome.message
    assert s3_bucket.keys(prefix + "/") == []


def test_an_unexpected_error_is_internal_error(
    run_cli: Cli, s3_bucket: S3Bucket, model_uri: str, prefix: str, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    scratch.write_text("a file where the scratch directory should be")

    result = run_cli(*serialize_args(model_uri, s3_bucket, prefix, "k", scratch, tp=1))

    assert (result.code, result.outcome.reason) == (1, reasons.INTERNAL_ERROR)
    assert result.outcome.message.startswith("unexpected FileExistsError")
