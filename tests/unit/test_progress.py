"""Progress from a running Job's log: the data plane's own lines, read back in steps."""

from __future__ import annotations

import io
import sys
import time

import pytest

from preshard.controller.progress import ProgressReader, latest_step, step_of
from preshard.dataplane import logs


def logged(log_format: logs.LogFormat, command: str, *lines: str) -> str:
    """What the data plane writes to stderr for these progress lines, in a format."""
    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        with logs.configured(log_format, command):
            for line in lines:
                logs.logger().info("%s", line)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = saved


def upload_line(done: int, total: int) -> str:
    progress = logs.Progress("upload", total, total_files=4)
    progress.add(done)
    return progress.line()


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_last_progress_line_of_either_log_format_is_read(log_format: logs.LogFormat) -> None:
    tail = logged(
        log_format,
        "serialize",
        "uploading 4 files",
        upload_line(3 << 30, 10 << 30),
        upload_line(4 << 30, 10 << 30),
        "something else",
    )
    step = latest_step(tail)
    assert step is not None
    assert step.key == ("upload", 40)
    assert step.text.startswith("upload 40% of 10.00 GiB, ")
    assert step.text.endswith(" left")


def test_percentages_move_in_steps_of_five() -> None:
    texts = [step_of(upload_line(done, 1000 << 20)) for done in (0, 49 << 20, 50 << 20, 999 << 20)]
    assert [s.key if s else None for s in texts] == [
        ("upload", 0),
        ("upload", 0),
        ("upload", 5),
        ("upload", 95),
    ]


def test_the_other_stages_of_serialize_and_reshard() -> None:
    engine = step_of("engine: 1.50 GiB written (35s)")
    assert engine is not None
    assert (engine.key, engine.text) == (("engine", -1), "engine: vLLM is writing the rank files")
    reshard = step_of("reshard: 7 of 20 tensors (4s)")
    assert reshard is not None
    assert (reshard.key, reshard.text) == (("reshard", 35), "reshard 35% of 20 tensors")
    hub = step_of("download: 2.00 GiB of 8.00 GiB (120s)")
    assert hub is not None
    assert (hub.key, hub.text) == (("download", 25), "download 25% of 8.00 GiB")


def test_a_log_without_progress_has_no_step() -> None:
    assert latest_step(logged("text", "verify", "checking 5 files", "complete")) is None
    assert latest_step("") is None
    assert latest_step("{not json\nplain words") is None


class Log:
    """A pod log the reader reads, and how often it was read."""

    def __init__(self) -> None:
        self.text = ""
        self.reads = 0
        self.fail = False

    def __call__(self, namespace: str, pod: str) -> str:
        self.reads += 1
        if self.fail:
            raise OSError("the node serves no logs")
        return self.text


def test_the_reader_reads_each_pod_at_most_once_per_interval() -> None:
    log = Log()
    log.text = logged("text", "serialize", upload_line(1 << 30, 10 << 30))
    reader = ProgressReader(log, interval=3600)
    first = reader.step("ns", "pod")
    assert first is not None
    assert first.key == ("upload", 10)
    log.text = logged("text", "serialize", upload_line(9 << 30, 10 << 30))
    assert reader.step("ns", "pod") == first
    assert log.reads == 1


def test_the_reader_keeps_a_step_until_the_next_one_and_through_a_failed_read() -> None:
    log = Log()
    reader = ProgressReader(log, interval=0.01)
    log.text = logged("text", "serialize", upload_line(1 << 30, 10 << 30))
    first = reader.step("ns", "pod")
    assert first is not None
    # The same step with another rate and time left is not news: the text stays the same.
    log.text = logged("text", "serialize", upload_line((1 << 30) + 10, 10 << 30))
    time.sleep(0.02)
    assert reader.step("ns", "pod") == first
    log.fail = True
    time.sleep(0.02)
    assert reader.step("ns", "pod") == first
    log.fail = False
    log.text = logged("text", "serialize", upload_line(6 << 30, 10 << 30))
    time.sleep(0.02)
    moved = reader.step("ns", "pod")
    assert moved is not None
    assert moved.key == ("upload", 60)
