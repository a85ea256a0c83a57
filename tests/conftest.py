"""Session-wide fixtures: the real S3 server and the real control plane.

Every fixture here owns the processes it starts and stops them by pid, also when a test fails
or the run is interrupted (try/finally, plus an atexit guard in `LocalCluster`). Each test
session gets its own temporary directories and free ports, so two runs on one machine do not
collide.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from preshard_devenv import binaries, engine, procs
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.podrunner import PodRunner
from preshard_devenv.procs import DevEnvError
from preshard_devenv.s3server import S3Bucket, S3Server, create_bucket, start_s3_server

_ROOT = Path(__file__).resolve().parent.parent
_LOG_START = pytest.StashKey[dict[OperatorProcess, int]]()
_REPORTED_LINES = 200


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop on SIGTERM (a cancelled CI job, `timeout`) and SIGHUP as on Ctrl-C, so fixtures
    tear down and stop their processes instead of leaving them running."""
    procs.interrupt_on_signals()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build missing cluster binaries before the first test, outside any test's timeout."""
    if session.config.option.collectonly:
        return
    if not any("cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(message: str) -> None:
        if reporter is not None:
            reporter.write_line(message)

    try:
        binaries.ensure_all(log=say)
    except DevEnvError as error:
        pytest.exit(f"the local cluster's binaries are missing and could not be built: {error}")


def _operators(item: pytest.Item) -> list[OperatorProcess]:
    """The operators a test used, each once (`running_operator` is `operator`, started)."""
    funcargs = getattr(item, "funcargs", {})
    return list(dict.fromkeys(v for v in funcargs.values() if isinstance(v, OperatorProcess)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Remember where each operator's log stood when the test body began."""
    item.stash[_LOG_START] = {op: len(op.log()) for op in _operators(item)}
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries what the operator logged while it ran: in CI that log is
    the only account of why the operator did not do what the test waited for."""
    report = yield
    if report.when == "call" and report.failed:
        starts = item.stash.get(_LOG_START, {})
        for operator in _operators(item):
            lines = operator.log()[starts.get(operator, 0) :].splitlines()
            report.sections.append(
                ("operator log during the test", "\n".join(lines[-_REPORTED_LINES:]))
            )
    return report


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on loopback with one random key pair, for the whole session."""
    server = start_s3_server(Path(tmp_path_factory.mktemp("s3")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server) -> S3Bucket:
    """A bucket created for this test session."""
    return create_bucket(s3_server, f"preshard-test-{secrets.token_hex(4)}")


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The test process's environment pointed at the S3 server (credentials, endpoint, region)."""
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local control plane (etcd, kube-apiserver, controllers, scheduler, kwok and the test
    nodes) for the whole session."""
    local = LocalCluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        local.start()
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def kube_api(cluster: LocalCluster) -> Iterator[k8s.ApiClient]:
    """An API client acting as the cluster admin (`system:masters`)."""
    with cluster.api_client() as api:
        yield api


@pytest.fixture
def namespace(kube_api: k8s.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards without waiting."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{secrets.token_hex(3)}"
    core = k8s.CoreV1Api(kube_api)
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(scope="session")
def pod_runner(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PodRunner]:
    """The kubelet of node `preshard-runner`: runs the pods bound there as local processes.

    Containers get `PYTHONPATH` set to the project root (so test modules such as
    `tests.e2e.engine` import) and the tools image's tensorizer bundle; tests add what else their
    containers need to `pod_runner.extra_env`, and the images they run to `pod_runner.images`.
    """
    runner = PodRunner(
        cluster.admin_kubeconfig,
        Path(tmp_path_factory.mktemp("pods")),
        extra_env={"PYTHONPATH": str(_ROOT), **engine.tools_env()},
    )
    try:
        runner.start()
        yield runner
    finally:
        runner.stop()
