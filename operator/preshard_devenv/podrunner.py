"""A test-only kubelet: runs the pods bound to node `preshard-runner` as local processes.

kwok fakes the pods of the GPU nodes; this runner makes the work of a pod really happen, so a
Job's `preshard verify` reads real objects from the test S3 server and reports back through
the termination message, exactly as the controller will read it in a cluster.

Supported, with the kubelet's semantics:
- The node: its Ready condition and its Lease in `kube-node-lease` are renewed while the runner
  runs (the node lifecycle controller would otherwise taint it and evict its pods).
- Pods with `spec.nodeName=preshard-runner` that are Pending when the runner sees them: init
  containers in order (restarted on failure unless `restartPolicy: Never`), then the
  containers, each as a local process in its own process group; pod phase Pending → Running →
  Succeeded/Failed following `restartPolicy` (`Never`, `OnFailure`, `Always`); container and
  init container statuses with `restartCount`, `state`/`lastState` and `terminated.exitCode`,
  `reason` (`Completed`/`Error`), `message`; pod conditions.
- Images: a container's image is looked up in the runner's `images` (by repository, so
  `vllm/vllm-openai` matches every tag of it). A `LocalImage` says what that image provides
  here: a directory of its programs (a virtualenv's `bin`, searched first), its environment
  (`ENV`) and its entrypoint (used when the container has no `command`). Other images are the
  project's own virtualenv with no entrypoint.
- Executables: argv[0] `preshard` runs the project's console script of the image's
  virtualenv (else the current one), `python`/`python3` its interpreter; any other executable
  found on the container's PATH (the image's `bin`, then `/usr/local/bin:/usr/bin:/bin`, or an
  absolute path) runs as is. A container without a command or entrypoint, or whose executable
  does not exist here, is a long-running server: Running and Ready, nothing executes.
- Probes: an `httpGet` readiness probe (port by number or by name, path, `periodSeconds`,
  `failureThreshold` is not modelled) is polled on 127.0.0.1; the container is Ready once it
  answers 2xx or 3xx, and not Ready while it does not. Without one a running container is Ready.
- Environment: `env` with `value` (`$(VAR)` expansion, `$$` escapes) and `valueFrom`
  (`secretKeyRef`, `configMapKeyRef`, `optional` honoured; `fieldRef` for `metadata.name`,
  `metadata.namespace`, `metadata.uid`, `metadata.labels['k']`, `metadata.annotations['k']`,
  `spec.nodeName`, `spec.serviceAccountName`, `status.podIP`, `status.hostIP`), and `envFrom`
  (`secretRef`, `configMapRef`, `prefix`, `optional`). A missing Secret/ConfigMap or key gives
  the kubelet's `CreateContainerConfigError` waiting state with the kubelet's message; the
  runner retries every second, so creating the Secret later starts the container. `$(VAR)` is
  expanded in `command` and `args`. Secrets are read with the runner's admin credentials.
  Every container also gets the runner's `extra_env` (like an image's environment: the
  container's own `env` wins), `HOME` in the pod's directory, a short `TMPDIR` of the pod's
  own, and a minimal PATH;
  the test process's own environment is NOT inherited.
- Volumes: a Secret or ConfigMap a volume needs that does not exist yet keeps the pod's
  containers waiting in `ContainerCreating`, as the kubelet does, and is retried every second.
  `emptyDir` (a directory per pod), `secret` and `configMap` (`items`, `mode`,
  `defaultMode`, `optional`; Secret and token files keep only the owner's permission bits, so
  the API server's default 0644 becomes 0600), `projected` (secrets, configMaps,
  `downwardAPI` field items and `serviceAccountToken`, a real bound token from the
  TokenRequest API) and `downwardAPI`, `hostPath` (the path itself). `subPath` is honoured.
- Paths: a container sees its volumes at local directories, not at `mountPath`. The runner
  rewrites every occurrence of a mount path (as a whole path or a path prefix, longest mount
  first) in `command`, `args`, `env` values and `workingDir` to the local directory, and the
  container's `terminationMessagePath` to a local file.
- Termination message: the env var `PRESHARD_TERMINATION_LOG` names a local file per
  container (the data plane writes its outcome there instead of `/dev/termination-log`); up to
  4096 bytes of it become `state.terminated.message`. `terminationMessagePolicy:
  FallbackToLogsOnError` uses the end of the container's output when that file is empty and
  the container failed.
- Deletion: a pod with a `deletionTimestamp` gets its processes killed (SIGTERM, then SIGKILL
  after its grace period, at most 5 s) and is then removed with grace period 0.
- Output: each container's stdout and stderr go to `<work dir>/<namespace>/<pod>/logs/
  <container>.log`; `PodRunner.logs()` reads them, and so does the API's log endpoint
  (`kubectl logs`, the operator's progress reads): the node serves it
  (`preshard_devenv.kubeletlogs`) at its only address, 127.0.0.1.

Not supported: pulling images (every container runs on this machine), liveness, startup and
exec/TCP probes, lifecycle hooks, resource limits, sidecar init containers
(`restartPolicy: Always` on an init container), ephemeral containers, PersistentVolumeClaims
and other volume types (a pod using one stays Pending in `ContainerCreating`), read-only mounts
(not enforced), `resourceFieldRef`, service environment variables, networking (processes share the
machine's loopback), pods that were already Running before the runner started (left alone).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import urllib3
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from preshard_devenv import nodes
from preshard_devenv.kubeconfig import api_client as kubeconfig_api_client
from preshard_devenv.kubeletlogs import LogServer

NODE: Final = nodes.RUNNER_NODE
TERMINATION_LOG_ENV: Final = "PRESHARD_TERMINATION_LOG"
CONTAINER_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
_MESSAGE_LIMIT: Final = 4096
_FALLBACK_LOG_LINES: Final = 80
_FALLBACK_LOG_BYTES: Final = 2048
_LEASE_SECONDS: Final = 40
_MAX_KILL_GRACE: Final = 5.0
_RETRY_SECONDS: Final = 1.0
_POLL_SECONDS: Final = 0.1
_PROBE_SECONDS: Final = 1.0
_PRIVATE: Final = 0o700
_TERMINAL: Final = frozenset({"Succeeded", "Failed"})

logger = logging.getLogger(__name__)

Pod = dict[str, Any]


@dataclass(frozen=True)
class LocalImage:
    """What a container image provides on this machine."""

    bin_dir: Path | None = None
    """Its programs (a virtualenv's `bin`), searched before the container's PATH."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Its `ENV`: a container's own `env` wins over it."""
    entrypoint: tuple[str, ...] = ()
    """Its `ENTRYPOINT`, run when a container sets `args` but no `command`."""


def image_repository(image: str) -> str:
    """`image` without its tag or digest: `vllm/vllm-openai:v0.34.0` -> `vllm/vllm-openai`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


class ConfigError(Exception):
    """A container cannot be configured yet (the kubelet's CreateContainerConfigError)."""


def now() -> str:
    """The current time as Kubernetes writes it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expand(text: str, lookup: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`,
    anything else (an undefined name, a lone `$`) stays as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            following = text[i + 1]
            if following == "$":
                out.append("$")
                i += 2
                continue
            if following == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(lookup[name] if name in lookup else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


class PathMap:
    """Rewrites container paths (mount paths) to the local directories behind them."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        # Longest first, so a nested mount wins over the mount that contains it.
        self._pairs = sorted(mapping.items(), key=lambda kv: len(kv[0]), reverse=True)
        alternatives = "|".join(re.escape(p.rstrip("/") or "/") for p, _ in self._pairs)
        self._pattern = (
            re.compile(rf"(?<![\w.\-/])({alternatives})(?=/|$|[^\w.\-/])") if self._pairs else None
        )
        self._lookup = {p.rstrip("/") or "/": local for p, local in self._pairs}

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self._lookup[m.group(1)], text)


@dataclass
class ContainerRun:
    """One container of a running pod, and what the kubelet would report about it."""

    spec: dict[str, Any]
    init: bool
    restart_count: int = 0
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "PodInitializing"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    server: bool = False
    started_at: str = ""
    log_path: Path | None = None
    message_path: Path | None = None
    probe_url: str | None = None
    """The readiness probe's URL; None means Ready while running."""
    probe_ok: bool = False

    @property
    def name(self) -> str:
        """The container's name."""
        return str(self.spec["name"])

    @property
    def terminated(self) -> dict[str, Any] | None:
        """The terminated state, if the container has exited."""
        value = self.state.get("terminated")
        return value if isinstance(value, dict) else None

    @property
    def running(self) -> bool:
        """Whether the container is running (a server or a live process)."""
        return "running" in self.state

    @property
    def ready(self) -> bool:
        """Whether the container is running and its readiness probe, if any, passes."""
        return self.running and (self.probe_url is None or self.server or self.probe_ok)

    def probe(self) -> bool:
        """Run the readiness probe once; True when the readiness changed."""
        if self.probe_url is None or not self.running:
            return False
        try:
            with urllib.request.urlopen(self.probe_url, timeout=1) as answer:  # noqa: S310 - loopback
                status: int = answer.status
            ok = 200 <= status < 400
        except (urllib.error.URLError, OSError):
            ok = False
        changed = ok != self.probe_ok
        self.probe_ok = ok
        return changed

    def status(self) -> dict[str, Any]:
        """The container status entry."""
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.running,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.process is not None or self.server:
            status["containerID"] = f"preshard-runner://{self.name}-{self.restart_count}"
        return status


class PodRun:
    """Runs one pod to completion (or until it is deleted) in a thread of its own."""

    def __init__(self, runner: PodRunner, pod: Pod) -> None:
        self.runner = runner
        self.pod = pod
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
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
        self.volumes: dict[str, Path] = {}
        self._next_probe = 0.0
        self._api = runner.new_api()

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
        if not self._wait_configured(self._mount_volumes, reason="ContainerCreating"):
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
                self._sleep(_RETRY_SECONDS)
        return False

    def _pending_runs(self) -> list[ContainerRun]:
        runs = self.runs if self.initialized else self.init_runs[:1] or self.runs
        return [r for r in runs if r.process is None and not r.server and r.terminated is None]

    def _run_init(self, run: ContainerRun) -> bool:
        backoff = _RETRY_SECONDS
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
        backoffs = {run.name: _RETRY_SECONDS for run in self.runs}
        while not self._stopping():
            changed = False
            for run in self.runs:
                exited = run.process is not None and run.process.poll() is not None
                if not exited or run.terminated is not None:
                    continue
                self._record_exit(run)
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
                self._record_exit(run)
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
        env = self._environment(run)
        paths = self._path_map(run)
        command = [paths(expand(a, env)) for a in run.spec.get("command") or image.entrypoint]
        args = [paths(expand(a, env)) for a in run.spec.get("args") or []]
        env = {k: paths(v) for k, v in env.items()}
        run.message_path = self.dir / "termination" / run.name
        run.message_path.parent.mkdir(parents=True, exist_ok=True)
        run.message_path.write_bytes(b"")
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        run.log_path = logs / f"{run.name}.log"
        base = {
            "PATH": f"{image.bin_dir}:{CONTAINER_PATH}" if image.bin_dir else CONTAINER_PATH,
            "HOME": str(self.dir / "home"),
            "TMPDIR": str(self.tmp),
            "HOSTNAME": self.name,
            "LANG": "C.UTF-8",
        }
        for key in ("HOME", "TMPDIR"):
            Path(base[key]).mkdir(parents=True, exist_ok=True)
        full_env = {**base, **self.runner.extra_env, **image.env, **env}
        full_env[TERMINATION_LOG_ENV] = str(run.message_path)
        executable = (
            resolve_executable(command[0], full_env["PATH"], image.bin_dir) if command else None
        )
        run.started_at = now()
        run.state = {"running": {"startedAt": run.started_at}}
        run.probe_url = readiness_url(run.spec)
        run.probe_ok = False
        if executable is None:
            run.server = True
            return
        working_dir = run.spec.get("workingDir")
        cwd = Path(paths(working_dir)) if working_dir else self.dir
        cwd.mkdir(parents=True, exist_ok=True)
        with run.log_path.open("ab") as log:
            run.process = subprocess.Popen(
                [executable, *command[1:], *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )

    def _record_exit(self, run: ContainerRun) -> None:
        if run.process is None:
            return
        code = run.process.returncode
        if code < 0:
            # The kubelet reports a signal as 128 + its number.
            code = 128 - code
        message = ""
        if run.message_path is not None and run.message_path.exists():
            with run.message_path.open("rb") as handle:
                message = handle.read(_MESSAGE_LIMIT).decode(errors="replace")
        if (
            not message
            and code != 0
            and run.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        ):
            message = self._log_tail(run)
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": run.started_at,
            "finishedAt": now(),
            "containerID": f"preshard-runner://{run.name}-{run.restart_count}",
        }
        if message:
            terminated["message"] = message
        run.state = {"terminated": terminated}

    def _log_tail(self, run: ContainerRun) -> str:
        if run.log_path is None or not run.log_path.exists():
            return ""
        lines = run.log_path.read_bytes().splitlines()[-_FALLBACK_LOG_LINES:]
        return b"\n".join(lines)[-_FALLBACK_LOG_BYTES:].decode(errors="replace")

    def _kill_all(self) -> None:
        grace = min(
            float(self.pod["spec"].get("terminationGracePeriodSeconds") or 30), _MAX_KILL_GRACE
        )
        live = [
            r.process
            for r in [*self.init_runs, *self.runs]
            if r.process is not None and r.process.poll() is None
        ]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

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

    # Environment and volumes.

    def _environment(self, run: ContainerRun) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in run.spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "secretRef" in source:
                ref = source["secretRef"]
                data = self._secret(ref["name"], optional=bool(ref.get("optional")))
            elif "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._config_map(ref["name"], optional=bool(ref.get("optional")))
            else:
                continue
            env.update({f"{prefix}{k}": v for k, v in (data or {}).items()})
        for var in run.spec.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(var["valueFrom"])
                if value is not None:
                    env[name] = value
            else:
                env[name] = expand(var.get("value", ""), env)
        return env

    def _value_from(self, source: Mapping[str, Any]) -> str | None:
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            optional = bool(ref.get("optional"))
            data = self._secret(ref["name"], optional=optional)
            if data is None:
                return None
            if ref["key"] not in data:
                if optional:
                    return None
                raise ConfigError(
                    f"couldn't find key {ref['key']} in Secret {self.namespace}/{ref['name']}"
                )
            return data[ref["key"]]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            optional = bool(ref.get("optional"))
            data = self._config_map(ref["name"], optional=optional)
            if data is None:
                return None
            if ref["key"] not in data:
                if optional:
                    return None
                raise ConfigError(
                    f"couldn't find key {ref['key']} in ConfigMap {self.namespace}/{ref['name']}"
                )
            return data[ref["key"]]
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        raise ConfigError(f"the test pod runner does not support env valueFrom {sorted(source)}")

    def _field(self, path: str) -> str:
        meta = self.pod["metadata"]
        spec = self.pod["spec"]
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }
        if path in simple:
            return str(simple[path])
        match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        raise ConfigError(f"the test pod runner does not support fieldRef {path}")

    def _secret(self, name: str, *, optional: bool) -> dict[str, str] | None:
        data = self._secret_bytes(name, optional=optional)
        return None if data is None else {k: v.decode() for k, v in data.items()}

    def _secret_bytes(self, name: str, *, optional: bool) -> dict[str, bytes] | None:
        try:
            secret = k8s.CoreV1Api(self._api).read_namespaced_secret(name, self.namespace)
        except ApiException as error:
            if error.status == 404:
                if optional:
                    return None
                raise ConfigError(f'secret "{name}" not found') from None
            raise
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _config_map(self, name: str, *, optional: bool) -> dict[str, str] | None:
        try:
            config_map = k8s.CoreV1Api(self._api).read_namespaced_config_map(name, self.namespace)
        except ApiException as error:
            if error.status == 404:
                if optional:
                    return None
                raise ConfigError(f'configmap "{name}" not found') from None
            raise
        return dict(config_map.data or {})

    def _mount_volumes(self) -> None:
        root = self.dir / "volumes"
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "hostPath" in volume:
                self.volumes[name] = Path(volume["hostPath"]["path"])
                continue
            target = root / name
            target.mkdir(parents=True, exist_ok=True)
            self.volumes[name] = target
            if "emptyDir" in volume:
                continue
            files = self._volume_files(volume)
            if files is None:
                raise ConfigError(
                    f'volume "{name}": this volume type is not supported by the test pod runner'
                )
            for relative, (data, mode) in files.items():
                path = target / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as handle:
                    handle.write(data)
                    os.fchmod(handle.fileno(), mode)

    def _volume_files(self, volume: Mapping[str, Any]) -> dict[str, tuple[bytes, int]] | None:
        if "secret" in volume:
            source = volume["secret"]
            return self._secret_files(source, source.get("defaultMode", 0o644))
        if "configMap" in volume:
            source = volume["configMap"]
            return self._config_map_files(source, source.get("defaultMode", 0o644))
        if "downwardAPI" in volume:
            source = volume["downwardAPI"]
            return self._downward_files(source, source.get("defaultMode", 0o644))
        if "projected" in volume:
            source = volume["projected"]
            mode = source.get("defaultMode", 0o644)
            files: dict[str, tuple[bytes, int]] = {}
            for item in source.get("sources") or []:
                if "secret" in item:
                    files.update(self._secret_files(item["secret"], mode))
                elif "configMap" in item:
                    files.update(self._config_map_files(item["configMap"], mode))
                elif "downwardAPI" in item:
                    files.update(self._downward_files(item["downwardAPI"], mode))
                elif "serviceAccountToken" in item:
                    token = item["serviceAccountToken"]
                    files[token["path"]] = (self._token(token).encode(), _PRIVATE)
            return files
        return None

    def _secret_files(self, source: Mapping[str, Any], mode: int) -> dict[str, tuple[bytes, int]]:
        name = source.get("secretName") or source.get("name", "")
        data = self._secret_bytes(name, optional=bool(source.get("optional")))
        files = _project(data or {}, source.get("items"), mode, f"Secret {self.namespace}/{name}")
        # The owner's bits are honoured; group and other bits are dropped, because the files
        # sit on a machine shared with other users rather than in a pod's own filesystem.
        return {path: (content, bits & _PRIVATE) for path, (content, bits) in files.items()}

    def _config_map_files(
        self, source: Mapping[str, Any], mode: int
    ) -> dict[str, tuple[bytes, int]]:
        name = source["name"]
        data = self._config_map(name, optional=bool(source.get("optional")))
        encoded = {k: v.encode() for k, v in (data or {}).items()}
        return _project(encoded, source.get("items"), mode, f"ConfigMap {self.namespace}/{name}")

    def _downward_files(self, source: Mapping[str, Any], mode: int) -> dict[str, tuple[bytes, int]]:
        files: dict[str, tuple[bytes, int]] = {}
        for item in source.get("items") or []:
            if "fieldRef" not in item:
                raise ConfigError(f"downwardAPI item {item['path']}: only fieldRef is supported")
            value = self._field(item["fieldRef"]["fieldPath"])
            files[item["path"]] = (value.encode(), item.get("mode", mode))
        return files

    def _token(self, source: Mapping[str, Any]) -> str:
        account = self.pod["spec"].get("serviceAccountName") or "default"
        spec = k8s.V1TokenRequestSpec(
            audiences=[source["audience"]] if source.get("audience") else [],
            expiration_seconds=source.get("expirationSeconds", 3607),
            bound_object_ref=k8s.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=self.name, uid=self.uid
            ),
        )
        response = k8s.CoreV1Api(self._api).create_namespaced_service_account_token(
            account, self.namespace, k8s.AuthenticationV1TokenRequest(spec=spec)
        )
        if response.status is None or not response.status.token:
            raise ConfigError(f'no token for service account "{account}"')
        return response.status.token

    def _path_map(self, run: ContainerRun) -> PathMap:
        mapping: dict[str, str] = {}
        for mount in run.spec.get("volumeMounts") or []:
            local = self.volumes.get(mount["name"])
            if local is None:
                raise ConfigError(f'volume "{mount["name"]}" is not defined in the pod')
            if mount.get("subPath"):
                local = local / mount["subPath"]
                local.mkdir(parents=True, exist_ok=True)
            mapping[mount["mountPath"]] = str(local)
        message_path = run.spec.get("terminationMessagePath") or "/dev/termination-log"
        mapping[message_path] = str(self.dir / "termination" / run.name)
        return PathMap(mapping)

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
        stamp = now()
        ready = self.phase == "Running" and all(r.ready for r in self.runs)
        unready = [r.name for r in self.runs if not r.ready]

        def condition(kind: str, value: bool, why: str = "", text: str = "") -> dict[str, Any]:
            entry: dict[str, Any] = {
                "type": kind,
                "status": "True" if value else "False",
                "lastTransitionTime": stamp,
            }
            if not value and why:
                entry.update(reason=why, message=text)
            return entry

        terminal = self.phase in _TERMINAL
        not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
        not_ready_text = (
            "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
        )
        pending_init = [r.name for r in self.init_runs if r.terminated is None]
        conditions = [
            condition("PodReadyToStartContainers", not terminal),
            condition(
                "Initialized",
                self.initialized,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(pending_init)}]",
            ),
            condition("Ready", ready, not_ready_reason, not_ready_text),
            condition("ContainersReady", ready, not_ready_reason, not_ready_text),
            condition("PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": self.start_time,
            "containerStatuses": [r.status() for r in self.runs],
        }
        if self.init_runs:
            status["initContainerStatuses"] = [r.status() for r in self.init_runs]
        return status


def _project(
    data: Mapping[str, bytes],
    items: list[dict[str, Any]] | None,
    mode: int,
    what: str,
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {key: (value, mode) for key, value in data.items()}
    files: dict[str, tuple[bytes, int]] = {}
    for item in items:
        if item["key"] not in data:
            raise ConfigError(f"couldn't find key {item['key']} in {what}")
        files[item["path"]] = (data[item["key"]], item.get("mode", mode))
    return files


def readiness_url(container: Mapping[str, Any]) -> str | None:
    """The loopback URL of a container's `httpGet` readiness probe, if it has one."""
    http = (container.get("readinessProbe") or {}).get("httpGet")
    if not http:
        return None
    port = http.get("port")
    if isinstance(port, str) and not port.isdigit():
        named = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
        port = named.get(port)
    path = str(http.get("path") or "/")
    return f"http://127.0.0.1:{port}{path if path.startswith('/') else '/' + path}"


def resolve_executable(argv0: str, path: str, bin_dir: Path | None = None) -> str | None:
    """The local program for a container's argv[0], or None when it does not exist here."""
    here = Path(sys.executable).parent if bin_dir is None else bin_dir
    if argv0 == "preshard":
        return str(here / "preshard")
    if argv0 in ("python", "python3"):
        return str(here / "python") if bin_dir is not None else sys.executable
    if "/" in argv0:
        return argv0 if os.access(argv0, os.X_OK) and Path(argv0).is_file() else None
    return shutil.which(argv0, path=path)


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
            run.thread.join(timeout=_MAX_KILL_GRACE + 5)
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
        stamp = now()
        core = k8s.CoreV1Api(api)
        node = core.read_node(self.node_name)
        conditions = [
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "enough PIDs"),
        ]
        previous = {c.type: c for c in (node.status.conditions if node.status else None) or []}
        body = {
            "status": {
                "conditions": [
                    {
                        "type": kind,
                        "status": value,
                        "reason": reason,
                        "message": text,
                        "lastHeartbeatTime": stamp,
                        "lastTransitionTime": (
                            _format_time(previous[kind].last_transition_time)
                            if kind in previous and previous[kind].status == value
                            else stamp
                        ),
                    }
                    for kind, value, reason, text in conditions
                ],
                # The API server reaches a node's kubelet (logs) at its first address of the
                # preferred types, Hostname first: with none, at this one, on loopback.
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self._log_port()}},
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "preshard-runner",
                    "kubeProxyVersion": "",
                    "containerRuntimeVersion": "preshard-runner://local-processes",
                    "kernelVersion": os.uname().release,
                    "osImage": "local processes",
                    "bootID": "",
                    "machineID": "",
                    "systemUUID": "",
                },
            }
        }
        core.patch_node_status(self.node_name, body)
        self._renew_lease(api, node.metadata.uid if node.metadata else None)

    def _log_port(self) -> int:
        assert self._log_server is not None  # noqa: S101 - started first
        return self._log_server.port

    def _renew_lease(self, api: k8s.ApiClient, node_uid: str | None) -> None:
        leases = k8s.CoordinationV1Api(api)
        spec = {
            "holderIdentity": self.node_name,
            "leaseDurationSeconds": _LEASE_SECONDS,
            "renewTime": _micro_now(),
        }
        try:
            leases.patch_namespaced_lease(self.node_name, "kube-node-lease", {"spec": spec})
        except ApiException as error:
            if error.status != 404:
                raise
            owner = k8s.V1OwnerReference(
                api_version="v1", kind="Node", name=self.node_name, uid=node_uid or ""
            )
            lease = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(name=self.node_name, owner_references=[owner]),
                spec=k8s.V1LeaseSpec(
                    holder_identity=self.node_name, lease_duration_seconds=_LEASE_SECONDS
                ),
            )
            leases.create_namespaced_lease("kube-node-lease", lease)
            # The renewal time goes in as Kubernetes spells microsecond times.
            leases.patch_namespaced_lease(self.node_name, "kube-node-lease", {"spec": spec})

    def _wait_schedulable(self, timeout: float) -> None:
        # The node lifecycle controller removes its not-ready taint a few seconds after the
        # first Ready heartbeat; until then the scheduler would skip the node.
        deadline = time.monotonic() + timeout
        with self.new_api() as api:
            core = k8s.CoreV1Api(api)
            while True:
                node = core.read_node(self.node_name)
                taints = [
                    t.key
                    for t in (node.spec.taints if node.spec else None) or []
                    if t.key.startswith("node.kubernetes.io/")
                ]
                if not taints:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"node {self.node_name} still has taints {taints} after {timeout:.0f}s"
                    )
                time.sleep(0.2)

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
                        self._stop.wait(_RETRY_SECONDS)
                except (OSError, urllib3.exceptions.HTTPError):
                    version = None
                    if not self._stop.is_set():
                        logger.warning("watching pods failed; listing again", exc_info=True)
                        self._stop.wait(_RETRY_SECONDS)

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


def _format_time(value: Any) -> str:
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)
