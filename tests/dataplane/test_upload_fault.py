"""The S3 server dies in the middle of an upload: a clean failure, no manifest, a working retry.

This module has its own S3 server, so stopping it does not disturb the other tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from preshard import cli
from preshard.contract import reasons
from preshard.contract.outcome import Outcome
from preshard_devenv import cpuengine
from preshard_devenv.procs import wait_for
from preshard_devenv.s3server import S3Bucket, S3Server, create_bucket, start_s3_server
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from tests.support.models import upload_model

pytestmark = [pytest.mark.s3, pytest.mark.slow]


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """An S3 server only this module uses (and stops)."""
    server = start_s3_server(tmp_path_factory.mktemp("fault-s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def larger_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """About 75 MB of weights: enough parts to stop the server between two of them."""
    return make_tiny_model(
        tmp_path_factory.mktemp("larger-model"), hidden_size=512, intermediate_size=1024, layers=8
    )


def _serialize(model_uri: str, bucket: str, scratch: Path, log: Path) -> int:
    return cli.main(
        [
            "serialize",
            "--model",
            model_uri,
            "--tensor-parallel-size",
            "1",
            "--dtype",
            "auto",
            "--dest",
            f"s3://{bucket}/sets/fault/",
            "--artifact-key",
            "fault",
            "--scratch-dir",
            str(scratch),
            "--upload-concurrency",
            "1",
            "--part-size",
            "5Mi",
            "--termination-log",
            str(log),
        ]
    )


def _wait_for_first_part(bucket: S3Bucket, done: threading.Event) -> None:
    missed = "the upload finished or never started before the server could be stopped"

    def a_part_stored() -> bool:
        if done.is_set():
            pytest.fail(missed)
        uploads = bucket.client.list_multipart_uploads(Bucket=bucket.name, Prefix="sets/fault/")
        return any(
            bucket.client.list_parts(
                Bucket=bucket.name, Key=upload["Key"], UploadId=upload["UploadId"]
            ).get("Parts")
            for upload in uploads.get("Uploads", [])
        )

    try:
        wait_for(a_part_stored, timeout=120, interval=0.02, what="the first part to be stored")
    except TimeoutError:
        pytest.fail(missed)


def test_server_stopped_mid_upload(
    own_server: S3Server, larger_model: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in own_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PRESHARD_ENGINE", cpuengine.SPEC)
    bucket = create_bucket(own_server, "fault")
    model_uri = upload_model(larger_model, bucket.client, bucket.name, "sources/larger")
    scratch, log = tmp_path / "scratch", tmp_path / "termination-log"
    codes: list[int] = []
    done = threading.Event()

    def run() -> None:
        try:
            codes.append(_serialize(model_uri, bucket.name, scratch, log))
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    try:
        _wait_for_first_part(bucket, done)
        own_server.stop()
    finally:
        worker.join(timeout=120)
    assert not worker.is_alive()

    outcome = Outcome.from_message(log.read_text())
    assert outcome is not None
    assert (codes, outcome.reason) == ([21], reasons.UNREACHABLE), outcome.message
    assert own_server.endpoint in outcome.message

    own_server.restart()
    assert "sets/fault/manifest.json" not in bucket.keys("sets/fault/")

    assert _serialize(model_uri, bucket.name, scratch, log) == 0, log.read_text()
    retried = Outcome.from_message(log.read_text())
    assert retried is not None
    assert retried.reason == reasons.SERIALIZED
    assert "sets/fault/manifest.json" in bucket.keys("sets/fault/")
    leftover = bucket.client.list_multipart_uploads(Bucket=bucket.name, Prefix="sets/fault/")
    assert leftover.get("Uploads", []) == []
