"""Fixtures of the data-plane tests: a tiny model in S3, the CPU engine, a CLI runner."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from preshard import cli
from preshard.contract.outcome import Outcome
from preshard_devenv import cpuengine
from preshard_devenv.s3server import S3Bucket, S3Server
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from tests.support.models import upload_model


@dataclass(frozen=True)
class Run:
    """One finished command: exit code, parsed termination message, captured output."""

    code: int
    outcome: Outcome
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Cli:
    """Runs `preshard` in-process with a fresh termination log for each command."""

    capsys: pytest.CaptureFixture[str]
    tmp_path: Path

    def __call__(self, *argv: str) -> Run:
        """Run `preshard *argv` and return what it reported."""
        self.capsys.readouterr()
        log = self.tmp_path / f"termination-{secrets.token_hex(4)}"
        code = cli.main([*argv, "--termination-log", str(log)])
        captured = self.capsys.readouterr()
        outcome = Outcome.from_message(log.read_text())
        assert outcome is not None, f"no outcome in {log}: {captured.err}"
        assert captured.out.strip().splitlines()[-1] == log.read_text()
        return Run(code, outcome, captured.out, captured.err)


def serialize_args(
    model_uri: str,
    bucket: S3Bucket,
    prefix: str,
    key: str,
    scratch: Path,
    *,
    tp: int,
    dtype: str = "auto",
    extra: Sequence[str] = (),
) -> list[str]:
    """The `preshard serialize` command line the controller would build."""
    return [
        "serialize",
        "--model",
        model_uri,
        "--tensor-parallel-size",
        str(tp),
        "--dtype",
        dtype,
        "--dest",
        f"s3://{bucket.name}/{prefix}/{key}/",
        "--artifact-key",
        key,
        "--scratch-dir",
        str(scratch),
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny Llama-shaped model directory, weights split over two safetensors files."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), weight_shards=2)


@pytest.fixture(scope="session")
def model_uri(tiny_model: TinyModel, s3_bucket: S3Bucket) -> str:
    """The tiny model uploaded as an S3 model source."""
    return upload_model(tiny_model, s3_bucket.client, s3_bucket.name, "sources/tiny")


@pytest.fixture
def dataplane_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials, endpoint and the CPU engine in this process's environment."""
    env = s3_server.env() | {
        "PRESHARD_ENGINE": cpuengine.SPEC,
        "PRESHARD_PROGRESS_INTERVAL": "0.5",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def run_cli(
    dataplane_env: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Cli:
    """A runner of in-process `preshard` commands against the test S3 server."""
    return Cli(capsys, tmp_path)


@pytest.fixture
def prefix() -> str:
    """A storage prefix no other test uses."""
    return f"sets/{secrets.token_hex(4)}"


@pytest.fixture(scope="session")
def stored_set(
    s3_server: S3Server,
    s3_bucket: S3Bucket,
    model_uri: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """One complete TP-2 shard set made once for the tests that only read or copy it."""
    key = "shared-tp2"
    scratch = tmp_path_factory.mktemp("shared-scratch")
    log = scratch / "termination-log"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (s3_server.env() | {"PRESHARD_ENGINE": cpuengine.SPEC}).items():
            patch.setenv(name, value)
        code = cli.main(
            [
                *serialize_args(model_uri, s3_bucket, "shared", key, scratch / "s", tp=2),
                "--termination-log",
                str(log),
            ]
        )
    assert code == 0, log.read_text()
    return f"shared/{key}"


def copy_set(bucket: S3Bucket, source_prefix: str, target_prefix: str) -> None:
    """Server-side copy of every object of a shard set to another prefix."""
    for name in bucket.keys(source_prefix + "/"):
        bucket.client.copy_object(
            Bucket=bucket.name,
            Key=target_prefix + name[len(source_prefix) :],
            CopySource={"Bucket": bucket.name, "Key": name},
        )


def read_manifest(bucket: S3Bucket, prefix: str) -> dict[str, object]:
    """The stored manifest.json of a shard set, as JSON."""
    body = bucket.client.get_object(Bucket=bucket.name, Key=f"{prefix}/manifest.json")["Body"]
    value: dict[str, object] = json.loads(body.read())
    return value
