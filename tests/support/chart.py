"""The Helm chart under test: its renders and the lookups in them, its releases, the operator
started exactly the way the chart's Deployment starts it, and what its RBAC allows."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard_devenv import procs, workloads
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.workloads import MODEL_ID, vllm_container
from tests.support.shardedmodels import read_deployment
from tests.support.tools import Tool

ROOT: Final = Path(__file__).resolve().parents[2]
CHART: Final = ROOT / "charts" / "preshard"
CHART_CRD: Final = CHART / "files" / "crds" / "shardedmodels.preshard.dev.yaml"
CRD_SOURCE: Final = ROOT / "crds" / "shardedmodels.preshard.dev.yaml"
CRD_NAME: Final = "shardedmodels.preshard.dev"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion); renders must work there.
KUBE_VERSION: Final = "1.31.0"
LIVENESS_FLAG: Final = "--liveness="
METRICS_PORT_ENV: Final = "PRESHARD_METRICS_PORT"

CREDENTIALS_SECRET: Final = "s3-credentials"

Manifest = dict[str, Any]


def template(
    helm: Tool,
    *args: str,
    chart: Path = CHART,
    release: str = "preshard",
    namespace: str = "preshard-system",
) -> list[Manifest]:
    """`helm template` of the chart, parsed: every non-empty document."""
    output = helm.run(
        "template",
        release,
        str(chart),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
        *args,
    ).stdout
    return [doc for doc in yaml.safe_load_all(output) if doc]


def template_error(helm: Tool, *args: str) -> str:
    """`helm template` that must fail; returns its stderr."""
    result = helm.run(
        "template", "preshard", str(CHART), "--kube-version", KUBE_VERSION, *args, check=False
    )
    assert result.returncode != 0, f"helm template {' '.join(args)} should have failed"
    return result.stderr


def of_kind(manifests: Iterable[Manifest], kind: str) -> list[Manifest]:
    """The manifests of one kind, in order."""
    return [m for m in manifests if m.get("kind") == kind]


def one(manifests: Iterable[Manifest], kind: str) -> Manifest:
    """The only manifest of a kind."""
    found = of_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def operator_container(deployment: Manifest) -> Manifest:
    """The operator container of the chart's Deployment."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    container: Manifest = containers[0]
    return container


def container_env(container: Manifest) -> dict[str, str]:
    """A container's plain environment variables (the API server drops empty values)."""
    env: dict[str, str] = {}
    for variable in container.get("env") or []:
        assert "valueFrom" not in variable, f"{variable['name']} is not a plain value"
        env[variable["name"]] = variable.get("value", "")
    return env


def copy_chart(target: Path, *, version: str) -> Path:
    """A copy of the chart with another version, as an earlier release of it would be."""
    shutil.copytree(CHART, target)
    chart_file = target / "Chart.yaml"
    metadata = yaml.safe_load(chart_file.read_text())
    metadata["version"] = version
    chart_file.write_text(yaml.safe_dump(metadata, sort_keys=False))
    return target


def chart_operator(deployment: Manifest, kubeconfig: Path, work_dir: Path) -> OperatorProcess:
    """`preshard run` as a local process with the args and environment of the chart's
    Deployment, acting with the chart's ServiceAccount (its kubeconfig) and seeing nothing of
    this process's environment. Only the liveness address and the metrics port change (free
    ports, so operators of two test runs on one machine do not contend for the chart's)."""
    container = operator_container(deployment)
    command = list(container.get("command") or [])
    assert command == ["preshard"], f"the chart runs the preshard entrypoint: {command}"
    args = list(container.get("args") or [])
    liveness = [arg for arg in args if arg.startswith(LIVENESS_FLAG)]
    assert len(liveness) == 1, f"the chart's args set the liveness endpoint once: {args}"
    home = work_dir / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(home), **container_env(container)}
    if env.get(METRICS_PORT_ENV, "0") != "0":
        env[METRICS_PORT_ENV] = str(procs.free_port())
    return OperatorProcess(kubeconfig, work_dir, env, args=args, inherit_env=False)


def can_i(kubectl: Tool, verb: str, resource: str, *scope: str) -> bool:
    """`kubectl auth can-i` as the tool's user: whether the API server allows it.

    `resource` may name a subresource (`pods/log`); kubectl would read that as an object name.
    """
    kind, _, subresource = resource.partition("/")
    extra = ["--subresource", subresource] if subresource else []
    result = kubectl.run("auth", "can-i", verb, kind, *extra, *scope, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i answered {answer!r}: {result.stderr}"
    return answer == "yes"


def rules_of(role: Manifest) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """A role's rules as (apiGroups, resources, verbs) tuples, for exact comparison."""
    return [
        (tuple(rule["apiGroups"]), tuple(rule["resources"]), tuple(rule["verbs"]))
        for rule in role["rules"]
    ]


@dataclass(frozen=True)
class Release:
    """An installed release of the chart."""

    name: str
    namespace: str

    @property
    def service_account(self) -> str:
        """The operator's ServiceAccount: the full name, which is the release name here."""
        return self.name

    def of(self, chart: Path) -> list[str]:
        """The arguments of `helm install|upgrade` that put `chart` into this release."""
        return [self.name, str(chart), "--namespace", self.namespace]

    def deployment(self, api: k8s.ApiClient) -> Manifest:
        """The operator's Deployment as the API server stores it."""
        return read_deployment(api, self.namespace, self.name)


def adopt_crd(api: k8s.ApiClient, release: Release) -> None:
    """Hand an existing ShardedModel CRD to a release, the way Helm documents adoption.

    The test session's cluster is shared with suites that may have created the CRD directly;
    Helm refuses to install over an object that carries no ownership of its own.
    """
    extensions = k8s.ApiextensionsV1Api(api)
    try:
        extensions.read_custom_resource_definition(CRD_NAME)
    except ApiException as error:
        if error.status == 404:
            return
        raise
    extensions.patch_custom_resource_definition(
        CRD_NAME,
        {
            "metadata": {
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": release.name,
                    "meta.helm.sh/release-namespace": release.namespace,
                },
            }
        },
    )


def create_workload(
    api: k8s.ApiClient, namespace: str, name: str, *, target: str, revision: str
) -> None:
    """Create a target Deployment (`vllm serve <model>`, one replica on one GPU) and its
    ShardedModel of one TP-2 shard set (and the credentials Secret the Jobs and the patched pods
    reference; nothing here reads it)."""
    core = k8s.CoreV1Api(api)
    try:
        core.create_namespaced_secret(
            namespace,
            k8s.V1Secret(
                metadata=k8s.V1ObjectMeta(name=CREDENTIALS_SECRET),
                string_data={
                    "AWS_ACCESS_KEY_ID": "test-access-key",
                    "AWS_SECRET_ACCESS_KEY": "test-secret-key",
                },
            ),
        )
    except ApiException as error:
        if error.status != 409:
            raise
    workloads.create_deployment(api, namespace, target, container=vllm_container(port=None))
    spec = {
        "model": {"id": MODEL_ID, "revision": revision},
        "storage": {
            "uri": "s3://models/shards",
            "endpoint": "https://s3.example.com",
            "credentialsSecretRef": {"name": CREDENTIALS_SECRET},
        },
        "tensorParallelSizes": [2],
        "targets": [{"name": target}],
    }
    workloads.create_sharded_model(api, namespace, name, spec)


def get_sharded_model(api: k8s.ApiClient, namespace: str, name: str) -> Manifest | None:
    """A ShardedModel, or None once it is gone."""
    try:
        found = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
            models.GROUP, models.VERSION, namespace, models.PLURAL, name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return cast(Manifest, found)


def is_ready(resource: Manifest | None) -> bool:
    """Whether a ShardedModel's Ready condition is True."""
    conditions = ((resource or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def forbidden_requests(log: str, *expected: str) -> list[str]:
    """Log lines about requests RBAC refused, except those naming an `expected` resource.

    A namespace being deleted also answers 403 ("is being terminated") to anything new, such
    as an event about a ShardedModel in it; that is no RBAC refusal.
    """
    return [
        line
        for line in log.splitlines()
        if "forbidden" in line.lower()
        and "being terminated" not in line
        and not any(resource in line for resource in expected)
    ]
