"""Each command through the installed `preshard` console script: exit code and termination file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from preshard.contract import reasons
from preshard.contract.outcome import Outcome
from preshard_devenv import cpuengine, procs
from preshard_devenv.s3server import S3Bucket, S3Server

pytestmark = pytest.mark.s3

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Finished:
    """A finished `preshard` process."""

    code: int
    outcome: Outcome
    stdout: str
    stderr: str


def preshard(argv: list[str], env: dict[str, str], tmp_path: Path, name: str) -> Finished:
    """Run the `preshard` console script with a termination log from the environment."""
    log = tmp_path / f"{name}.termination-log"
    executable = Path(sys.executable).with_name("preshard")
    done = subprocess.run(
        [str(executable), *argv],
        env=env | {"PRESHARD_TERMINATION_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    outcome = Outcome.from_message(log.read_text())
    assert outcome is not None, done.stderr
    return Finished(done.returncode, outcome, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def script_env(s3_server: S3Server) -> dict[str, str]:
    """The environment of a Job's pod: credentials, endpoint, the CPU engine importable."""
    return (
        dict(os.environ)
        | s3_server.env()
        | {"PRESHARD_ENGINE": cpuengine.SPEC, "PYTHONPATH": str(REPO_ROOT)}
    )


@pytest.fixture(scope="module")
def serialized(
    script_env: dict[str, str],
    s3_bucket: S3Bucket,
    model_uri: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Finished:
    """`preshard serialize` of the tiny model for TP 2, run once for this module."""
    tmp = tmp_path_factory.mktemp("script")
    return preshard(
        [
            "serialize",
            "--model",
            model_uri,
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "bfloat16",
            "--dest",
            f"s3://{s3_bucket.name}/script/k/",
            "--artifact-key",
            "k",
            "--scratch-dir",
            str(tmp / "scratch"),
            "--log-format",
            "json",
        ],
        script_env,
        tmp,
        "serialize",
    )


def test_serialize(serialized: Finished, s3_server: S3Server) -> None:
    assert serialized.code == 0, serialized.stderr
    assert serialized.outcome.reason == reasons.SERIALIZED
    assert serialized.stdout.strip() == serialized.outcome.to_message()
    assert '"level": "info"' in serialized.stderr
    assert s3_server.credentials.secret_access_key not in serialized.stdout + serialized.stderr


def json_lines(text: str) -> list[dict[str, object]]:
    """Each line of a log that must be JSON lines, parsed; a line that is not fails."""
    parsed = []
    for line in text.splitlines():
        value = json.loads(line)
        assert isinstance(value, dict), line
        parsed.append(value)
    return parsed


def test_a_json_run_writes_only_json_lines(
    serialized: Finished,
    script_env: dict[str, str],
    s3_bucket: S3Bucket,
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    missing = preshard(
        [
            "verify",
            f"s3://{s3_bucket.name}/script/nothing-here/",
            "--tensor-parallel-size",
            "2",
            "--log-format",
            "json",
        ],
        script_env,
        tmp_path,
        "missing",
    )
    broken = preshard(
        ["fetch-config", "--log-format", "json", "--no-such-flag"], script_env, tmp_path, "bad"
    )

    assert missing.outcome.reason == reasons.MANIFEST_MISSING
    assert broken.outcome.reason == reasons.INVALID_ARGUMENTS
    for run, command in ((serialized, "serialize"), (missing, "verify")):
        lines = json_lines(run.stderr)
        assert lines, f"{command} logged nothing"
        assert {tuple(sorted(line)) for line in lines} == {
            ("command", "level", "logger", "message", "time")
        }
        assert {line["command"] for line in lines} == {command}
    assert {line["level"] for line in json_lines(serialized.stderr)} >= {"info"}
    assert [line["level"] for line in json_lines(missing.stderr)] == ["error"]
    assert json_lines(broken.stderr) == []
    for run in (serialized, missing, broken):
        # stdout holds the outcome alone, itself one JSON line.
        assert json_lines(run.stdout) == [json.loads(run.outcome.to_message())]
        secret = s3_server.credentials.secret_access_key
        assert secret not in run.stdout + run.stderr


def test_verify(
    serialized: Finished, script_env: dict[str, str], s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    uri = f"s3://{s3_bucket.name}/script/k/"
    ok = preshard(
        ["verify", uri, "--tensor-parallel-size", "2", "--deep"], script_env, tmp_path, "ok"
    )
    wrong_tp = preshard(["verify", uri, "--tensor-parallel-size", "1"], script_env, tmp_path, "tp")

    assert (ok.code, ok.outcome.reason) == (0, reasons.VERIFIED)
    assert (wrong_tp.code, wrong_tp.outcome.reason) == (14, reasons.TP_MISMATCH)


def test_fetch_config(
    serialized: Finished, script_env: dict[str, str], s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    target = tmp_path / "model"
    done = preshard(
        ["fetch-config", f"s3://{s3_bucket.name}/script/k/", str(target)], script_env, tmp_path, "f"
    )

    assert (done.code, done.outcome.reason) == (0, reasons.CONFIG_FETCHED)
    assert (target / "config.json").is_file()


def test_delete(
    serialized: Finished, script_env: dict[str, str], s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="script/k-other/keep", Body=b"x")
    done = preshard(["delete", f"s3://{s3_bucket.name}/script/k/"], script_env, tmp_path, "d")

    assert (done.code, done.outcome.reason) == (0, reasons.DELETED)
    assert s3_bucket.keys("script/") == ["script/k-other/keep"]


def test_unreachable_hub(script_env: dict[str, str], s3_bucket: S3Bucket, tmp_path: Path) -> None:
    env = script_env | {
        "HF_ENDPOINT": f"http://127.0.0.1:{procs.free_port()}",
        "HF_HUB_OFFLINE": "0",
    }
    done = preshard(
        [
            "serialize",
            "--model",
            "example-org/example-model",
            "--tensor-parallel-size",
            "1",
            "--dtype",
            "auto",
            "--dest",
            f"s3://{s3_bucket.name}/script/hub/",
            "--artifact-key",
            "hub",
            "--scratch-dir",
            str(tmp_path / "scratch"),
        ],
        env,
        tmp_path,
        "hub",
    )

    assert (done.code, done.outcome.reason) == (21, reasons.UNREACHABLE)
    assert "Hugging Face Hub" in done.outcome.message


def test_the_command_line_imports_no_data_plane_dependency() -> None:
    code = (
        "import sys; from preshard import cli; cli.build_parser(); "
        "heavy = {'boto3', 'botocore', 'torch', 'tensorizer', 'vllm', 'huggingface_hub'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )

    assert done.stdout.strip() == "[]"
