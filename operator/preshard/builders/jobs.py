"""The Jobs the controller runs: serialize (GPU), reshard, verify and delete (CPU).

Each Job runs one `preshard <subcommand>` with the user's Secrets by reference, reports through
its termination message, and is owned by its ShardedModel.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Final

from preshard.api import models
from preshard.builders import Manifest
from preshard.builders.identity import normalise_engine_args
from preshard.builders.pods import (
    ENCRYPTION_KEYFILE,
    SCRATCH_DIR,
    file_mounts,
    file_volumes,
    s3_env,
    tool_args,
)
from preshard.builders.shardset import (
    ANNOTATION_TP,
    ANNOTATION_URI,
    BuildInput,
    child_name,
    labels,
)
from preshard.contract.layout import S3Location
from preshard.contract.outcome import PERMANENT_EXIT_CODES

SERIALIZE: Final = "serialize"
RESHARD: Final = "reshard"
VERIFY: Final = "verify"
DELETE: Final = "delete"

CONTAINER: Final = "preshard"
SCRATCH_VOLUME: Final = "scratch"
SHM_VOLUME: Final = "dshm"

# Small CPU Jobs: listing and sizing a prefix needs little; a deep verify streams through.
TOOLS_RESOURCES: Final[Manifest] = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"memory": "512Mi"},
}
# A reshard holds one tensor at a time: its N source pieces and one target piece, two to three
# times the largest tensor (a 128k-vocabulary embedding: 2 GB at hidden 8192, 4 GB at 16384)
# plus about 1.5 GiB of imports and transfer buffers. The limit leaves room for that up to the
# largest Llama models; an OOM kill falls back to the GPU Job.
RESHARD_RESOURCES: Final[Manifest] = {
    "requests": {"cpu": "2", "memory": "4Gi"},
    "limits": {"memory": "16Gi"},
}
VERIFY_DEADLINE_SECONDS: Final = 3600
DELETE_BACKOFF_LIMIT: Final = 3
# Kubernetes removes finished Jobs a day later; the controller has recorded their outcome.
TTL_AFTER_FINISHED_SECONDS: Final = 24 * 3600

# The container security context of the CPU Jobs (the restricted Pod Security Standard's).
_RESTRICTED: Final[Manifest] = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
_INTEGER: Final = re.compile(r"^-?[0-9]+$")
_DECIMAL: Final = re.compile(r"^-?[0-9]+\.[0-9]+$")


@dataclass(frozen=True)
class JobInput(BuildInput):
    """What every Job builder needs: which run of the Job this is, too."""

    run: int


def coerce_engine_arg(value: str) -> str | int | float | bool:
    """A CRD string value as the JSON scalar vLLM expects (`true` → True, `8` → 8, `0.9`)."""
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INTEGER.match(text):
        return int(text)
    if _DECIMAL.match(text):
        return float(text)
    return value


def build_serialize_job(job: JobInput) -> Manifest:
    """The GPU Job that writes one shard set: TP GPUs, a sized scratch volume, /dev/shm."""
    spec, settings, shard_set = job.spec, job.settings, job.shard_set
    serialization = spec.serialization
    gpu = serialization.gpu_resource_name or settings.gpu_resource_name
    scratch_size = serialization.scratch_size or settings.scratch_size
    args = [
        SERIALIZE,
        "--model",
        spec.model.name,
        *(["--revision", spec.model.revision] if spec.model.revision else []),
        "--tensor-parallel-size",
        str(shard_set.tensor_parallel_size),
        "--dtype",
        serialization.dtype,
        *(
            ["--max-model-len", str(serialization.max_model_len)]
            if serialization.max_model_len
            else []
        ),
        *(_engine_args_flag(serialization.extra_engine_args)),
        *_writer_args(job, scratch_size),
    ]
    env = s3_env(spec.storage)
    if spec.model.token_secret_ref is not None:
        ref = spec.model.token_secret_ref
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    env += _scratch_env()
    requests: dict[str, str] = {
        gpu: str(shard_set.tensor_parallel_size),
        **_scratch_request(spec, scratch_size),
    }
    limits: dict[str, str] = {gpu: str(shard_set.tensor_parallel_size)}
    if serialization.cpu:
        requests["cpu"] = serialization.cpu
    if serialization.memory:
        requests["memory"] = serialization.memory
        limits["memory"] = serialization.memory
    mounts, volumes = _scratch_volumes(spec, scratch_size)
    mounts.insert(1, {"name": SHM_VOLUME, "mountPath": "/dev/shm"})  # noqa: S108 - the pod's shm
    # NCCL between the TP workers needs more shared memory than the default 64 MiB.
    volumes.insert(1, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    container: Manifest = {
        "name": CONTAINER,
        "image": serialization.image or settings.serializer_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["preshard"],
        "args": args,
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        # Not the tools Jobs' read-only root: vLLM and its compilers write caches under $HOME.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = _pod_spec(
        container,
        volumes,
        serialization.node_selector,
        serialization.tolerations,
        serialization.service_account_name,
    )
    return _job(
        job,
        SERIALIZE,
        pod_spec,
        backoff_limit=serialization.backoff_limit,
        deadline=serialization.active_deadline_seconds,
        failure_policy={
            "rules": [
                # Bad input (denied access, no such model, too little scratch) fails at once.
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": CONTAINER,
                        "operator": "In",
                        "values": list(PERMANENT_EXIT_CODES),
                    },
                },
                # An evicted or preempted pod is not the model's fault: it does not count.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
    )


def build_reshard_job(job: JobInput, source: S3Location) -> Manifest:
    """The CPU Job that writes one shard set from a verified `source` set of the same model at
    another TP size: no GPU, the serializer image (torch and tensorizer, not vLLM, run), a sized
    scratch volume for the source's files and the new rank files, and the placement of the
    other CPU Jobs."""
    spec, settings, shard_set = job.spec, job.settings, job.shard_set
    scratch_size = spec.serialization.scratch_size or settings.scratch_size
    args = [
        RESHARD,
        source.uri,
        "--to-tensor-parallel-size",
        str(shard_set.tensor_parallel_size),
        *_writer_args(job, scratch_size),
    ]
    mounts, volumes = _scratch_volumes(spec, scratch_size)
    resources = copy.deepcopy(RESHARD_RESOURCES)
    resources["requests"].update(_scratch_request(spec, scratch_size))
    container: Manifest = {
        "name": CONTAINER,
        "image": spec.serialization.image or settings.serializer_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["preshard"],
        "args": args,
        "env": [*s3_env(spec.storage), *_scratch_env()],
        "resources": resources,
        "securityContext": copy.deepcopy(_RESTRICTED),
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = _cpu_pod_spec(spec, container, volumes)
    # Whatever fails here, the GPU Job is the way out: one pod, no retries.
    return _job(job, RESHARD, pod_spec, backoff_limit=0, deadline=VERIFY_DEADLINE_SECONDS)


def build_verify_job(job: JobInput) -> Manifest:
    """The CPU Job that checks a shard set against its manifest."""
    spec = job.spec
    args = [
        VERIFY,
        job.shard_set.uri,
        "--tensor-parallel-size",
        str(job.shard_set.tensor_parallel_size),
        "--artifact-key",
        job.shard_set.artifact_key,
        *(["--deep"] if spec.verification.deep else []),
        *tool_args(spec.storage, job.settings),
    ]
    return _tools_job(job, VERIFY, args, backoff_limit=0, deadline=VERIFY_DEADLINE_SECONDS)


def build_delete_job(job: JobInput) -> Manifest:
    """The CPU Job that removes one shard set (manifest first)."""
    args = [DELETE, job.shard_set.uri, *tool_args(job.spec.storage, job.settings)]
    return _tools_job(
        job, DELETE, args, backoff_limit=DELETE_BACKOFF_LIMIT, deadline=VERIFY_DEADLINE_SECONDS
    )


def job_name(job: JobInput, kind: str) -> str:
    """The deterministic name of a Job of this kind and run."""
    return child_name(job.owner, job.shard_set, kind, job.run)


def _tools_job(
    job: JobInput, kind: str, args: list[str], *, backoff_limit: int, deadline: int
) -> Manifest:
    spec, settings = job.spec, job.settings
    container: Manifest = {
        "name": CONTAINER,
        "image": settings.tools_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["preshard"],
        "args": args,
        "resources": TOOLS_RESOURCES,
        "securityContext": copy.deepcopy(_RESTRICTED),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    env = s3_env(spec.storage)
    if env:
        container["env"] = env
    mounts = file_mounts(spec, encryption_key=False)
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec = _cpu_pod_spec(spec, container, file_volumes(spec, encryption_key=False))
    return _job(job, kind, pod_spec, backoff_limit=backoff_limit, deadline=deadline)


def _job(
    job: JobInput,
    kind: str,
    pod_spec: Manifest,
    *,
    backoff_limit: int,
    deadline: int,
    failure_policy: Manifest | None = None,
) -> Manifest:
    extras = job.spec.job_pods
    job_labels = {**extras.labels, **labels(job.owner, job.shard_set, kind)}
    annotations = {
        **extras.annotations,
        ANNOTATION_TP: str(job.shard_set.tensor_parallel_size),
        ANNOTATION_URI: job.shard_set.uri,
    }
    _add_job_pods(pod_spec, extras)
    spec: Manifest = {
        "backoffLimit": backoff_limit,
        "activeDeadlineSeconds": deadline,
        "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_SECONDS,
        "template": {
            "metadata": {"labels": dict(job_labels), "annotations": dict(annotations)},
            "spec": pod_spec,
        },
    }
    if failure_policy is not None:
        spec["podFailurePolicy"] = failure_policy
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(job, kind),
            "namespace": job.owner.namespace,
            "labels": job_labels,
            "annotations": annotations,
            "ownerReferences": [job.owner.reference()],
        },
        "spec": spec,
    }


def _add_job_pods(pod_spec: Manifest, extras: models.JobPods) -> None:
    """What every Job pod gets: the restricted Pod Security Standard's pod-level settings (the
    images run as a non-root user; each container drops its privileges itself), and the
    user's `jobPods` additions."""
    pod_spec["securityContext"] = {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if extras.env:
        env = [e.model_dump(by_alias=True, exclude_none=True) for e in extras.env]
        for container in pod_spec["containers"]:
            container["env"] = [*container.get("env", []), *env]
    if extras.priority_class_name:
        pod_spec["priorityClassName"] = extras.priority_class_name
    if extras.affinity:
        pod_spec["affinity"] = extras.affinity
    if extras.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in extras.image_pull_secrets]


def _writer_args(job: JobInput, scratch_size: str) -> list[str]:
    """The flags of a command that writes a set (serialize, reshard): where to, the scratch
    room, the key, the store and the log format."""
    spec = job.spec
    return [
        "--dest",
        job.shard_set.uri,
        "--artifact-key",
        job.shard_set.artifact_key,
        "--scratch-dir",
        SCRATCH_DIR,
        # An emptyDir's free space reads as the node's disk; the sizeLimit is the real bound.
        *([] if spec.serialization.scratch_volume else ["--scratch-size-limit", scratch_size]),
        *(["--encryption-keyfile", ENCRYPTION_KEYFILE] if spec.encryption else []),
        *tool_args(spec.storage, job.settings),
    ]


def _scratch_env() -> list[Manifest]:
    # Caches and temporary files go to the sized scratch volume, not the container's layer.
    return [
        {"name": "HF_HOME", "value": f"{SCRATCH_DIR}/hf"},
        {"name": "TMPDIR", "value": f"{SCRATCH_DIR}/tmp"},  # noqa: S108 - on the scratch volume
    ]


def _scratch_volumes(
    spec: models.ShardedModelSpec, scratch_size: str
) -> tuple[list[Manifest], list[Manifest]]:
    """The mounts and volumes of a Job that writes a set: scratch, the key if encrypted, and
    the store's CA bundle if it has one.

    Scratch is an emptyDir bounded by its sizeLimit, or with `scratchVolume` a generic ephemeral
    volume: a claim of that size the ephemeral volume controller makes for the pod (and deletes
    with it), so the pod waits for a volume instead of filling the node's disk.
    """
    mounts = [
        {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR},
        *file_mounts(spec, encryption_key=True),
    ]
    volumes = [
        {"name": SCRATCH_VOLUME, **_scratch_source(spec, scratch_size)},
        *file_volumes(spec, encryption_key=True),
    ]
    return mounts, volumes


def _scratch_source(spec: models.ShardedModelSpec, scratch_size: str) -> Manifest:
    scratch = spec.serialization.scratch_volume
    if scratch is None:
        return {"emptyDir": {"sizeLimit": scratch_size}}
    claim: Manifest = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": scratch_size}},
    }
    if scratch.storage_class_name:
        claim["storageClassName"] = scratch.storage_class_name
    return {"ephemeral": {"volumeClaimTemplate": {"spec": claim}}}


def _scratch_request(spec: models.ShardedModelSpec, scratch_size: str) -> dict[str, str]:
    """The `ephemeral-storage` request of scratch on the node's disk: the scheduler places a pod
    by its requests only, so without it a node whose disk cannot hold the emptyDir is chosen,
    and the kubelet evicts the pod for disk pressure once the shards fill it. Nothing for a
    volume of its own."""
    if spec.serialization.scratch_volume is not None:
        return {}
    return {"ephemeral-storage": scratch_size}


def _cpu_pod_spec(
    spec: models.ShardedModelSpec, container: Manifest, volumes: list[Manifest]
) -> Manifest:
    """The pod of a CPU Job (reshard, verify, delete): placed as `verification` says."""
    return _pod_spec(
        container,
        volumes,
        spec.verification.node_selector,
        spec.verification.tolerations,
        spec.serialization.service_account_name,
    )


def _pod_spec(
    container: Manifest,
    volumes: list[Manifest],
    node_selector: dict[str, str],
    tolerations: list[models.Toleration],
    service_account: str | None,
) -> Manifest:
    """A Job's pod: its one container, run once, without an API token; its volumes; where it
    may run and as which ServiceAccount."""
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "containers": [container],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in tolerations
        ]
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    return pod_spec


def _engine_args_flag(extra: dict[str, str]) -> list[str]:
    if not extra:
        return []
    typed = {name: coerce_engine_arg(value) for name, value in normalise_engine_args(extra).items()}
    return ["--engine-args-json", json.dumps(typed, sort_keys=True, separators=(",", ":"))]
