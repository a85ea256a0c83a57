"""`make run`: the operator on the current kube context, or on a local one started for it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard_devenv import workloads
from preshard_devenv.background import State
from preshard_devenv.kubeconfig import api_client
from preshard_devenv.procs import DevEnvError, wait_until

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "shardedmodels.preshard.dev.yaml"
CRD_NAME = f"{models.PLURAL}.{models.GROUP}"


def has_kube_context() -> bool:
    """Whether kubectl would talk to a cluster: a KUBECONFIG or ~/.kube/config that exists."""
    configured = os.environ.get("KUBECONFIG", "")
    paths = configured.split(os.pathsep) if configured else [str(Path.home() / ".kube" / "config")]
    return any(path and Path(path).is_file() for path in paths)


def require_crd(kubeconfig: Path | None) -> None:
    """Fail with a hint when the cluster does not serve ShardedModels yet."""
    with _api(kubeconfig) as api:
        try:
            k8s.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME)
        except ApiException as error:
            if error.status == 404:
                raise DevEnvError(
                    f"the cluster has no {CRD_NAME} CRD: install preshard with "
                    "`helm install preshard charts/preshard` or apply crds/ first"
                ) from None
            raise DevEnvError(f"cannot read the CRD ({error.status} {error.reason})") from None


def install_crd(api: k8s.ApiClient, *, timeout: float = 30.0) -> None:
    """Create or update the ShardedModel CRD and wait until the API server serves it."""
    extensions = k8s.ApiextensionsV1Api(api)
    manifest = k8s.V1CustomResourceDefinition.model_validate(yaml.safe_load(CRD_FILE.read_text()))
    try:
        extensions.create_custom_resource_definition(manifest)
    except ApiException as error:
        if error.status != 409:
            raise
        current = extensions.read_custom_resource_definition(CRD_NAME)
        assert manifest.metadata is not None  # noqa: S101 - the file names its CRD
        manifest.metadata.resource_version = (
            current.metadata or k8s.V1ObjectMeta()
        ).resource_version
        extensions.replace_custom_resource_definition(CRD_NAME, manifest)

    def established() -> bool:
        status = extensions.read_custom_resource_definition(CRD_NAME).status
        conditions = (status.conditions if status else None) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_until(established, timeout=timeout, what=f"the {CRD_NAME} CRD to be served")


def write_example(state_dir: Path, state: State) -> Path:
    """A ShardedModel and a vLLM Deployment that fit the local environment, ready to apply."""
    model = "Qwen/Qwen2.5-7B-Instruct"
    spec = {
        "model": {"id": model},
        "storage": {"uri": f"s3://{state.bucket}/shards", "endpoint": state.s3_endpoint},
        "tensorParallelSizes": [2],
        "targets": [{"name": "vllm"}],
    }
    documents = [
        workloads.vllm_deployment(
            "vllm", namespace="default", container=workloads.vllm_container(model)
        ),
        workloads.sharded_model("qwen", spec, namespace="default"),
    ]
    path = state_dir / "example.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path


def exec_operator(kubeconfig: Path | None) -> NoReturn:
    """Replace this process with `preshard run` (Ctrl-C stops it)."""
    if kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(kubeconfig)
    preshard = Path(sys.executable).with_name("preshard")
    os.execv(preshard, [str(preshard), "run", "--liveness", ""])  # noqa: S606 - our own entrypoint


def _api(kubeconfig: Path | None) -> k8s.ApiClient:
    if kubeconfig is not None:
        return api_client(kubeconfig)
    from kubernetes import config  # noqa: PLC0415 - only for the user's own context

    config.load_kube_config()  # type: ignore[no-untyped-call] # the loader is untyped
    return k8s.ApiClient()
