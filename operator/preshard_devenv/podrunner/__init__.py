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

from preshard_devenv.podrunner.containers import TERMINATION_LOG_ENV, ContainerRun
from preshard_devenv.podrunner.images import (
    CONTAINER_PATH,
    LocalImage,
    image_repository,
    resolve_executable,
)
from preshard_devenv.podrunner.pod import PodRun
from preshard_devenv.podrunner.podspec import ConfigError, PathMap, expand, readiness_url
from preshard_devenv.podrunner.runner import NODE, PodRunner

__all__ = [
    "CONTAINER_PATH",
    "NODE",
    "TERMINATION_LOG_ENV",
    "ConfigError",
    "ContainerRun",
    "LocalImage",
    "PathMap",
    "PodRun",
    "PodRunner",
    "expand",
    "image_repository",
    "readiness_url",
    "resolve_executable",
]
