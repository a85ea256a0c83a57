"""The operator's Prometheus endpoint, scraped with a real HTTP GET while the operator takes
ShardedModels to Ready on the real control plane.

Each test reads the counters before and after, so the counts of other tests of the module do
not matter. Jobs on the `kwok-gpu-*` nodes are completed by kwok with a success message; Jobs
on `kwok-manual-0` end with the outcome the test writes, as the data plane would.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families

import preshard
from preshard.contract import reasons
from preshard.contract.outcome import Outcome, exit_code
from preshard_devenv import procs, workloads
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from tests.integration.conftest import OPERATOR_ENV
from tests.support import shardedmodels as shm
from tests.support.cluster import complete_pod, job_pods
from tests.support.specs import kwok_spec, placement

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("running_operator")]

SECRET_NAME = "s3-credentials-metrics"
SECRET_KEY_ID = "AKIAMETRICSTEST00001"
SECRET_ACCESS_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYMETRICSKEY"
STORAGE_URI = "s3://metrics-bucket-5e1d/shards"
ENDPOINT = "http://objects.metrics-test.svc:8333"

Sample = tuple[str, frozenset[tuple[str, str]]]


@pytest.fixture(scope="module")
def operator(
    cluster: LocalCluster, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The package's operator, with its metrics endpoint on a free port."""
    env = {**OPERATOR_ENV, "PRESHARD_METRICS_PORT": str(procs.free_port())}
    process = OperatorProcess(
        cluster.admin_kubeconfig, tmp_path_factory.mktemp("operator"), env=env
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


class Scrape:
    """One GET of the operator's /metrics, parsed."""

    def __init__(self, operator: OperatorProcess) -> None:
        url = f"http://127.0.0.1:{operator.extra_env['PRESHARD_METRICS_PORT']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            self.text: str = response.read().decode()
        self.samples: dict[Sample, float] = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(self.text)
            for sample in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        """A sample's value; 0 when the scrape has none (a counter not moved yet)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def series(self, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample of a name whose labels include these."""
        wanted = set(labels.items())
        return {
            sample_labels: value
            for (sample_name, sample_labels), value in self.samples.items()
            if sample_name == name and wanted <= sample_labels
        }


def wait_moved(
    operator: OperatorProcess, before: Scrape, name: str, by: float, **labels: str
) -> Scrape:
    """Wait until a sample moved by `by` (the operator counts right after its status write,
    which a test may see first); returns that scrape."""

    def check() -> Scrape | None:
        now = Scrape(operator)
        return now if now.value(name, **labels) - before.value(name, **labels) >= by else None

    return wait_for(check, timeout=30, what=f"{name}{labels} to move by {by}")


def spec(**changes: Any) -> dict[str, Any]:
    storage = {
        "uri": STORAGE_URI,
        "endpoint": ENDPOINT,
        "credentialsSecretRef": {"name": SECRET_NAME},
    }
    return kwok_spec(storage=storage, **changes)


def create_secret(api: k8s.ApiClient, namespace: str) -> None:
    """The credentials the Jobs and patched pods reference by name (the operator never reads
    them)."""
    k8s.CoreV1Api(api).create_namespaced_secret(
        namespace,
        k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=SECRET_NAME),
            string_data={
                "AWS_ACCESS_KEY_ID": SECRET_KEY_ID,
                "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            },
        ),
    )


def finish(api: k8s.ApiClient, namespace: str, suffix: str, outcome: Outcome) -> None:
    """End the Job named `*<suffix>` with this outcome in its pod's termination message."""

    def job_name() -> str | None:
        return next(
            (
                j["metadata"]["name"]
                for j in shm.jobs(api, namespace)
                if j["metadata"]["name"].endswith(suffix)
            ),
            None,
        )

    name = wait_for(job_name, what=f"a Job named *{suffix}")
    pod = wait_for(
        lambda: next(iter(job_pods(api, namespace, name)), None), what=f"a pod of Job {name}"
    )
    complete_pod(api, pod, 0 if outcome.ok else exit_code(outcome.reason), outcome.to_message())


def test_a_scrape_shows_a_sharded_model_taken_to_ready_and_no_credential(
    kube_api: k8s.ApiClient, namespace: str, running_operator: OperatorProcess
) -> None:
    before = Scrape(running_operator)
    assert before.value("preshard_build_info", version=preshard.__version__) == 1
    create_secret(kube_api, namespace)
    workloads.create_deployment(kube_api, namespace, "vllm")
    workloads.create_sharded_model(kube_api, namespace, "llama", spec())
    shm.wait_ready(kube_api, namespace, "llama", operator=running_operator)

    after = wait_moved(running_operator, before, "preshard_time_to_ready_seconds_count", 1)
    assert after.value("preshard_reconcile_passes_total") > before.value(
        "preshard_reconcile_passes_total"
    )
    assert after.value("preshard_reconcile_duration_seconds_count") > before.value(
        "preshard_reconcile_duration_seconds_count"
    )
    # kwok's verify finds the set whole: a probe, no GPU Job.
    started = "preshard_jobs_started_total"
    assert after.value(started, kind="verify") - before.value(started, kind="verify") == 1
    assert after.value(started, kind="serialize") == before.value(started, kind="serialize")
    checks = "preshard_verifications_total"
    probe = {"check": "probe", "reason": reasons.VERIFIED}
    assert after.value(checks, **probe) - before.value(checks, **probe) == 1
    patches = "preshard_deployment_patches_total"
    applied = {"action": "patch", "result": "applied"}
    assert after.value(patches, **applied) - before.value(patches, **applied) >= 1
    assert after.series("preshard_shard_sets", namespace=namespace) == {
        frozenset({("namespace", namespace), ("shardedmodel", "llama"), ("stage", "Verified")}): 1
    }
    for private in (SECRET_ACCESS_KEY, SECRET_KEY_ID, SECRET_NAME, STORAGE_URI, ENDPOINT):
        assert private not in after.text


def test_each_jobs_result_and_figures_count_once_and_a_deleted_model_leaves_the_gauge(
    kube_api: k8s.ApiClient, namespace: str, running_operator: OperatorProcess
) -> None:
    before = Scrape(running_operator)
    manual = placement("manual")
    workloads.create_sharded_model(
        kube_api,
        namespace,
        "qwen",
        spec(serialization=manual, verification=manual, targets=[]),
    )
    finish(
        kube_api,
        namespace,
        "-verify-1",
        Outcome(command="verify", ok=False, reason=reasons.MANIFEST_MISSING),
    )
    finish(
        kube_api,
        namespace,
        "-serialize-1",
        Outcome(
            command="serialize",
            ok=True,
            reason=reasons.SERIALIZED,
            total_bytes=3_000_000_000,
            seconds=12.0,
        ),
    )
    finish(
        kube_api,
        namespace,
        "-verify-2",
        Outcome(
            command="verify",
            ok=True,
            reason=reasons.VERIFIED,
            tensor_parallel_size=2,
            total_bytes=3_000_000_000,
            seconds=0.5,
        ),
    )
    shm.wait_ready(kube_api, namespace, "qwen", operator=running_operator)
    ready = wait_moved(running_operator, before, "preshard_time_to_ready_seconds_count", 1)

    # More passes (each annotation change is a watch event) count no Job a second time.
    for value in ("1", "2", "3"):
        shm.patch(kube_api, namespace, "qwen", {"metadata": {"annotations": {"poke": value}}})
    later = wait_moved(
        running_operator,
        ready,
        "preshard_reconcile_passes_total",
        3,
    )
    for scrape in (ready, later):
        assert (
            scrape.value("preshard_dataplane_bytes_total", kind="serialize")
            - before.value("preshard_dataplane_bytes_total", kind="serialize")
            == 3e9
        )
        assert (
            scrape.value("preshard_dataplane_throughput_bytes_per_second_count", kind="serialize")
            - before.value("preshard_dataplane_throughput_bytes_per_second_count", kind="serialize")
            == 1
        )
        failed = {"kind": "verify", "reason": reasons.MANIFEST_MISSING}
        assert (
            scrape.value("preshard_jobs_failed_total", **failed)
            - before.value("preshard_jobs_failed_total", **failed)
            == 1
        )
        probe = {"check": "probe", "reason": reasons.MANIFEST_MISSING}
        assert (
            scrape.value("preshard_verifications_total", **probe)
            - before.value("preshard_verifications_total", **probe)
            == 1
        )
        assert (
            scrape.value("preshard_time_to_ready_seconds_count")
            - before.value("preshard_time_to_ready_seconds_count")
            == 1
        )
    assert later.series("preshard_shard_sets", namespace=namespace, shardedmodel="qwen")

    shm.delete(kube_api, namespace, "qwen")
    wait_for(lambda: shm.gone(kube_api, namespace, "qwen"), what="deletion")
    gone = Scrape(running_operator)
    assert gone.series("preshard_shard_sets", namespace=namespace, shardedmodel="qwen") == {}
