"""The operator, running as a real process against the real control plane."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.demo import install_crd
from preshard_devenv.operatorprocess import OperatorProcess

# Short back-offs keep retries inside a test's patience.
OPERATOR_ENV = {
    "PRESHARD_RETRY_BACKOFF_SECONDS": "1",
    "PRESHARD_RETRY_BACKOFF_MAX_SECONDS": "2",
    "PRESHARD_TOOLS_IMAGE": "preshard:test",
    "PRESHARD_SERIALIZER_IMAGE": "preshard-serializer:test",
    "PRESHARD_CLEANUP_TIMEOUT_SECONDS": "30",
}


@pytest.fixture(scope="session")
def crd(kube_api: k8s.ApiClient) -> None:
    """The ShardedModel CRD, installed once."""
    install_crd(kube_api)


@pytest.fixture(scope="module")
def operator(
    cluster: LocalCluster, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """`preshard run` as the cluster admin, cluster-wide, for one test module. Module scope
    keeps it from outliving its tests: two operators must never reconcile the same objects."""
    process = OperatorProcess(
        cluster.admin_kubeconfig, tmp_path_factory.mktemp("operator"), env=OPERATOR_ENV
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def running_operator(operator: OperatorProcess) -> OperatorProcess:
    """The session's operator, started again if an earlier test left it stopped."""
    if not operator.alive():
        operator.start()
    return operator
