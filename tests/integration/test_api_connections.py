"""A burst of new ShardedModels does not open a connection per request.

kopf adds its finalizer to every new ShardedModel at once. With kopf's own HTTP session, a
burst of a few hundred opened as many TLS connections to the API server, and their buffers
stayed with the process (the jump of the operator's memory at 1000 ShardedModels applied in a
few seconds). The operator's login handler gives kopf a session with a bounded pool. This test
runs the operator against the real API server, applies a burst, and counts the operator's
connections to the API server while it handles them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, cast
from urllib.parse import urlsplit

import pytest
from kubernetes import client as k8s

from preshard.api import models
from preshard.controller.handlers import api_connection_limit
from preshard_devenv.controlplane import LocalCluster
from preshard_devenv.kubeconfig import api_client
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for

pytestmark = pytest.mark.cluster

BURST: Final = 150
# The synchronous Kubernetes client of the reconciler keeps a pool of its own (urllib3's
# `connection_pool_maxsize`, five per CPU by default) beside kopf's session.
RECONCILER_POOL: Final = 5 * (os.cpu_count() or 1)
ESTABLISHED: Final = "01"


class ConnectionCounter:
    """The most established TCP connections a process held to one port, sampled every 20 ms
    from /proc: the sockets among its file descriptors, looked up in its network namespace's
    TCP table."""

    def __init__(self, pid: int, port: int) -> None:
        self._pid = pid
        self._port = f"{port:04X}"
        self._stop = threading.Event()
        self.most = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ConnectionCounter:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def count(self) -> int:
        """Its established connections to the port now."""
        sockets = set()
        for fd in Path(f"/proc/{self._pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    sockets.add(target[len("socket:[") : -1])
        found = 0
        for table in ("tcp", "tcp6"):
            lines = Path(f"/proc/{self._pid}/net/{table}").read_text().splitlines()[1:]
            for line in lines:
                fields = line.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                if state == ESTABLISHED and remote.endswith(f":{self._port}") and inode in sockets:
                    found += 1
        return found

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError):
                self.most = max(self.most, self.count())


@pytest.fixture
def own_operator(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """An operator of this test's namespace only (no other operator runs in this module)."""
    process = OperatorProcess(
        cluster.admin_kubeconfig,
        tmp_path,
        env={"PRESHARD_TOOLS_IMAGE": "preshard:test"},
        args=("run", "--namespace", namespace),
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


def spec(index: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{models.GROUP}/{models.VERSION}",
        "kind": "ShardedModel",
        "metadata": {"name": f"model-{index}"},
        "spec": {
            "model": {"id": f"org/model-{index}", "revision": "abc123"},
            "storage": {"uri": "s3://models/shards", "endpoint": "http://s3.storage:8333"},
            "tensorParallelSizes": [2],
        },
    }


def test_a_burst_of_new_shardedmodels_shares_a_bounded_pool(
    cluster: LocalCluster, own_operator: OperatorProcess, namespace: str
) -> None:
    assert own_operator.process is not None
    port = urlsplit(cluster.server).port
    assert port is not None
    bound = api_connection_limit([namespace]) + RECONCILER_POOL

    def create(index: int) -> None:
        with api_client(cluster.admin_kubeconfig) as api:
            k8s.CustomObjectsApi(api).create_namespaced_custom_object(
                models.GROUP, models.VERSION, namespace, models.PLURAL, spec(index)
            )

    with (
        ConnectionCounter(own_operator.process.pid, port) as counter,
        api_client(cluster.admin_kubeconfig) as api,
    ):
        objects = k8s.CustomObjectsApi(api)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(create, range(BURST)))
        wait_for(
            lambda: (
                len(items := listed(objects, namespace)) == BURST
                and all(i["metadata"].get("finalizers") for i in items)
            ),
            timeout=120,
            what=f"{BURST} finalizers",
        )
    # Every one of them was handled, through at most the bounded pool and the reconciler's.
    assert 0 < counter.most <= bound, (counter.most, bound)

    with api_client(cluster.admin_kubeconfig) as api:
        objects = k8s.CustomObjectsApi(api)
        for index in range(BURST):
            objects.delete_namespaced_custom_object(
                models.GROUP, models.VERSION, namespace, models.PLURAL, f"model-{index}"
            )
        wait_for(
            lambda: not listed(objects, namespace),
            timeout=120,
            what="the ShardedModels to be gone",
        )


def listed(objects: k8s.CustomObjectsApi, namespace: str) -> list[dict[str, Any]]:
    """The ShardedModels of the namespace."""
    found = cast(
        "dict[str, list[dict[str, Any]]]",
        objects.list_namespaced_custom_object(
            models.GROUP, models.VERSION, namespace, models.PLURAL
        ),
    )
    return found["items"]
