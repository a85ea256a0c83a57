"""Every line the operator logs about a ShardedModel names it, as text or as JSON.

The reconciler writes through `object_log`, kopf's handlers through kopf's per-object logger;
`configure_logging` sets kopf's formatters up so that both end in a line that carries the
resource's namespace and name: the `object` field of a JSON line, the `[namespace/name]` prefix
of a text line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, cast

import kopf
import pytest

from preshard.api.status import ShardedModelStatus
from preshard.builders import Manifest
from preshard.controller import kube
from preshard.controller.cli import configure_logging
from preshard.controller.plan import DeploymentPatch, Plan
from preshard.controller.reconciler import Reconciler, object_log, observed_for
from preshard.settings import Settings

NAMESPACE = "models"
NAME = "llama"
LOGGER = "preshard.controller.reconciler"
SPEC: dict[str, Any] = {
    "model": {"id": "org/model", "revision": "abc123"},
    "storage": {"uri": "s3://bucket/shards"},
    "tensorParallelSizes": [2],
}


class FakeKube:
    """Accepts every Job; refuses every Deployment patch as stale, or as not found."""

    def __init__(self, *, terminating: bool = False, patch_error: Exception | None = None) -> None:
        self.terminating = terminating
        self.patch_error = patch_error or kube.ConflictError(
            f"Deployment {NAMESPACE}/vllm changed; retrying"
        )
        self.created: list[str] = []

    def create_job(self, manifest: Manifest) -> bool:
        if self.terminating:
            raise kube.NamespaceTerminatingError(NAMESPACE)
        self.created.append(manifest["metadata"]["name"])
        return True

    def delete_job(self, namespace: str, name: str) -> None:
        """Nothing to delete."""

    def patch_deployment(self, namespace: str, name: str, patch: list[Manifest]) -> None:
        raise self.patch_error

    def patch_status(self, namespace: str, name: str, status: Manifest) -> None:
        """The status is not looked at here."""


def reconciler(fake: FakeKube) -> Reconciler:
    return Reconciler(cast("kube.Kube", fake), Settings())


def job(name: str) -> Manifest:
    return {"metadata": {"name": name, "namespace": NAMESPACE}}


def patch_plan() -> Plan:
    return Plan(
        status=ShardedModelStatus(),
        patches=[DeploymentPatch(name="vllm", patch=[], planned_from=("uid-d", 4))],
    )


def references(records: list[logging.LogRecord]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for record in records:
        reference: dict[str, str] = getattr(record, "k8s_ref", {})
        found.append((reference.get("namespace", ""), reference.get("name", "")))
    return found


def test_a_reconcile_logs_every_line_with_its_sharded_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeKube()
    body = {
        "apiVersion": "preshard.dev/v1alpha1",
        "kind": "ShardedModel",
        "metadata": {"namespace": NAMESPACE, "name": NAME, "uid": "uid-1", "generation": 1},
        "spec": SPEC,
    }
    observed = observed_for({}, {}, frozenset(), datetime(2026, 12, 1, tzinfo=UTC))

    with caplog.at_level(logging.INFO, logger=LOGGER):
        reconciler(fake).reconcile(body, observed)

    (created,) = fake.created
    assert [r.getMessage() for r in caplog.records] == [f"created Job {NAMESPACE}/{created}"]
    assert [getattr(r, "k8s_ref", None) for r in caplog.records] == [
        {
            "apiVersion": "preshard.dev/v1alpha1",
            "kind": "ShardedModel",
            "name": NAME,
            "uid": "uid-1",
            "namespace": NAMESPACE,
        }
    ]


@pytest.mark.parametrize(
    ("fake", "plan", "message"),
    [
        (FakeKube(), Plan(status=ShardedModelStatus(), create_jobs=[job("j")]), "created Job"),
        (
            FakeKube(terminating=True),
            Plan(status=ShardedModelStatus(), create_jobs=[job("j")]),
            f"namespace {NAMESPACE} is terminating; Job j not created",
        ),
        (FakeKube(), patch_plan(), f"Deployment {NAMESPACE}/vllm changed; retrying"),
        (
            FakeKube(patch_error=kube.NotFoundError(f"Deployment {NAMESPACE}/vllm not found")),
            patch_plan(),
            f"Deployment {NAMESPACE}/vllm not found",
        ),
    ],
)
def test_every_line_of_carrying_out_a_plan_names_the_sharded_model(
    fake: FakeKube, plan: Plan, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        reconciler(fake).execute(plan, NAMESPACE, object_log(NAMESPACE, NAME))

    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(message)
    assert references(caplog.records) == [(NAMESPACE, NAME)]


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The global logging state `configure_logging` changes, put back afterwards."""
    root, objects, aio = (logging.getLogger(n) for n in ("", "kopf.objects", "asyncio"))
    saved = (root.handlers[:], root.level, objects.level, aio.handlers[:], aio.propagate)
    try:
        yield
    finally:
        root.handlers[:], aio.handlers[:] = saved[0], saved[3]
        root.setLevel(saved[1])
        objects.setLevel(saved[2])
        aio.propagate = saved[4]


def operator_lines(log_format: str) -> list[str]:
    """How the operator's log handler writes a reconciler line, a kopf handler's line, and a
    line about no object."""
    before = logging.getLogger().handlers[:]
    configure_logging(Settings(log_format=log_format), verbose=False)
    (handler,) = [h for h in logging.getLogger().handlers if h not in before]
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    ours, kopf_objects = logging.getLogger(LOGGER), logging.getLogger("kopf.objects")
    for logger in (ours, kopf_objects):
        logger.addHandler(keep)
    try:
        object_log(NAMESPACE, NAME, "uid-1").info("created Job %s/%s", NAMESPACE, "j")
        body = kopf.Body(
            {
                "apiVersion": "preshard.dev/v1alpha1",
                "kind": "ShardedModel",
                "metadata": {"namespace": NAMESPACE, "name": NAME, "uid": "uid-1"},
            }
        )
        kopf.LocalObjectLogger(body=body, settings=kopf.OperatorSettings()).error(
            "reconcile failed; retrying"
        )
        ours.warning("no object")
    finally:
        for logger in (ours, kopf_objects):
            logger.removeHandler(keep)
    return [handler.format(record) for record in records]


@pytest.mark.usefixtures("restored_logging")
def test_a_json_operator_names_the_sharded_model_in_each_line() -> None:
    lines = [json.loads(line) for line in operator_lines("json")]

    assert [(line["message"], line.get("object")) for line in lines] == [
        (
            f"created Job {NAMESPACE}/j",
            {
                "apiVersion": "preshard.dev/v1alpha1",
                "kind": "ShardedModel",
                "name": NAME,
                "uid": "uid-1",
                "namespace": NAMESPACE,
            },
        ),
        (
            "reconcile failed; retrying",
            {
                "apiVersion": "preshard.dev/v1alpha1",
                "kind": "ShardedModel",
                "name": NAME,
                "uid": "uid-1",
                "namespace": NAMESPACE,
            },
        ),
        ("no object", None),
    ]
    assert [line["severity"] for line in lines] == ["info", "error", "warn"]


@pytest.mark.usefixtures("restored_logging")
def test_a_text_operator_names_the_sharded_model_in_each_line() -> None:
    assert operator_lines("text") == [
        f"[{NAMESPACE}/{NAME}] created Job {NAMESPACE}/j",
        f"[{NAMESPACE}/{NAME}] reconcile failed; retrying",
        "no object",
    ]
