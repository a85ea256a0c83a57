"""The deletion of a ShardedModel as a plan: what to restore, stop, start and wait for."""

from __future__ import annotations

from typing import Any

import pytest

from preshard.api.models import parse_spec
from preshard.api.status import ShardedModelStatus, ShardSetStatus
from preshard.builders.shardset import Owner, ShardSet, child_name
from preshard.controller.observe import JobView
from preshard.controller.plan.deletion import plan_deletion
from preshard.settings import Settings

OWNER = Owner(name="llama", namespace="models", uid="u-1")
KEYS = ("0123456789abcdef0123", "fedcba9876543210fedc")
SPEC: dict[str, Any] = {
    "model": {"id": "org/model", "revision": "abc123"},
    "storage": {"uri": "s3://models/shards", "retention": "Delete"},
    "tensorParallelSizes": [2],
}


def status(job: str | None = None) -> ShardedModelStatus:
    return ShardedModelStatus(
        shard_sets=[
            ShardSetStatus(
                tensor_parallel_size=2,
                artifact_key=KEYS[0],
                uri=f"s3://models/shards/{KEYS[0]}/",
                stage="Verified",
                job=job,
            ),
            ShardSetStatus(
                tensor_parallel_size=4,
                artifact_key=KEYS[1],
                uri=f"s3://models/shards/{KEYS[1]}/",
                stage="Superseded",
            ),
        ]
    )


def deployment(owner: str | None) -> dict[str, Any]:
    annotations = {"preshard.dev/owner": owner} if owner else {}
    return {"metadata": {"annotations": annotations}}


def view(name: str, *, finished: bool, succeeded: bool = True) -> JobView:
    return JobView(
        name=name,
        command="delete" if "-delete-" in name else "verify",
        finished=finished,
        succeeded=succeeded,
        condition_reason=None,
        condition_message="",
        pods=(),
    )


def delete_job_name(index: int) -> str:
    spec = parse_spec(SPEC)
    tp = (2, 4)[index]
    return child_name(OWNER, ShardSet.for_spec(spec, tp, KEYS[index]), "delete", 1)


def deletion(
    spec: dict[str, Any] | None = SPEC,
    annotations: dict[str, str] | None = None,
    jobs: dict[str, JobView] | None = None,
    elsewhere: frozenset[str] = frozenset(),
    job: str | None = None,
) -> Any:
    return plan_deletion(
        OWNER,
        annotations or {},
        parse_spec(spec) if spec is not None else None,
        status(job),
        {"vllm": deployment("llama"), "other": deployment("mistral"), "plain": deployment(None)},
        jobs or {},
        elsewhere,
        Settings(),
    )


def test_skip_cleanup_lets_go_at_once_with_a_warning() -> None:
    planned = deletion(annotations={"preshard.dev/skip-cleanup": "true"})
    assert planned.skipped
    assert (planned.restore, planned.create_jobs, planned.waiting) == ((), (), ())
    (event,) = planned.events()
    assert (event.type, event.reason) == ("Warning", "CleanupFailed")


@pytest.mark.parametrize("spec", [{**SPEC, "storage": {"uri": "s3://models/shards"}}, None])
def test_retained_or_unreadable_sets_stay_and_only_its_targets_are_restored(
    spec: dict[str, Any] | None,
) -> None:
    running = "llama-01234567-verify-3"
    planned = deletion(spec, jobs={running: view(running, finished=False)}, job=running)
    assert planned.restore == ("vllm",)
    assert planned.stop_jobs == (running,)
    assert (planned.create_jobs, planned.waiting, planned.events()) == ((), (), [])


def test_each_set_no_one_else_lists_gets_a_delete_job_and_is_waited_for() -> None:
    shared = f"s3://models/shards/{KEYS[1]}/"
    planned = deletion(elsewhere=frozenset({shared}))
    (job,) = planned.create_jobs
    assert job["metadata"]["name"] == delete_job_name(0)
    assert planned.waiting == (f"{delete_job_name(0)} created",)

    running = deletion(jobs={delete_job_name(0): view(delete_job_name(0), finished=False)})
    assert [j["metadata"]["name"] for j in running.create_jobs] == [delete_job_name(1)]
    assert running.running == (delete_job_name(0),)


def test_a_failed_delete_job_keeps_the_deletion_waiting_with_its_reason() -> None:
    names = [delete_job_name(0), delete_job_name(1)]
    planned = deletion(
        jobs={
            names[0]: view(names[0], finished=True, succeeded=False),
            names[1]: view(names[1], finished=True),
        }
    )
    assert planned.failed is not None
    assert planned.failed.startswith(f"deleting s3://models/shards/{KEYS[0]}/ failed")
    assert [v.name for v in planned.finished] == names


def test_once_every_delete_job_succeeded_the_sets_are_reported_deleted() -> None:
    names = [delete_job_name(0), delete_job_name(1)]
    planned = deletion(jobs={n: view(n, finished=True) for n in names})
    assert (planned.failed, planned.waiting) == (None, ())
    (event,) = planned.events()
    assert (event.reason, event.message) == ("Deleted", "2 shard set(s) deleted")
