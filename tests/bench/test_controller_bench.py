"""The controller benchmark at smoke size, so it cannot rot.

The benchmark starts a control plane and an operator of its own (its API server audits the
operator's user), so it never shares ShardedModels with the session's operator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import controller

from preshard.builders import patching
from preshard.controller.handlers import JOB_SELECTOR, POD_SELECTOR
from preshard.settings import Settings
from preshard_devenv import workloads

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.cluster
def test_a_smoke_run_measures_every_figure(tmp_path: Path) -> None:
    output = tmp_path / "controller.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.controller",
            "--sizes",
            "3",
            "--idle-seconds",
            "3",
            "--quiet-seconds",
            "2",
            "--timeout-seconds",
            "120",
            "--other-pods",
            "4",
            "--output",
            str(output),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Targets" in done.stdout

    document = json.loads(output.read_text())
    assert document["benchmark"] == "controller"
    assert document["machine"]["cpus"] >= 1
    # Another workload's pods run beside preshard's from the start.
    assert document["results"]["options"]["other_pods"] == 4
    (result,) = document["results"]["sizes"]
    assert (result["size"], result["converged"], result["ready"]) == (3, True, 3)
    assert (result["jobs"], result["jobs_failed"]) == (3, 0)
    assert result["all_ready_s"] > 0
    assert result["baseline"]["all_complete_s"] > 0
    # The cluster's CPU beside what the cores gave: whether the machine set the pace.
    assert result["baseline"]["cluster_cpu_s"]["kube-apiserver"] > 0
    assert result["baseline"]["cpu_available_s"] > 0
    assert result["cluster_cpu_s"]["converge_available"] > 0
    assert result["ready_over_baseline"] > 0
    # The floor with targets ends when the last patched template is rolled out, after its Job.
    with_targets = result["baseline_with_targets"]
    assert with_targets["jobs_failed"] == 0
    assert with_targets["all_complete_s"] == with_targets["rollouts_complete_s"]["max"]
    assert with_targets["all_complete_s"] > with_targets["jobs_complete_s"]["max"] > 0
    assert result["ready_over_baseline_with_targets"] > 0
    # The apply's own floor: the same ShardedModels with the operator stopped.
    assert result["apply_alone_s"] > 0
    assert result["operator"]["peak_rss_mib"] > 0
    assert result["operator"]["reconcile_passes_per_shardedmodel"] >= 1
    requests = result["requests"]
    assert requests["operator_per_shardedmodel"]["POST jobs.batch"] >= 1
    assert requests["operator_per_shardedmodel"]["PATCH shardedmodels.preshard.dev/status"] >= 1
    # The audit log and the API server's per-user counter see the same operator requests.
    assert abs(requests["operator_total"] - requests["operator_total_from_metrics"]) <= 2
    # The operator started again over three Ready ShardedModels: it lists and passes over each,
    # and writes nothing.
    restart = result["restart"]
    assert 0 < restart["caught_up_s"] <= restart["settled_s"]
    assert restart["peak_rss_mib"] > 0
    moments = [at for at, mib in restart["rss_mib_by_second"] if mib > 0]
    assert moments
    assert moments == sorted(moments)
    assert restart["reconcile_passes_per_shardedmodel"] >= 1
    assert restart["requests"]["LIST shardedmodels.preshard.dev"] >= 1
    assert (restart["writes"], restart["ready_lost"]) == (0, 0)
    assert set(result["targets"]) == {
        "all_ready_s",
        "peak_rss_mib",
        "writes_per_shardedmodel",
        "idle_writes",
        "restart_peak_rss_mib",
        "restart_writes",
    }
    assert result["targets"]["restart_writes"]["met"]
    # The API server sent the operator its own Jobs and pods only, through both operators'
    # lives, though other pods ran beside them.
    assert result["stream_selectors"] == {
        "deployments.apps": [""],
        "jobs.batch": [JOB_SELECTOR],
        "pods": [POD_SELECTOR],
        "shardedmodels.preshard.dev": [""],
    }


def test_audit_lines_become_requests() -> None:
    line = json.dumps(
        {
            "kind": "Event",
            "stage": "ResponseComplete",
            "verb": "patch",
            "requestURI": "/apis/preshard.dev/v1alpha1/namespaces/m/shardedmodels/a/status",
            "objectRef": {
                "resource": "shardedmodels",
                "apiGroup": "preshard.dev",
                "subresource": "status",
            },
            "responseStatus": {"code": 409},
            "requestReceivedTimestamp": "2026-01-01T00:00:00.500000Z",
        }
    )
    request = controller.parse_audit_event(line)
    assert request == controller.Request(
        at=1767225600.5, verb="PATCH", resource="shardedmodels.preshard.dev/status", code=409
    )
    assert request.write
    started = json.loads(line) | {"stage": "ResponseStarted"}
    assert controller.parse_audit_event(json.dumps(started)) is None
    watch = json.loads(line) | {
        "verb": "watch",
        "requestURI": "/api/v1/pods?labelSelector=preshard.dev%2Fshardedmodel&watch=true",
        "objectRef": {"resource": "pods", "apiVersion": "v1"},
    }
    watched = controller.parse_audit_event(json.dumps(watch))
    assert watched is not None
    assert (watched.verb, watched.resource, watched.selector) == (
        "WATCH",
        "pods",
        "preshard.dev/shardedmodel",
    )
    assert controller.stream_selectors([watched, request]) == {
        "pods": ["preshard.dev/shardedmodel"]
    }
    discovery = json.loads(line) | {"verb": "get", "requestURI": "/apis?timeout=32s"}
    del discovery["objectRef"]
    parsed = controller.parse_audit_event(json.dumps(discovery))
    assert parsed is not None
    assert (parsed.verb, parsed.resource, parsed.write) == ("GET", "/apis", False)


def test_metrics_are_summed_over_codes_and_the_operator_is_counted_apart() -> None:
    text = "\n".join(
        [
            "# HELP apiserver_request_total Counter of apiserver requests.",
            'apiserver_request_total{code="201",component="apiserver",dry_run="",group="batch",'
            'resource="jobs",scope="resource",subresource="",verb="POST",version="v1"} 5',
            'apiserver_request_total{code="409",component="apiserver",dry_run="",group="batch",'
            'resource="jobs",scope="resource",subresource="",verb="POST",version="v1"} 2',
            'apiserver_request_total{code="200",component="",dry_run="",group="",resource="",'
            'scope="",subresource="/healthz",verb="GET",version=""} 7',
            'authenticated_user_requests{username="admin"} 11',
            'authenticated_user_requests{username="other"} 40',
        ]
    )
    before = controller.parse_metrics(text)
    assert before.requests == {("POST", "jobs.batch"): 7.0, ("GET", "(non-resource)"): 7.0}
    assert before.operator_requests == 11.0
    after = controller.MetricsSnapshot(
        requests={("POST", "jobs.batch"): 10.0, ("GET", "(non-resource)"): 7.0},
        operator_requests=12.0,
    )
    assert controller.metrics_delta(after, before) == {("POST", "jobs.batch"): 3}


def test_only_the_operator_user_is_audited() -> None:
    policy = controller.audit_policy("admin")
    assert policy["rules"] == [{"level": "Metadata", "users": ["admin"]}, {"level": "None"}]
    assert "ResponseComplete" not in policy["omitStages"]


def test_percentiles_are_seconds_after_the_start() -> None:
    assert controller.seconds_after(100.0, [101.0, 103.0, 102.0, 110.0]) == {
        "p50": 2.5,
        "p90": 10.0,
        "max": 10.0,
    }
    assert controller.seconds_after(0.0, []) == {"p50": None, "p90": None, "max": None}


def test_the_baseline_job_is_the_operators_verify_job_without_an_owner() -> None:
    job = controller.plain_verify_job(7, "baseline", Settings())
    assert "ownerReferences" not in job["metadata"]
    assert job["metadata"]["name"].startswith("model-7-")
    assert job["metadata"]["name"].endswith("-verify-1")
    assert job["spec"]["template"]["metadata"]["labels"]["preshard.dev/command"] == "verify"


def test_the_baseline_patch_is_the_operators_patch_for_the_verified_set() -> None:
    job = controller.plain_verify_job(7, "baseline", Settings())
    deployment = workloads.vllm_deployment(
        "vllm-7", namespace="baseline", container=controller.vllm_container(7), replicas=0
    )
    deployment["metadata"]["generation"] = 1
    patch = controller.target_patch(7, "baseline", deployment, Settings())
    assert patch[0] == {"op": "test", "path": "/metadata/generation", "value": 1}
    annotations = {op["path"].rsplit("/", 1)[-1]: op["value"] for op in patch[1:-1]}
    key = job["metadata"]["labels"]["preshard.dev/artifact-key"]
    assert annotations[patching.ANNOTATION_ARTIFACT_KEY.replace("/", "~1")] == key
    (container,) = patch[-1]["value"]["spec"]["containers"]
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"
