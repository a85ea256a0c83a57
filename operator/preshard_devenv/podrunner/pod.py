"""One pod's life on the runner node, in a thread of its own: its volumes, its init containers
in order, then its containers supervised under the pod's restart policy, each change written
to the pod's status; and its end (the processes killed, the pod removed) once it is deleted."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard_devenv.podrunner.containers import ContainerRun, kill_all
from preshard_devenv.podrunner.images import LocalImage
from preshard_devenv.podrunner.podspec import ConfigError, identity
from preshard_devenv.podrunner.status import now, pod_status
from preshard_devenv.podrunner.volumes import PodSources

RETRY_SECONDS: Final = 1.0
_POLL_SECONDS: Final = 0.1
_PROBE_SECONDS: Final = 1.0

logger = logging.getLogger(__name__)

Pod = dict[str, Any]


class Kubelet(Protocol):
    """What a pod's run needs of the runner that plays its node's kubelet."""

    @property
    def work_dir(self) -> Path:
        """Where the pods' directories go."""

    @property
    def extra_env(self) -> Mapping[str, str]:
        """What every container gets in its environment, below its image's and its own."""

    @property
    def stopping(self) -> bool:
        """Whether the runner is stopping."""

    def new_api(self) -> k8s.ApiClient:
        """A fresh admin API client."""

    def image_for(self, image: str) -> LocalImage:
        """What `image` provides on this machine."""


class PodRun:
    """Runs one pod to completion (or until it is deleted) in a thread of its own."""

    def __init__(self, runner: Kubelet, pod: Pod) -> None:
        self.runner = runner
        self.pod = pod
        self.namespace, self.name, self.uid = identity(pod)
        self.dir = runner.work_dir / self.namespace / f"{self.name}-{self.uid[:8]}"
        # Short, because programs put Unix sockets there (vLLM's ZeroMQ IPC paths), and a
        # socket path is limited to 107 bytes.
        self.tmp = Path(tempfile.gettempdir()) / f"preshard-pod-{self.uid[:8]}"
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.init_runs = [ContainerRun(c, init=True) for c in spec.get("initContainers") or []]
        self.runs = [ContainerRun(c, init=False) for c in spec.get("containers") or []]
        self.phase = "Pending"
        self.initialized = not self.init_runs
        self.start_time = now()
        self.deleting = threading.Event()
        self.thread = threading.Thread(target=self._main, name=f"pod-{self.name}", daemon=True)
        self._next_probe = 0.0
        self._api = runner.new_api()
        self.sources = PodSources(self._api, pod, self.dir)

    # The pod's life.

    def _main(self) -> None:
        with self._api:
            self._main_with_api()

    def _main_with_api(self) -> None:
        try:
            self._run()
        # A runner bug must fail the pod visibly rather than leave it hanging.
        except Exception:
            logger.exception("pod %s/%s: the runner failed", self.namespace, self.name)
            self.phase = "Failed"
            with contextlib.suppress(ApiException):
                self._publish(reason="RunnerError", message="the test pod runner failed")
        finally:
            self._kill_all()
            if self.deleting.is_set():
                self._remove()

    def _run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._publish()
        # Like the kubelet, a volume that cannot be mounted yet keeps the pod creating.
        if not self._wait_configured(self.sources.mount_volumes, reason="ContainerCreating"):
            return
        for run in self.init_runs:
            if not self._run_init(run):
                return
        self.initialized = True
        for run in self.runs:
            if not self._wait_configured(lambda run=run: self._start(run), run):  # type: ignore[misc]
                return
        self.phase = "Running"
        self._publish()
        self._supervise()

    def _wait_configured(
        self,
        attempt: Callable[[], None],
        run: ContainerRun | None = None,
        *,
        reason: str = "CreateContainerConfigError",
    ) -> bool:
        """Retry a step that fails with ConfigError until it works or the pod goes away."""
        while not self._stopping():
            try:
                attempt()
                return True
            except ConfigError as error:
                for waiting in [run] if run else self._pending_runs():
                    waiting.state = {"waiting": {"reason": reason, "message": str(error)}}
                self._publish()
                self._sleep(RETRY_SECONDS)
        return False

    def _pending_runs(self) -> list[ContainerRun]:
        runs = self.runs if self.initialized else self.init_runs[:1] or self.runs
        return [r for r in runs if r.process is None and not r.server and r.terminated is None]

    def _run_init(self, run: ContainerRun) -> bool:
        backoff = RETRY_SECONDS
        while not self._stopping():
            if not self._wait_configured(lambda: self._start(run), run):
                return False
            self._publish()
            code = self._wait_exit(run)
            if code is None:
                return False
            self._publish()
            if code == 0:
                return True
            if self.restart_policy == "Never":
                self.phase = "Failed"
                for main in self.runs:
                    main.state = {"waiting": {"reason": "PodInitializing"}}
                self._publish()
                return False
            self._restart_later(run, backoff)
            backoff = min(backoff * 2, 10.0)
        return False

    def _supervise(self) -> None:
        backoffs = {run.name: RETRY_SECONDS for run in self.runs}
        while not self._stopping():
            changed = False
            for run in self.runs:
                exited = run.process is not None and run.process.poll() is not None
                if not exited or run.terminated is not None:
                    continue
                run.record_exit()
                changed = True
                exit_code = run.terminated["exitCode"] if run.terminated else 0
                if self.restart_policy == "Always" or (
                    self.restart_policy == "OnFailure" and exit_code != 0
                ):
                    self._publish()
                    self._restart_later(run, backoffs[run.name])
                    backoffs[run.name] = min(backoffs[run.name] * 2, 10.0)
                    if self._stopping():
                        return
                    self._wait_configured(lambda run=run: self._start(run), run)  # type: ignore[misc]
            if self._probe_due():
                probed = [run.probe() for run in self.runs]  # every one, not up to a change
                changed = any(probed) or changed
            if all(r.terminated is not None for r in self.runs):
                codes = [r.terminated["exitCode"] for r in self.runs if r.terminated]
                self.phase = "Succeeded" if all(c == 0 for c in codes) else "Failed"
                self._publish()
                return
            if changed:
                self._publish()
            self._sleep(_POLL_SECONDS)

    def _probe_due(self) -> bool:
        now_ = time.monotonic()
        if now_ < self._next_probe:
            return False
        self._next_probe = now_ + _PROBE_SECONDS
        return True

    def _restart_later(self, run: ContainerRun, delay: float) -> None:
        run.last_state = run.state
        run.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:.0f}s restarting failed container={run.name} "
                f"pod={self.name}_{self.namespace}({self.uid})",
            }
        }
        run.restart_count += 1
        run.process = None
        run.probe_ok = False
        self._publish()
        self._sleep(delay)

    def _wait_exit(self, run: ContainerRun) -> int | None:
        if run.server:
            # An init container whose program is not here (its image's entrypoint) is taken
            # as done: nothing would ever finish it otherwise.
            run.server = False
            run.state = {
                "terminated": {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": run.started_at,
                    "finishedAt": now(),
                }
            }
            return 0
        while not self._stopping():
            if run.process is not None and run.process.poll() is not None:
                run.record_exit()
                return run.terminated["exitCode"] if run.terminated else 0
            self._sleep(_POLL_SECONDS)
        return None

    def _stopping(self) -> bool:
        return self.deleting.is_set() or self.runner.stopping

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._stopping():
            time.sleep(min(_POLL_SECONDS, seconds))

    # Containers.

    def _start(self, run: ContainerRun) -> None:
        image = self.runner.image_for(str(run.spec.get("image", "")))
        env = self.sources.environment(run.spec)
        paths = self.sources.path_map(run.spec)
        run.start(
            image,
            env,
            paths,
            pod_dir=self.dir,
            tmp=self.tmp,
            hostname=self.name,
            extra_env=self.runner.extra_env,
        )

    def _kill_all(self) -> None:
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds") or 30)
        kill_all([*self.init_runs, *self.runs], grace)

    def _remove(self) -> None:
        core = k8s.CoreV1Api(self.runner.new_api())
        try:
            core.delete_namespaced_pod(
                self.name,
                self.namespace,
                body=k8s.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=k8s.V1Preconditions(uid=self.uid)
                ),
            )
        except ApiException as error:
            if error.status not in (404, 409):
                raise
        finally:
            core.api_client.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # Status.

    def _publish(self, reason: str | None = None, message: str | None = None) -> None:
        if self.deleting.is_set():
            return
        status = self.status()
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        try:
            k8s.CoreV1Api(self._api).patch_namespaced_pod_status(
                self.name,
                self.namespace,
                {"status": status},
                _content_type="application/merge-patch+json",
            )
        except ApiException as error:
            # Deleted meanwhile: the watch is about to say so.
            if error.status != 404:
                raise

    def status(self) -> dict[str, Any]:
        """The pod status the kubelet would write now."""
        return pod_status(self.phase, self.initialized, self.init_runs, self.runs, self.start_time)
