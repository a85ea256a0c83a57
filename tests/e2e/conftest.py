"""Fixtures of the end-to-end tests: the chart installed into the real control plane, its
operator run as the chart's ServiceAccount, the pod runner set up to really run the data plane,
and a tiny model in the real S3 server.

The release is installed once per session; each test module runs its own operator process
(module scope) and stops it at the module's end, so two operators never reconcile the same
objects at once.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from kubernetes import client as k8s

from preshard_devenv import binaries, procs
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.podrunner import PodRunner
from preshard_devenv.s3server import S3Bucket, S3Server
from preshard_devenv.tinymodel import TinyModel, make_tiny_model
from tests.e2e import engine
from tests.support import specs, timings
from tests.support.chart import CHART, Release, adopt_crd, chart_operator
from tests.support.models import upload_model
from tests.support.namespaces import Namespaces
from tests.support.tools import Tool

# Short back-offs and a short cleanup limit keep retries within a test's patience; a small
# scratch volume is what the tiny model needs.
CHART_VALUES: Final = (
    "--set",
    "config.retryBackoffSeconds=1",
    "--set",
    "config.retryBackoffMaxSeconds=2",
    "--set",
    "config.cleanupTimeoutSeconds=30",
    "--set",
    "config.scratchSize=2Gi",
)
MODEL_PREFIX: Final = "models/tiny"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the durations the end-to-end tests measured."""
    if not timings.TIMINGS:
        return
    terminalreporter.section("end-to-end timings")
    for what, seconds in timings.TIMINGS:
        terminalreporter.write_line(f"{seconds:7.1f}s  {what}")


@pytest.fixture(scope="session")
def admin_kubectl(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Tool:
    """The pinned kubectl acting as the cluster admin, with a configuration of its own."""
    home = Path(tmp_path_factory.mktemp("kubectl-home"))
    return Tool(binaries.tool_path("kubectl"), home, cluster.admin_kubeconfig)


@pytest.fixture(scope="session")
def release(
    kube_api: k8s.ApiClient, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """`helm install` of the chart into the real control plane, once per session."""
    helm = Tool(
        binaries.tool_path("helm"),
        Path(tmp_path_factory.mktemp("helm-home")),
        cluster.admin_kubeconfig,
    )
    namespaces = Namespaces(kube_api, "e2e")
    installed = Release(f"preshard-{secrets.token_hex(3)}", namespaces.create("system"))
    adopt_crd(kube_api, installed)
    helm.run("install", *installed.of(CHART), *CHART_VALUES, "--wait", "--timeout", "90s")
    try:
        yield installed
    finally:
        helm.run(
            "uninstall", installed.name, "--namespace", installed.namespace, "--wait", check=False
        )
        namespaces.delete_all()


@pytest.fixture(scope="module")
def operator(
    release: Release,
    cluster: LocalCluster,
    kube_api: k8s.ApiClient,
    runner_engine: engine.EngineControl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    """The installed operator for one module: the chart's args and environment, acting with a
    token of the chart's ServiceAccount, so the API server checks every call against the chart's
    RBAC."""
    work_dir = tmp_path_factory.mktemp("operator")
    kubeconfig = cluster.service_account_kubeconfig(
        release.namespace, release.service_account, path=work_dir / "operator.kubeconfig"
    )
    process = chart_operator(release.deployment(kube_api), kubeconfig, work_dir)
    process.start(timeout=60)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def runner_engine(
    pod_runner: PodRunner, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[engine.EngineControl]:
    """Every serialization the runner runs uses the CPU engine behind a test switchboard.

    The Hugging Face endpoint points at a closed local port, so a Hub model fails at once (and
    a token is really sent nowhere) instead of waiting for the internet this machine lacks.
    """
    control = engine.EngineControl(Path(tmp_path_factory.mktemp("engine")))
    saved = dict(pod_runner.extra_env)
    pod_runner.extra_env.update(
        {
            "PRESHARD_ENGINE": engine.SPEC,
            engine.CONTROL_ENV: str(control.directory),
            "HF_ENDPOINT": f"http://127.0.0.1:{procs.free_port()}",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
    )
    try:
        yield control
    finally:
        control.reset()
        pod_runner.extra_env.clear()
        pod_runner.extra_env.update(saved)


@pytest.fixture(autouse=True)
def engine_switchboard(runner_engine: engine.EngineControl) -> Iterator[engine.EngineControl]:
    """The switchboard, reset after each test so a failed test leaves no engine held."""
    try:
        yield runner_engine
    finally:
        runner_engine.reset()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama-shaped model every end-to-end test shards."""
    return make_tiny_model(Path(tmp_path_factory.mktemp("model")) / "tiny")


@pytest.fixture(scope="session")
def store(s3_server: S3Server, s3_bucket: S3Bucket, tiny_model: TinyModel) -> specs.Store:
    """The session's S3 server and bucket, with the tiny model under `models/tiny/`."""
    uri = upload_model(tiny_model, s3_bucket.client, s3_bucket.name, MODEL_PREFIX)
    return specs.Store(server=s3_server, bucket=s3_bucket.name, model_uri=uri)


@pytest.fixture
def workspace(kube_api: k8s.ApiClient, namespace: str, store: specs.Store) -> str:
    """A fresh namespace with the credentials Secret of the session's S3 server."""
    specs.create_credentials(kube_api, namespace, store.server)
    return namespace
