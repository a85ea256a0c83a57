"""The operator's metrics: the recorder on its own, and what the reconciler makes it count.

The reconciler tests run real plans through `Reconciler` against a stand-in for the API server
that creates Jobs, applies Deployment patches and stores the status, so every count comes from
the same comparison of plan and status the operator makes. Values are read from the registry as
a scrape would show them.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from preshard.api.status import Condition, ShardedModelStatus
from preshard.builders import Manifest
from preshard.builders.shardset import LABEL_COMMAND
from preshard.contract import reasons
from preshard.contract.outcome import Outcome, exit_code
from preshard.controller import conditions, kube, metrics
from preshard.controller.observe import JobView, PodView
from preshard.controller.reconciler import (
    CleanupPendingError,
    Reconciler,
    first_ready,
    observed_for,
)
from preshard.settings import Settings, SettingsError
from preshard_devenv import workloads

NAMESPACE = "models"
NAME = "llama"
CREATED = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SECRET_NAME = "s3-credentials-7f3a"
STORAGE_URI = "s3://private-bucket-91c2/shards"
ENDPOINT = "https://objects.example.internal"
SPEC: dict[str, Any] = {
    "model": {"id": "org/model", "revision": "abc123"},
    "storage": {
        "uri": STORAGE_URI,
        "endpoint": ENDPOINT,
        "credentialsSecretRef": {"name": SECRET_NAME},
        "retention": "Delete",
    },
    "tensorParallelSizes": [2],
    "targets": [{"name": "vllm"}],
}


def value(recorder: metrics.Metrics, name: str, **labels: str) -> float:
    """A sample's value as a scrape shows it; 0 when there is none."""
    found = recorder.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def stages(recorder: metrics.Metrics) -> dict[tuple[str, str, str], float]:
    """Every series of the shard-set gauge."""
    return {
        (s.labels["namespace"], s.labels["shardedmodel"], s.labels["stage"]): s.value
        for family in recorder.registry.collect()
        if family.name == metrics.SHARD_SETS
        for s in family.samples
    }


# The recorder on its own.


def test_a_pass_is_counted_and_timed_and_a_failed_one_by_its_reason() -> None:
    recorder = metrics.Metrics()
    with recorder.reconcile_pass():
        pass
    with pytest.raises(ApiException), recorder.reconcile_pass():
        raise ApiException(status=403, reason="Forbidden")
    with pytest.raises(KeyError), recorder.reconcile_pass():
        raise KeyError("status")
    with recorder.reconcile_pass() as counted:
        counted.error = reasons.INVALID_SPEC

    assert value(recorder, "preshard_reconcile_passes_total") == 4
    assert value(recorder, "preshard_reconcile_duration_seconds_count") == 4
    assert value(recorder, "preshard_reconcile_errors_total", reason="Forbidden") == 1
    assert value(recorder, "preshard_reconcile_errors_total", reason="KeyError") == 1
    assert value(recorder, "preshard_reconcile_errors_total", reason="InvalidSpec") == 1


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ApiException(status=429), "TooManyRequests"),
        (ApiException(status=500), "InternalServerError"),
        (ApiException(status=404), "NotFound"),
        (ApiException(status=599), "ApiException"),
        (ApiException(reason="connection refused"), "ApiException"),
        (kube.ConflictError("Deployment models/vllm changed; retrying"), "ConflictError"),
        (ValueError("token=hunter2"), "ValueError"),
    ],
)
def test_an_error_reason_is_a_bounded_word_never_the_message(
    error: BaseException, reason: str
) -> None:
    assert metrics.error_reason(error) == reason


def test_shard_sets_by_stage_drop_the_stages_a_resource_left_and_the_resource_once_gone() -> None:
    recorder = metrics.Metrics()
    recorder.shard_sets(NAMESPACE, NAME, ["Verified", "Serializing", "Verified"])
    recorder.shard_sets(NAMESPACE, "other", ["Probing"])
    assert stages(recorder) == {
        (NAMESPACE, NAME, "Verified"): 2,
        (NAMESPACE, NAME, "Serializing"): 1,
        (NAMESPACE, "other", "Probing"): 1,
    }

    recorder.shard_sets(NAMESPACE, NAME, ["Verified", "Superseded"])
    assert stages(recorder) == {
        (NAMESPACE, NAME, "Verified"): 1,
        (NAMESPACE, NAME, "Superseded"): 1,
        (NAMESPACE, "other", "Probing"): 1,
    }

    recorder.forget(NAMESPACE, NAME)
    recorder.forget(NAMESPACE, "never-seen")
    assert stages(recorder) == {(NAMESPACE, "other", "Probing"): 1}


def test_a_succeeded_job_adds_what_it_moved_and_a_failed_one_its_reason() -> None:
    recorder = metrics.Metrics()
    recorder.job_finished(
        "serialize",
        Outcome(
            command="serialize",
            ok=True,
            reason=reasons.SERIALIZED,
            total_bytes=16_000_000_000,
            seconds=80.0,
        ),
    )
    recorder.job_finished(
        "verify",
        Outcome(command="verify", ok=True, reason=reasons.VERIFIED, total_bytes=100, seconds=0.5),
    )
    recorder.job_finished(
        "verify", Outcome(command="verify", ok=False, reason=reasons.SHARD_MISSING)
    )

    assert value(recorder, "preshard_jobs_succeeded_total", kind="serialize") == 1
    assert value(recorder, "preshard_dataplane_bytes_total", kind="serialize") == 16e9
    assert value(recorder, "preshard_dataplane_duration_seconds_sum", kind="serialize") == 80
    assert (
        value(recorder, "preshard_dataplane_throughput_bytes_per_second_sum", kind="serialize")
        == 2e8
    )
    assert value(recorder, "preshard_dataplane_bytes_total", kind="verify") == 100
    # A verify lists the set; its bytes per second are not a throughput.
    assert (
        value(recorder, "preshard_dataplane_throughput_bytes_per_second_count", kind="verify") == 0
    )
    assert value(recorder, "preshard_jobs_failed_total", kind="verify", reason="ShardMissing") == 1
    assert value(recorder, "preshard_jobs_succeeded_total", kind="verify") == 1


def test_labels_read_from_pods_are_only_preshards_own_words() -> None:
    recorder = metrics.Metrics()
    leaked = "AKIAIOSFODNN7EXAMPLE"
    recorder.job_finished("exfiltrate", Outcome(command="verify", ok=False, reason=leaked))
    recorder.verification("anything", leaked)

    assert value(recorder, "preshard_jobs_failed_total", kind="unknown", reason="Other") == 1
    assert value(recorder, "preshard_verifications_total", check="verify", reason="Other") == 1
    scrape = generate_latest(recorder.registry).decode()
    assert leaked not in scrape
    assert "exfiltrate" not in scrape


def test_patches_verifications_and_first_ready_are_counted() -> None:
    recorder = metrics.Metrics()
    recorder.deployment_patch(metrics.PATCH, metrics.APPLIED)
    recorder.deployment_patch(metrics.RESTORE, metrics.CONFLICT)
    recorder.verification(metrics.PROBE, reasons.MANIFEST_MISSING)
    recorder.ready(90.0)
    recorder.ready(-1.0)

    assert (
        value(recorder, "preshard_deployment_patches_total", action="patch", result="applied") == 1
    )
    assert (
        value(recorder, "preshard_deployment_patches_total", action="restore", result="conflict")
        == 1
    )
    assert (
        value(recorder, "preshard_verifications_total", check="probe", reason="ManifestMissing")
        == 1
    )
    assert value(recorder, "preshard_time_to_ready_seconds_count") == 2
    assert value(recorder, "preshard_time_to_ready_seconds_sum") == 90
    assert value(recorder, "preshard_time_to_ready_seconds_bucket", le="120.0") == 2


def test_the_sample_names_are_those_a_scrape_returns() -> None:
    recorder = metrics.Metrics()
    names = recorder.sample_names()
    assert {
        "preshard_build_info",
        "preshard_reconcile_passes_total",
        "preshard_reconcile_duration_seconds_bucket",
        "preshard_shard_sets",
        "preshard_jobs_started_total",
        "preshard_time_to_ready_seconds_count",
        "preshard_dataplane_throughput_bytes_per_second_sum",
    } <= names
    recorder.job_started("verify")
    recorder.shard_sets(NAMESPACE, NAME, ["Verified"])
    recorder.ready(1.0)
    scraped = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(recorder.registry).decode())
        for sample in family.samples
        if not sample.name.endswith("_created")
    }
    assert scraped <= names


@pytest.fixture
def served() -> Iterator[metrics.MetricsServer]:
    recorder = metrics.Metrics()
    recorder.job_started("serialize")
    server = recorder.serve(0, address="127.0.0.1")
    try:
        yield server
    finally:
        server.close()


def test_the_endpoint_answers_a_scrape_and_releases_its_port(
    served: metrics.MetricsServer,
) -> None:
    url = f"http://127.0.0.1:{served.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        body = response.read().decode()
    assert 'preshard_jobs_started_total{kind="serialize"} 1.0' in body
    assert 'preshard_build_info{version="' in body

    served.close()
    with socket.socket() as probe:
        # The connection just closed may linger in TIME_WAIT; only a listener would refuse this.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", served.port))


def test_the_process_registry_adds_the_process_and_no_created_series() -> None:
    recorder = metrics.Metrics.for_process()
    names = recorder.sample_names()
    assert "python_info" in names
    scrape = generate_latest(recorder.registry).decode()
    assert "_created" not in scrape


def test_each_metrics_instance_has_a_registry_of_its_own() -> None:
    first, second = metrics.Metrics(), metrics.Metrics(CollectorRegistry())
    first.job_started("verify")
    assert value(second, "preshard_jobs_started_total", kind="verify") == 0


# First Ready, from the conditions alone.


def condition(type_: str, status: str, at: datetime) -> Condition:
    return Condition(
        type=type_,
        status=status,  # type: ignore[arg-type]
        reason="R",
        last_transition_time=at.strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def with_conditions(*items: Condition) -> ShardedModelStatus:
    return ShardedModelStatus(conditions=list(items))


READY_NOW = with_conditions(condition(conditions.READY, "True", CREATED + timedelta(hours=2)))
LATER = CREATED + timedelta(minutes=30)


@pytest.mark.parametrize(
    ("before", "first"),
    [
        (ShardedModelStatus(), True),
        (
            with_conditions(
                condition(conditions.READY, "False", CREATED),
                condition(conditions.SERIALIZED, "True", LATER),
                condition(conditions.DEGRADED, "False", CREATED),
            ),
            True,
        ),
        (
            with_conditions(
                condition(conditions.READY, "False", LATER),
                condition(conditions.SERIALIZED, "False", LATER),
                condition(conditions.DEGRADED, "False", CREATED),
            ),
            False,
        ),
        (with_conditions(condition(conditions.READY, "True", CREATED)), False),
    ],
    ids=["no-status-yet", "never-ready", "ready-before", "still-ready"],
)
def test_first_ready_is_a_ready_false_since_the_first_status(
    before: ShardedModelStatus, first: bool
) -> None:
    assert first_ready(before, READY_NOW) is first
    assert first_ready(before, before) is False


# What the reconciler counts.


def deployment() -> Manifest:
    manifest = workloads.vllm_deployment(
        namespace=NAMESPACE, container=workloads.vllm_container(port=None)
    )
    manifest["metadata"].update(uid="uid-d", resourceVersion="1", generation=1)
    manifest["status"] = {"observedGeneration": 1}
    return manifest


def apply_json_patch(document: Manifest, ops: list[Manifest]) -> Manifest:
    """The JSON patch operations preshard sends, applied as the API server would."""
    result = copy.deepcopy(document)
    for op in ops:
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]
        ]
        node = result
        for part in parents:
            node = node[part]
        if op["op"] == "test":
            assert node[last] == op["value"], f"test of {op['path']} failed"
        elif op["op"] in ("add", "replace"):
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[last]
    return result


class FakeKube:
    """Creates Jobs (running until finished by the test), applies patches, keeps the status."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobView] = {}
        self.deployments: dict[str, Manifest] = {"vllm": deployment()}
        self.status: Manifest = {}
        self.status_error: Exception | None = None

    def create_job(self, manifest: Manifest) -> bool:
        name = manifest["metadata"]["name"]
        if name in self.jobs:
            return False
        command = manifest["metadata"]["labels"][LABEL_COMMAND]
        self.jobs[name] = JobView(name, command, False, False, None, "", ())
        return True

    def delete_job(self, namespace: str, name: str) -> None:
        self.jobs.pop(name, None)

    def get_deployment(self, namespace: str, name: str) -> Manifest:
        return copy.deepcopy(self.deployments[name])

    def patch_deployment(self, namespace: str, name: str, patch: list[Manifest]) -> None:
        current = self.deployments[name]
        updated = apply_json_patch(current, patch)
        updated["metadata"]["generation"] = current["metadata"]["generation"] + 1
        self.deployments[name] = updated

    def patch_status(self, namespace: str, name: str, status: Manifest) -> None:
        if self.status_error is not None:
            raise self.status_error
        self.status = copy.deepcopy(status)

    def finish(self, kind: str, outcome: Outcome) -> None:
        """The running Job of a kind ends with this outcome in its pod's termination message."""
        (name,) = [n for n, j in self.jobs.items() if j.command == kind and not j.finished]
        pod = PodView(
            name=f"{name}-pod",
            created="2026-12-01T12:00:00Z",
            phase="Succeeded" if outcome.ok else "Failed",
            exit_code=0 if outcome.ok else exit_code(outcome.reason),
            message=outcome.to_message(),
        )
        self.jobs[name] = JobView(
            name, kind, True, outcome.ok, None if outcome.ok else "PodFailurePolicy", "", (pod,)
        )

    def roll_out(self) -> None:
        """The Deployment controller completes the rollout of the current template."""
        for item in self.deployments.values():
            item["status"] = {
                "observedGeneration": item["metadata"]["generation"],
                "replicas": 1,
                "updatedReplicas": 1,
                "availableReplicas": 1,
            }


class Operator:
    """A reconciler and the stand-in cluster it acts on; `step` is one reconcile pass that sees
    every write of the passes before it."""

    def __init__(self, spec: dict[str, Any] = SPEC) -> None:
        self.kube = FakeKube()
        self.recorder = metrics.Metrics()
        self.reconciler = Reconciler(cast("kube.Kube", self.kube), Settings(), self.recorder)
        self.body: Manifest = {
            "apiVersion": "preshard.dev/v1alpha1",
            "kind": "ShardedModel",
            "metadata": {
                "namespace": NAMESPACE,
                "name": NAME,
                "uid": "uid-1",
                "generation": 1,
                "creationTimestamp": "2026-12-01T12:00:00Z",
            },
            "spec": copy.deepcopy(spec),
        }
        self.now = CREATED

    def step(self, minutes: float = 1.0) -> None:
        self.now += timedelta(minutes=minutes)
        observed = observed_for(
            dict(self.kube.jobs), copy.deepcopy(self.kube.deployments), frozenset(), self.now
        )
        self.reconciler.reconcile(copy.deepcopy(self.body), observed)
        self.body["status"] = copy.deepcopy(self.kube.status)

    def value(self, name: str, **labels: str) -> float:
        return value(self.recorder, name, **labels)

    def condition(self, type_: str) -> str:
        status = ShardedModelStatus.model_validate(self.body["status"])
        found = conditions.find(status.conditions, type_)
        assert found is not None
        return found.status


def drive_to_ready(operator: Operator) -> None:
    """Probe (nothing there), serialize, verify, patch, roll out: Ready."""
    operator.step()
    operator.kube.finish(
        "verify", Outcome(command="verify", ok=False, reason=reasons.MANIFEST_MISSING)
    )
    operator.step()
    operator.kube.finish(
        "serialize",
        Outcome(
            command="serialize",
            ok=True,
            reason=reasons.SERIALIZED,
            total_bytes=4_000_000_000,
            seconds=20.0,
        ),
    )
    operator.step()
    operator.kube.finish(
        "verify",
        Outcome(
            command="verify",
            ok=True,
            reason=reasons.VERIFIED,
            tensor_parallel_size=2,
            total_bytes=4_000_000_000,
            seconds=1.0,
        ),
    )
    operator.step()
    operator.kube.roll_out()
    operator.step()


def test_a_sharded_model_through_to_ready_counts_every_step_once() -> None:
    operator = Operator()
    drive_to_ready(operator)
    assert operator.condition(conditions.READY) == "True"
    counts_at_ready = generate_latest(operator.recorder.registry)

    for _ in range(3):
        operator.step(minutes=5)

    # Passes go on; nothing else moves: each Job's result and the first Ready count once.
    assert operator.value("preshard_reconcile_passes_total") == 8
    assert operator.value("preshard_reconcile_duration_seconds_count") == 8
    assert [
        line
        for line in generate_latest(operator.recorder.registry).decode().splitlines()
        if "reconcile_passes" not in line and "reconcile_duration" not in line
    ] == [
        line
        for line in counts_at_ready.decode().splitlines()
        if "reconcile_passes" not in line and "reconcile_duration" not in line
    ]
    assert operator.value("preshard_jobs_started_total", kind="verify") == 2
    assert operator.value("preshard_jobs_started_total", kind="serialize") == 1
    assert (
        operator.value("preshard_jobs_failed_total", kind="verify", reason="ManifestMissing") == 1
    )
    assert operator.value("preshard_jobs_succeeded_total", kind="serialize") == 1
    assert operator.value("preshard_jobs_succeeded_total", kind="verify") == 1
    assert (
        operator.value("preshard_verifications_total", check="probe", reason="ManifestMissing") == 1
    )
    assert operator.value("preshard_verifications_total", check="verify", reason="Verified") == 1
    assert operator.value("preshard_dataplane_bytes_total", kind="serialize") == 4e9
    assert (
        operator.value("preshard_dataplane_throughput_bytes_per_second_sum", kind="serialize")
        == 2e8
    )
    assert (
        operator.value("preshard_deployment_patches_total", action="patch", result="applied") == 1
    )
    assert operator.value("preshard_time_to_ready_seconds_count") == 1
    # Created at 12:00; Ready on the fifth pass, one minute apart.
    assert operator.value("preshard_time_to_ready_seconds_sum") == 300
    assert stages(operator.recorder) == {(NAMESPACE, NAME, "Verified"): 1}
    assert operator.value("preshard_reconcile_errors_total", reason="InvalidSpec") == 0


def test_ready_again_after_a_spec_change_is_not_a_first_ready() -> None:
    operator = Operator()
    drive_to_ready(operator)
    operator.body["spec"]["tensorParallelSizes"] = [4]
    operator.body["spec"]["targets"] = [{"name": "vllm", "tensorParallelSize": 4}]
    operator.body["metadata"]["generation"] = 2
    operator.step()
    assert operator.condition(conditions.READY) == "False"
    assert stages(operator.recorder) == {
        (NAMESPACE, NAME, "Probing"): 1,
        (NAMESPACE, NAME, "Superseded"): 1,
    }
    operator.kube.finish(
        "verify",
        Outcome(command="verify", ok=True, reason=reasons.VERIFIED, tensor_parallel_size=4),
    )
    operator.step()
    operator.kube.roll_out()
    operator.step()
    operator.step()

    assert operator.condition(conditions.READY) == "True"
    assert operator.value("preshard_verifications_total", check="probe", reason="Verified") == 1
    assert (
        operator.value("preshard_deployment_patches_total", action="patch", result="applied") == 2
    )
    assert operator.value("preshard_time_to_ready_seconds_count") == 1


def test_a_failed_status_write_counts_the_pass_as_an_error_and_its_results_later() -> None:
    operator = Operator()
    operator.step()
    operator.kube.finish(
        "verify", Outcome(command="verify", ok=False, reason=reasons.MANIFEST_MISSING)
    )
    operator.kube.status_error = ApiException(status=503)
    with pytest.raises(ApiException):
        operator.step()
    assert operator.value("preshard_reconcile_errors_total", reason="ServiceUnavailable") == 1
    assert (
        operator.value("preshard_jobs_failed_total", kind="verify", reason="ManifestMissing") == 0
    )

    operator.kube.status_error = None
    operator.step()
    operator.step()
    assert (
        operator.value("preshard_jobs_failed_total", kind="verify", reason="ManifestMissing") == 1
    )
    assert operator.value("preshard_reconcile_passes_total") == 4


def test_an_invalid_spec_is_counted_by_its_reason() -> None:
    operator = Operator({**SPEC, "tensorParallelSizes": []})
    operator.step()
    assert operator.value("preshard_reconcile_errors_total", reason="InvalidSpec") == 1
    assert operator.value("preshard_reconcile_passes_total") == 1


def deleting(operator: Operator) -> Manifest:
    """The ShardedModel as its deletion shows it."""
    body = copy.deepcopy(operator.body)
    body["metadata"]["deletionTimestamp"] = "2026-12-01T13:00:00Z"
    return body


def clean_up(operator: Operator, body: Manifest) -> None:
    operator.reconciler.cleanup(
        copy.deepcopy(body),
        copy.deepcopy(operator.kube.deployments),
        dict(operator.kube.jobs),
        frozenset(),
    )


def test_deletion_counts_its_restore_and_delete_jobs_once_and_forgets_the_resource() -> None:
    operator = Operator()
    drive_to_ready(operator)
    operator.recorder.shard_sets(NAMESPACE, "neighbour", ["Verified"])
    body = deleting(operator)

    with pytest.raises(CleanupPendingError):
        clean_up(operator, body)
    assert (
        operator.value("preshard_deployment_patches_total", action="restore", result="applied") == 1
    )
    assert operator.value("preshard_jobs_started_total", kind="delete") == 1
    operator.kube.finish(
        "delete",
        Outcome(command="delete", ok=True, reason=reasons.DELETED, total_bytes=4_000_000_000),
    )
    clean_up(operator, body)

    assert operator.value("preshard_jobs_succeeded_total", kind="delete") == 1
    assert operator.value("preshard_dataplane_bytes_total", kind="delete") == 4e9
    assert stages(operator.recorder) == {(NAMESPACE, "neighbour", "Verified"): 1}


def test_a_failed_delete_job_is_counted_once_however_often_deletion_retries() -> None:
    operator = Operator()
    drive_to_ready(operator)
    body = deleting(operator)
    with pytest.raises(CleanupPendingError):
        clean_up(operator, body)
    operator.kube.finish(
        "delete", Outcome(command="delete", ok=False, reason=reasons.ACCESS_DENIED)
    )
    for _ in range(3):
        with pytest.raises(CleanupPendingError, match="AccessDenied"):
            clean_up(operator, body)

    assert operator.value("preshard_jobs_failed_total", kind="delete", reason="AccessDenied") == 1


def test_a_pass_over_a_resource_being_deleted_takes_it_out_of_the_gauge() -> None:
    operator = Operator()
    drive_to_ready(operator)
    operator.recorder.shard_sets(NAMESPACE, "neighbour", ["Verified"])
    operator.body = deleting(operator)
    operator.step()

    assert stages(operator.recorder) == {(NAMESPACE, "neighbour", "Verified"): 1}


def test_no_secret_reference_uri_or_endpoint_reaches_a_scrape() -> None:
    operator = Operator()
    drive_to_ready(operator)
    scrape = generate_latest(operator.recorder.registry).decode()
    for private in (SECRET_NAME, STORAGE_URI, "private-bucket", ENDPOINT, "org/model"):
        assert private not in scrape


# The setting.


@pytest.mark.parametrize(
    ("raw", "port"), [(None, 0), ("", 0), ("0", 0), ("9090", 9090), (" 65535 ", 65535)]
)
def test_the_metrics_port_is_off_unless_set(raw: str | None, port: int) -> None:
    env = {} if raw is None else {"PRESHARD_METRICS_PORT": raw}
    assert Settings.from_env(env).metrics_port == port


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("-1", "PRESHARD_METRICS_PORT must be at least 0"),
        ("65536", "PRESHARD_METRICS_PORT must be at most 65535"),
        ("http", "PRESHARD_METRICS_PORT='http' is not an integer"),
    ],
)
def test_a_metrics_port_that_is_no_port_is_refused(raw: str, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings.from_env({"PRESHARD_METRICS_PORT": raw})


def test_the_operator_will_not_start_without_the_metrics_port_it_was_given(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # noqa: S104 - where the operator binds it
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [str(Path(sys.executable).with_name("preshard")), "run", "--liveness="],
            env={
                "PATH": os.environ.get("PATH", ""),
                "HOME": str(tmp_path),
                "KUBECONFIG": str(tmp_path / "no-cluster"),
                "PRESHARD_METRICS_PORT": str(port),
            },
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert f"preshard run: cannot serve metrics on port {port}:" in result.stderr
