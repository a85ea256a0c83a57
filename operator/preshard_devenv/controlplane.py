"""A real, local Kubernetes control plane: etcd, kube-apiserver, controllers, scheduler, kwok.

Every process binds to 127.0.0.1 on free ports, keeps its data and log under the cluster's
work directory, and is stopped by its own pid. The API server serves TLS with the cluster's
own CA, authenticates client certificates and ServiceAccount tokens, and enforces RBAC, so a
test acting as a ServiceAccount gets exactly the rights its Roles grant. kwok plays the
kubelet of the fake GPU nodes (see `preshard_devenv.nodes`).
"""

from __future__ import annotations

import atexit
import os
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard_devenv import binaries, kubeconfig, nodes, pki, procs
from preshard_devenv.procs import DevEnvError

Log = Callable[[str], None]

ADMIN_USER: Final = "preshard-admin"
SERVICE_CIDR: Final = "10.0.0.0/24"
POD_CIDR: Final = "10.244.0.0/16"
_CONTROLLERS: Final = (
    "serviceaccount-token-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "job-controller",
    "cronjob-controller",
    "ttl-after-finished-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "disruption-controller",
    "resourcequota-controller",
    "endpointslice-controller",
    "ephemeral-volume-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
)
CLUSTER_TOOLS: Final = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
_STAGES_RESOURCE: Final = "kwok-stages.yaml"
_START_TIMEOUT: Final = 90.0


def _quiet(_: str) -> None:
    return None


class LocalCluster(procs.Service):
    """A control plane in one work directory; `start()` it, then `stop()` it (or use `with`)."""

    def __init__(self, work_dir: Path, *, tools: Mapping[str, Path] | None = None) -> None:
        self.work_dir = work_dir.resolve()
        self._tools = dict(tools) if tools is not None else None
        self._processes: dict[str, procs.Process] = {}
        self._argv: dict[str, list[str]] = {}
        self._ports: dict[str, int] = {}
        self._ca: pki.CertificateAuthority | None = None
        self._stop_at_exit = False

    # Paths and addresses.

    @property
    def pki_dir(self) -> Path:
        """Certificates and keys (private keys mode 0600)."""
        return self.work_dir / "pki"

    @property
    def log_dir(self) -> Path:
        """One log file per process, `<name>.log`."""
        return self.work_dir / "logs"

    @property
    def ca_cert(self) -> Path:
        """The CA certificate clients trust."""
        return self.pki_dir / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        """A kubeconfig for a `system:masters` user."""
        return self.work_dir / "kubeconfigs" / "admin.kubeconfig"

    @property
    def server(self) -> str:
        """The API server's URL."""
        return f"https://127.0.0.1:{self._ports['apiserver']}"

    @property
    def processes(self) -> dict[str, procs.Process]:
        """The running processes by name, in start order."""
        return dict(self._processes)

    # Lifecycle.

    def start(self, *, stop_at_exit: bool = True, log: Log | None = None) -> LocalCluster:
        """Start every component, create the test nodes, and wait until the cluster serves.

        With `stop_at_exit` the processes are also stopped when the interpreter exits; turn
        it off to leave the cluster running after this process (the `up` command).
        """
        say = log or _quiet
        tools = self._tools
        if tools is None:
            tools = {tool: binaries.tool_path(tool, log=say) for tool in CLUSTER_TOOLS}
        self._stop_at_exit = stop_at_exit
        if stop_at_exit:
            atexit.register(self.stop)
        started = time.monotonic()
        try:
            self._prepare()
            self._start_etcd(tools["etcd"])
            self._start_apiserver(tools["kube-apiserver"])
            say(f"kube-apiserver ready at {self.server} ({time.monotonic() - started:.1f}s)")
            self._start_controllers(tools)
            self._create_nodes()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        say(f"cluster ready in {time.monotonic() - started:.1f}s; logs in {self.log_dir}")
        return self

    def stop(self) -> None:
        """Stop every process, newest first, by its own pid."""
        for process in reversed(list(self._processes.values())):
            process.stop()
        if self._stop_at_exit:
            atexit.unregister(self.stop)
            self._stop_at_exit = False

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port with the same data.

        The stop is abrupt after two seconds, like a crash: a graceful shutdown waits for its
        clients' connections to close, which the other components keep open.
        """
        apiserver = self._processes["kube-apiserver"]
        apiserver.stop_timeout = 2
        apiserver.stop()
        self._launch_apiserver()

    # Credentials.

    def user_kubeconfig(
        self, user: str, groups: Sequence[str] = (), path: Path | None = None
    ) -> Path:
        """A kubeconfig that authenticates as `user` in `groups` with a client certificate."""
        target = path or self.work_dir / "kubeconfigs" / f"user-{user.replace(':', '-')}.kubeconfig"
        config = kubeconfig.render(
            server=self.server,
            ca_pem=self._authority().cert_pem,
            user=user,
            client=self._authority().issue_client(user, groups),
        )
        return kubeconfig.write(target, config)

    def service_account_token(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600
    ) -> str:
        """A bound token for a ServiceAccount, from the TokenRequest API."""
        with self.api_client() as api:
            request = k8s.AuthenticationV1TokenRequest(
                spec=k8s.V1TokenRequestSpec(
                    audiences=[self.server], expiration_seconds=expiration_seconds
                )
            )
            response = k8s.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, request
            )
        if response.status is None or not response.status.token:
            raise DevEnvError(f"the TokenRequest for {namespace}/{name} returned no token")
        return response.status.token

    def service_account_kubeconfig(
        self,
        namespace: str,
        name: str,
        *,
        expiration_seconds: int = 3600,
        path: Path | None = None,
    ) -> Path:
        """A kubeconfig that authenticates as a ServiceAccount with a fresh token."""
        target = path or self.work_dir / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        token = self.service_account_token(namespace, name, expiration_seconds=expiration_seconds)
        config = kubeconfig.render(
            server=self.server,
            ca_pem=self._authority().cert_pem,
            user=f"system:serviceaccount:{namespace}:{name}",
            token=token,
        )
        return kubeconfig.write(target, config)

    def api_client(self, kubeconfig_path: Path | None = None) -> k8s.ApiClient:
        """A Kubernetes API client for a kubeconfig (the admin's by default)."""
        return kubeconfig.api_client(kubeconfig_path or self.admin_kubeconfig)

    def ssl_context(self) -> ssl.SSLContext:
        """A TLS context that trusts the cluster CA and presents the admin's certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_cert))
        context.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        return context

    # Start-up steps.

    def _authority(self) -> pki.CertificateAuthority:
        if self._ca is None:
            self._ca = pki.CertificateAuthority.load(self.ca_cert, self.pki_dir / "ca.key")
        return self._ca

    def _prepare(self) -> None:
        for sub in ("pki", "logs", "kubeconfigs", "etcd", "kwok"):
            (self.work_dir / sub).mkdir(parents=True, exist_ok=True)
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        self._ports = dict(zip(names, procs.free_ports(len(names)), strict=True))
        ca = pki.CertificateAuthority.create()
        ca.write(self.ca_cert, self.pki_dir / "ca.key")
        self._ca = ca
        serving = ca.issue_serving(
            "kube-apiserver",
            [
                "127.0.0.1",
                "localhost",
                "10.0.0.1",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
        )
        self._write_pair("apiserver", serving)
        components = ca.issue_serving("kube-components", ["127.0.0.1", "localhost"])
        self._write_pair("components", components)
        self._write_pair("admin", ca.issue_client(ADMIN_USER, ["system:masters"]))
        pki.service_account_keys(self.pki_dir / "sa.key", self.pki_dir / "sa.pub")
        clients = {
            "admin": (ADMIN_USER, ["system:masters"]),
            "controller-manager": ("system:kube-controller-manager", []),
            "scheduler": ("system:kube-scheduler", []),
            # kwok patches node and pod status, leases and events across all namespaces.
            "kwok": ("preshard-kwok", ["system:masters"]),
        }
        for name, (user, groups) in clients.items():
            kubeconfig.write(
                self.work_dir / "kubeconfigs" / f"{name}.kubeconfig",
                kubeconfig.render(
                    server=self.server,
                    ca_pem=ca.cert_pem,
                    user=user,
                    client=ca.issue_client(user, groups),
                ),
            )

    def _write_pair(self, name: str, pair: pki.KeyPair) -> None:
        (self.pki_dir / f"{name}.crt").write_bytes(pair.cert_pem)
        pki.write_private(self.pki_dir / f"{name}.key", pair.key_pem)

    def _start(self, name: str, argv: list[str], **kwargs: Any) -> procs.Process:
        self._argv[name] = argv
        process = procs.start(name, argv, self.log_dir, **kwargs)
        self._processes[name] = process
        return process

    def _start_etcd(self, etcd: Path) -> None:
        client = f"http://127.0.0.1:{self._ports['etcd']}"
        peer = f"http://127.0.0.1:{self._ports['etcd-peer']}"
        process = self._start(
            "etcd",
            [
                str(etcd),
                "--name=preshard",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=preshard={peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            stop_timeout=10,
        )
        procs.wait_until(
            lambda: procs.http_ok(f"{client}/health"),
            timeout=_START_TIMEOUT,
            what=f"etcd at {client}",
            process=process,
        )

    def _start_apiserver(self, apiserver: Path) -> None:
        pki_dir = self.pki_dir
        self._argv["kube-apiserver"] = [
            str(apiserver),
            f"--etcd-servers=http://127.0.0.1:{self._ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self._ports['apiserver']}",
            f"--cert-dir={pki_dir}",
            f"--tls-cert-file={pki_dir / 'apiserver.crt'}",
            f"--tls-private-key-file={pki_dir / 'apiserver.key'}",
            f"--client-ca-file={self.ca_cert}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={pki_dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]
        self._launch_apiserver()

    def _launch_apiserver(self) -> None:
        process = self._start("kube-apiserver", self._argv["kube-apiserver"], stop_timeout=5)
        context = self.ssl_context()
        procs.wait_until(
            lambda: procs.http_ok(f"{self.server}/readyz", context=context),
            timeout=_START_TIMEOUT,
            what=f"kube-apiserver /readyz at {self.server}",
            process=process,
        )

    def _component_args(self, name: str, port: int) -> list[str]:
        config = self.work_dir / "kubeconfigs" / f"{name}.kubeconfig"
        return [
            f"--kubeconfig={config}",
            f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--tls-cert-file={self.pki_dir / 'components.crt'}",
            f"--tls-private-key-file={self.pki_dir / 'components.key'}",
            "--v=1",
        ]

    def _start_controllers(self, tools: Mapping[str, Path]) -> None:
        manager_port = self._ports["controller-manager"]
        manager = self._start(
            "kube-controller-manager",
            [
                str(tools["kube-controller-manager"]),
                *self._component_args("controller-manager", manager_port),
                f"--controllers={','.join(_CONTROLLERS)}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.pki_dir / 'sa.key'}",
                f"--root-ca-file={self.ca_cert}",
                f"--cluster-signing-cert-file={self.ca_cert}",
                f"--cluster-signing-key-file={self.pki_dir / 'ca.key'}",
            ],
            stop_timeout=10,
        )
        scheduler_port = self._ports["scheduler"]
        scheduler = self._start(
            "kube-scheduler",
            [
                str(tools["kube-scheduler"]),
                *self._component_args("scheduler", scheduler_port),
            ],
            stop_timeout=10,
        )
        stages = self.work_dir / "kwok" / _STAGES_RESOURCE
        stages.write_text(resources.files("preshard_devenv").joinpath(_STAGES_RESOURCE).read_text())
        kwok_port = self._ports["kwok"]
        kwok = self._start(
            "kwok",
            [
                str(tools["kwok"]),
                f"--kubeconfig={self.work_dir / 'kubeconfigs' / 'kwok.kubeconfig'}",
                f"--config={stages}",
                f"--manage-nodes-with-label-selector={nodes.KWOK_LABEL_SELECTOR}",
                f"--server-address=127.0.0.1:{kwok_port}",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.240.0.1",
                "--node-lease-duration-seconds=40",
            ],
            # kwok also reads ~/.kwok/kwok.yaml; a HOME of its own keeps a user's file out.
            env={"HOME": str(self.work_dir / "kwok"), "PATH": os.environ.get("PATH", "")},
            stop_timeout=10,
        )
        context = self.ssl_context()
        for process, url in (
            (manager, f"https://127.0.0.1:{manager_port}/healthz"),
            (scheduler, f"https://127.0.0.1:{scheduler_port}/healthz"),
            (kwok, f"http://127.0.0.1:{kwok_port}/healthz"),
        ):
            procs.wait_until(
                lambda url=url: procs.http_ok(url, context=context),  # type: ignore[misc]
                timeout=_START_TIMEOUT,
                what=f"{process.name} at {url}",
                process=process,
            )

    def _create_nodes(self) -> None:
        with self.api_client() as api:
            core = k8s.CoreV1Api(api)
            for manifest in nodes.manifests():
                # The typed client wants a model; the manifest is plain data.
                core.create_node(k8s.V1Node.model_validate(manifest))

    def _wait_ready(self) -> None:
        with self.api_client() as api:
            core = k8s.CoreV1Api(api)

            def default_account() -> bool:
                try:
                    core.read_namespaced_service_account("default", "default")
                except ApiException as error:
                    if error.status == 404:
                        return False
                    raise
                return True

            def kwok_nodes_ready() -> bool:
                names = [*nodes.GPU_NODES, nodes.MANUAL_NODE]
                return all(_node_ready(core.read_node(n)) for n in names)

            procs.wait_until(
                default_account,
                timeout=_START_TIMEOUT,
                what="the `default` ServiceAccount (kube-controller-manager)",
                process=self._processes["kube-controller-manager"],
            )
            procs.wait_until(
                kwok_nodes_ready,
                timeout=_START_TIMEOUT,
                what="kwok to make its nodes Ready",
                process=self._processes["kwok"],
            )


def _node_ready(node: Any) -> bool:
    conditions = node.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)
