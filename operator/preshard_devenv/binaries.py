"""Build the environment's binaries from source through the Go module proxy, and cache them.

Nothing is downloaded from release pages: kube-apiserver, kube-controller-manager,
kube-scheduler and kubectl come from the `k8s.io/kubernetes` module, etcd from
`go.etcd.io/etcd/server/v3`, kwok and helm from their modules, all at the versions pinned in
`preshard_devenv.versions`. Each component is built once into
`<cache>/bin/<component>-<version>/` (cache: `$PRESHARD_CACHE_DIR`, else
`$XDG_CACHE_HOME/preshard`, else `~/.cache/preshard`) and reused afterwards. A build runs in a
temporary directory that is renamed into place only when it succeeded, under a file lock, so
an interrupted or concurrent build never leaves half a binary behind.

`KUBEBUILDER_ASSETS` (the envtest layout: kube-apiserver, etcd and kubectl in one directory)
takes precedence for the binaries it holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from preshard_devenv import versions
from preshard_devenv.procs import DevEnvError

Log = Callable[[str], None]

_KUBERNETES_COMMANDS: Final = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
)
_ENVTEST_BINARIES: Final = frozenset({"kube-apiserver", "etcd", "kubectl"})
_LOG_TAIL_LINES: Final = 40


@dataclass(frozen=True)
class Component:
    """A set of binaries built together from one Go module at one version."""

    name: str
    version: str
    binaries: tuple[str, ...]

    @property
    def key(self) -> str:
        """The cache directory name: one per component and version."""
        return f"{self.name}-{self.version}"


COMPONENTS: Final = {
    "kubernetes": Component("kubernetes", versions.KUBERNETES, _KUBERNETES_COMMANDS),
    "etcd": Component("etcd", versions.ETCD, ("etcd",)),
    "kwok": Component("kwok", versions.KWOK, ("kwok",)),
    "helm": Component("helm", versions.HELM, ("helm",)),
}

TOOLS: Final = {binary: c for c in COMPONENTS.values() for binary in c.binaries}


def cache_dir() -> Path:
    """The root of the binary cache, outside any checkout."""
    explicit = os.environ.get("PRESHARD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "preshard"


def component_dir(component: Component) -> Path:
    """Where a component's binaries live once built."""
    return cache_dir() / "bin" / component.key


def envtest_path(tool: str) -> Path | None:
    """The binary from `KUBEBUILDER_ASSETS`, when that is set and holds this tool."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets or tool not in _ENVTEST_BINARIES:
        return None
    candidate = Path(assets).expanduser() / tool
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def cached_path(tool: str) -> Path | None:
    """The tool's binary if it is already available (envtest assets or the cache), else None."""
    component = _component_of(tool)
    found = envtest_path(tool)
    if found is not None:
        return found
    built = component_dir(component) / tool
    return built if built.is_file() else None


def tool_path(tool: str, *, log: Log | None = None) -> Path:
    """The path of a tool's binary (`kubectl`, `helm`, `etcd`, ...), building it if needed."""
    found = cached_path(tool)
    if found is not None:
        return found
    return ensure(_component_of(tool), log=log) / tool


def ensure(component: Component, *, log: Log | None = None) -> Path:
    """Build a component unless its cache directory exists; returns that directory."""
    target = component_dir(component)
    if _complete(component, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{component.key}.lock", component, log):
        # Another process may have finished the same build while this one waited.
        if _complete(component, target):
            return target
        _build(component, target, log or _silent)
    return target


def ensure_all(*, log: Log | None = None) -> dict[str, Path]:
    """Every tool's path, building what is missing (envtest assets are used where present)."""
    paths: dict[str, Path] = {}
    for component in COMPONENTS.values():
        if any(envtest_path(b) is None for b in component.binaries):
            ensure(component, log=log)
        for binary in component.binaries:
            found = envtest_path(binary)
            paths[binary] = found if found is not None else component_dir(component) / binary
    return paths


def _component_of(tool: str) -> Component:
    try:
        return TOOLS[tool]
    except KeyError:
        known = ", ".join(sorted(TOOLS))
        raise DevEnvError(f"unknown tool {tool!r}; known tools: {known}") from None


def _complete(component: Component, target: Path) -> bool:
    return all((target / b).is_file() for b in component.binaries)


def _silent(_: str) -> None:
    return None


@contextlib.contextmanager
def _lock(path: Path, component: Component, log: Log | None) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if log:
                log(f"waiting for another process that is building {component.key}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(component: Component, target: Path, log: Log) -> None:
    go = _go_binary()
    logs = cache_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{component.key}.log"
    log(
        f"building {component.key} ({', '.join(component.binaries)}) from source through the "
        f"Go module proxy; a first build takes minutes. Log: {log_path}"
    )
    staging = Path(tempfile.mkdtemp(prefix=f".{component.key}-", dir=target.parent))
    try:
        out = staging / "bin"
        out.mkdir()
        builder = _GoBuild(go=go, work=staging / "module", log_path=log_path, component=component)
        builder.work.mkdir()
        _BUILDERS[component.name](builder, out)
        missing = [b for b in component.binaries if not (out / b).is_file()]
        if missing:
            raise DevEnvError(
                f"building {component.key} produced no {', '.join(missing)} in {out}; "
                f"see {log_path}"
            )
        # The rename is the commit: either the whole directory is there or none of it.
        os.replace(out, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"built {component.key} into {target}")


def _go_binary() -> str:
    found = shutil.which("go")
    goroot = os.environ.get("GOROOT")
    if found is None and goroot and (Path(goroot) / "bin" / "go").is_file():
        found = str(Path(goroot) / "bin" / "go")
    if found is None:
        raise DevEnvError(
            "the Go toolchain is missing: the local environment builds kube-apiserver, etcd, "
            f"kwok and helm from source. Install Go {versions.GO_MINIMUM} or newer "
            "(https://go.dev/dl/, or your distribution's golang package) and put `go` on PATH, "
            "or point KUBEBUILDER_ASSETS at a directory with kube-apiserver, etcd and kubectl"
        )
    return found


@dataclass
class _GoBuild:
    """Runs the `go` steps of one build in one wrapper module, all output to one log."""

    go: str
    work: Path
    log_path: Path
    component: Component

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOWORK": "off"})
        env.update(extra)
        return env

    def run(self, step: str, args: Sequence[str], **extra_env: str) -> str:
        """Run `go <args>` in the wrapper module; a failure names the step and the fix."""
        argv = [self.go, *args]
        with self.log_path.open("a") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            result = subprocess.run(
                argv,
                cwd=self.work,
                env=self.env(**extra_env),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                check=False,
            )
            log.write(result.stdout)
        if result.returncode != 0:
            tail = "\n".join(
                self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
            )
            raise DevEnvError(
                f"building {self.component.key} failed at step '{step}': `{' '.join(argv)}` "
                f"exited with code {result.returncode}. The Go module proxy must be reachable "
                f"(GOPROXY={os.environ.get('GOPROXY', 'https://proxy.golang.org')}) and Go must "
                f"be {versions.GO_MINIMUM} or newer; fix the cause and run "
                f"`python -m preshard_devenv build` again. The end of {self.log_path}:\n{tail}"
            )
        return result.stdout

    def init(self, module: str) -> None:
        self.run("create the wrapper module", ["mod", "init", module])


def _build_kubernetes(build: _GoBuild, out: Path) -> None:
    version = build.component.version
    build.init("preshard.local/kubebuild")
    upstream = json.loads(
        build.run(
            "download the k8s.io/kubernetes module",
            ["mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        )
    )
    gomod = json.loads(
        build.run("read k8s.io/kubernetes's go.mod", ["mod", "edit", "-json", upstream["GoMod"]])
    )
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
    # ./staging paths that only exist in its own repository; the released staging modules
    # carry the same code at v0.<minor>.<patch>.
    staging_version = "v0" + version[version.index(".") :]
    edits = [f"-go={gomod['Go']}", f"-require=k8s.io/kubernetes@{version}"]
    edits += [f"-godebug={d['Key']}={d['Value']}" for d in gomod.get("GoDebug") or []]
    edits += [
        f"-replace={r['Old']['Path']}={r['Old']['Path']}@{staging_version}"
        for r in gomod.get("Replace") or []
        if r["New"]["Path"].startswith("./staging/")
    ]
    build.run("pin the staging modules", ["mod", "edit", *edits])
    imports = "\n".join(f'\t_ "k8s.io/kubernetes/cmd/{c}"' for c in _KUBERNETES_COMMANDS)
    (build.work / "tools.go").write_text(
        f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n"
    )
    build.run("resolve dependencies", ["mod", "tidy"])
    major, minor = version.lstrip("v").split(".")[:2]
    stamps = {"gitVersion": version, "gitMajor": major, "gitMinor": minor}
    stamps["gitTreeState"] = "clean"
    ldflags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        ldflags += [f"-X {package}.{name}={value}" for name, value in stamps.items()]
    build.run(
        "compile kube-apiserver, kube-controller-manager, kube-scheduler and kubectl",
        [
            "build",
            "-trimpath",
            "-tags",
            "selinux,notest,grpcnotrace",
            "-ldflags",
            " ".join(ldflags),
            "-o",
            f"{out}/",
            *(f"k8s.io/kubernetes/cmd/{c}" for c in _KUBERNETES_COMMANDS),
        ],
    )


def _build_etcd(build: _GoBuild, out: Path) -> None:
    # etcd's server module replaces its sibling modules with relative paths, so `go install`
    # refuses it; a wrapper module that requires it resolves the released siblings instead.
    build.init("preshard.local/etcdbuild")
    build.run(
        "resolve go.etcd.io/etcd/server/v3",
        ["get", f"go.etcd.io/etcd/server/v3@{build.component.version}"],
    )
    build.run(
        "compile etcd",
        [
            "build",
            "-trimpath",
            "-ldflags",
            "-s -w",
            "-o",
            str(out / "etcd"),
            "go.etcd.io/etcd/server/v3",
        ],
    )


def _build_kwok(build: _GoBuild, out: Path) -> None:
    build.run(
        "compile kwok",
        [
            "install",
            "-trimpath",
            "-ldflags",
            "-s -w",
            f"sigs.k8s.io/kwok/cmd/kwok@{build.component.version}",
        ],
        GOBIN=str(out),
        GOFLAGS="",
    )


def _build_helm(build: _GoBuild, out: Path) -> None:
    version = build.component.version
    kube_major, kube_minor = versions.KUBERNETES.lstrip("v").split(".")[:2]
    # Helm's release builds stamp these; without them `helm version` says v3.<minor> and
    # `helm template`/`helm lint` judge charts against Kubernetes 1.20 instead of ours.
    ldflags = [
        "-s",
        "-w",
        f"-X helm.sh/helm/v3/internal/version.version={version}",
        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
        f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor={kube_major}",
        f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={kube_minor}",
        f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor={kube_major}",
        f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={kube_minor}",
    ]
    build.run(
        "compile helm",
        [
            "install",
            "-trimpath",
            "-ldflags",
            " ".join(ldflags),
            f"helm.sh/helm/v3/cmd/helm@{version}",
        ],
        GOBIN=str(out),
        GOFLAGS="",
    )


_BUILDERS: Final[dict[str, Callable[[_GoBuild, Path], None]]] = {
    "kubernetes": _build_kubernetes,
    "etcd": _build_etcd,
    "kwok": _build_kwok,
    "helm": _build_helm,
}
