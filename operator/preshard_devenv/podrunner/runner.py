"""The runner itself: the kubelet of node `preshard-runner` as threads of the test process. It
keeps the node Ready, watches the pods bound to it and gives each new one a `PodRun`, and
serves their logs through the node's log endpoint."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import urllib3
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from preshard_devenv import nodes
from preshard_devenv.kubeconfig import api_client as kubeconfig_api_client
from preshard_devenv.kubeletlogs import LogServer
from preshard_devenv.podrunner.containers import MAX_KILL_GRACE
from preshard_devenv.podrunner.images import LocalImage, image_repository
from preshard_devenv.podrunner.node import heartbeat, wait_schedulable
from preshard_devenv.podrunner.pod import RETRY_SECONDS, Pod, PodRun

NODE: Final = nodes.RUNNER_NODE

logger = logging.getLogger(__name__)


class PodRunner:
    """The kubelet of node `preshard-runner`, as threads of the test process."""

    def __init__(
        self,
        kubeconfig: Path,
        work_dir: Path,
        *,
        extra_env: Mapping[str, str] | None = None,
        images: Mapping[str, LocalImage] | None = None,
        node_name: str = NODE,
        heartbeat_seconds: float = 10.0,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.work_dir = work_dir
        self.extra_env = dict(extra_env or {})
        self.images = dict(images or {})
        """Image repositories (no tag) and what they provide here; tests may add to it."""
        self.node_name = node_name
        self.heartbeat_seconds = heartbeat_seconds
        self._stop = threading.Event()
        self._pods: dict[str, PodRun] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._watcher: k8s_watch.Watch | None = None
        self._log_server: LogServer | None = None

    @property
    def stopping(self) -> bool:
        """Whether `stop()` was called."""
        return self._stop.is_set()

    def image_for(self, image: str) -> LocalImage:
        """What `image` provides here: its entry in `images`, else the project's virtualenv."""
        return self.images.get(image_repository(image), LocalImage())

    def new_api(self) -> k8s.ApiClient:
        """A fresh admin API client; each thread uses its own."""
        return kubeconfig_api_client(self.kubeconfig)

    def start(self, *, ready_timeout: float = 60.0) -> PodRunner:
        """Mark the node Ready, start watching its pods, and wait until it can be scheduled."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._log_server = LogServer(self._read_log).start()
        with self.new_api() as api:
            self._heartbeat(api)
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch")):
            thread = threading.Thread(target=target, name=f"podrunner-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._wait_schedulable(ready_timeout)
        return self

    def stop(self) -> None:
        """Kill every running container and stop the runner's threads."""
        self._stop.set()
        if self._watcher is not None:
            # Unblocks the watch thread's read at once instead of at the watch's timeout.
            self._watcher.stop()  # type: ignore[no-untyped-call]
        with self._lock:
            runs = list(self._pods.values())
        for run in runs:
            run.thread.join(timeout=MAX_KILL_GRACE + 5)
        for thread in self._threads:
            thread.join(timeout=10)
        if self._log_server is not None:
            self._log_server.stop()

    def logs(self, namespace: str, pod: str, container: str) -> str:
        """A container's output so far (stdout and stderr together)."""
        return self._read_log(namespace, pod, container) or ""

    def _read_log(self, namespace: str, pod: str, container: str) -> str | None:
        for path in (self.work_dir / namespace).glob(f"{pod}-*/logs/{container}.log"):
            return path.read_text(errors="replace")
        return None

    # The node.

    def _heartbeat_loop(self) -> None:
        with self.new_api() as api:
            while not self._stop.wait(self.heartbeat_seconds):
                try:
                    self._heartbeat(api)
                except (ApiException, OSError, urllib3.exceptions.HTTPError):
                    logger.warning("node heartbeat failed; retrying", exc_info=True)

    def _heartbeat(self, api: k8s.ApiClient) -> None:
        heartbeat(api, self.node_name, self._log_port())

    def _log_port(self) -> int:
        assert self._log_server is not None  # noqa: S101 - started first
        return self._log_server.port

    def _wait_schedulable(self, timeout: float) -> None:
        with self.new_api() as api:
            wait_schedulable(api, self.node_name, timeout)

    # The pods.

    def _watch_loop(self) -> None:
        with self.new_api() as api:
            core = k8s.CoreV1Api(api)
            selector = f"spec.nodeName={self.node_name}"
            version: str | None = None
            while not self._stop.is_set():
                try:
                    if version is None:
                        listed = core.list_pod_for_all_namespaces(field_selector=selector)
                        for pod in listed.items:
                            self._handle("ADDED", api.sanitize_for_serialization(pod))
                        version = listed.metadata.resource_version if listed.metadata else ""
                    version = self._watch(core, selector, version or "")
                except ApiException as error:
                    # 410: the resource version expired; anything else: list again after a pause.
                    version = None
                    if error.status != 410:
                        logger.warning("watching pods failed; listing again", exc_info=True)
                        self._stop.wait(RETRY_SECONDS)
                except (OSError, urllib3.exceptions.HTTPError):
                    version = None
                    if not self._stop.is_set():
                        logger.warning("watching pods failed; listing again", exc_info=True)
                        self._stop.wait(RETRY_SECONDS)

    def _watch(self, core: k8s.CoreV1Api, selector: str, version: str) -> str:
        # The watch helper has no type annotations.
        watcher = k8s_watch.Watch()  # type: ignore[no-untyped-call]
        self._watcher = watcher
        for event in watcher.stream(  # type: ignore[no-untyped-call]
            core.list_pod_for_all_namespaces,
            field_selector=selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=30,
        ):
            if self._stop.is_set():
                break
            if event["type"] != "BOOKMARK":
                self._handle(event["type"], event["raw_object"])
        return str(watcher.resource_version or version)

    def _handle(self, kind: str, pod: Pod) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            run = self._pods.get(uid)
        if kind == "DELETED":
            if run is not None:
                run.deleting.set()
            return
        if pod["metadata"].get("deletionTimestamp"):
            if run is not None:
                run.deleting.set()
            else:
                self._delete_now(pod)
            return
        if run is not None or self._stop.is_set():
            return
        phase = (pod.get("status") or {}).get("phase", "Pending")
        if phase != "Pending":
            return
        run = PodRun(self, pod)
        with self._lock:
            self._pods[uid] = run
        run.thread.start()

    def _delete_now(self, pod: Pod) -> None:
        meta = pod["metadata"]
        with self.new_api() as api:
            try:
                k8s.CoreV1Api(api).delete_namespaced_pod(
                    meta["name"],
                    meta["namespace"],
                    body=k8s.V1DeleteOptions(
                        grace_period_seconds=0,
                        preconditions=k8s.V1Preconditions(uid=meta["uid"]),
                    ),
                )
            except ApiException as error:
                if error.status not in (404, 409):
                    raise
