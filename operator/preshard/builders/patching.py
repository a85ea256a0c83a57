"""Point a user's vLLM Deployment at a verified shard set, and put it back.

preshard does not own these Deployments. It changes only what loading the shards needs: the
vLLM container's command line (model directory, TP size, load format, flat tensorizer JSON),
the count of the GPU resource it already asks for, the S3 environment (credentials by Secret
reference), an init container that fetches the config and tokenizer files into an `emptyDir`,
and the encryption key mount. `replicas` is never touched. What the user's fields were and
what preshard made of them are saved in two annotations, so that restoring reverts only
preshard's changes: a field (a flag, an env var, a resource, a mount) still as preshard set it
gets its original value back, and what the user changed meanwhile stays. Every value of the
user's that the patch replaces is reported (`PatchedDeployment.overrides`). A Deployment that
another controller owns is refused unless the target allows it: that controller would put its
own template back. So is a server whose vLLM release is not the one that wrote the shards
(`vllm_version_check`), unless the target allows it. The pod template also gets the label
`preshard.dev/shardedmodel`, as preshard's Job pods have it, so that the operator watches only
the pods that carry it rather than every pod of the cluster.

Whether a Deployment needs a write is decided on the fields preshard manages only
(`managed_view`): server-side defaults on the rest never cause a patch loop. The init
container keeps the tools image it has while nothing else of the patch changes, so an operator
upgrade does not restart every vLLM pod; for the same reason the label is not among those
fields, and a Deployment patched before preshard set it gains it with its next patch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from preshard.api import models
from preshard.builders import Manifest
from preshard.builders.identity import image_tag, vllm_release
from preshard.builders.pods import (
    CA_BUNDLE_PATH,
    CA_BUNDLE_VOLUME,
    ENCRYPTION_KEYFILE,
    ENCRYPTION_VOLUME,
    file_mounts,
    file_volumes,
    s3_endpoint_url,
    s3_env,
    tool_args,
)
from preshard.builders.shardset import ANNOTATION_TP, LABEL_SHARDEDMODEL, BuildInput, owner_label
from preshard.builders.vllm_args import (
    ContainerCommand,
    TensorizerLoad,
    UnsupportedCommandError,
    is_vllm_command,
    restore_vllm_command,
    rewrite_vllm_command,
)
from preshard.contract import reasons
from preshard.contract.layout import MANIFEST_FORMAT, tensorizer_uri

ANNOTATION_OWNER: Final = "preshard.dev/owner"
ANNOTATION_ORIGINAL: Final = "preshard.dev/original"
# The same fields as preshard last wrote them: a restore reverts only what is still like this.
ANNOTATION_PATCHED: Final = "preshard.dev/patched"
ANNOTATION_INPUT_HASH: Final = "preshard.dev/input-hash"
ANNOTATION_ARTIFACT_KEY: Final = "preshard.dev/artifact-key"
# The set loaded before the last switch: old pods still read it until the rollout completes.
ANNOTATION_PREVIOUS_KEY: Final = "preshard.dev/previous-artifact-key"
ANNOTATION_IMAGE: Final = "preshard.dev/container-image"
# How often the same patch was written in a row (`PatchRounds`): a GitOps tool that reverts it
# each time is met with a refusal, not with a GPU restart per round.
ANNOTATION_PATCH_ROUNDS: Final = "preshard.dev/patch-rounds"
# The newest shard-set manifest format the init container's image reads, recorded with the
# image: an image kept from an older release may not read the set's (`_keep_tools_image`).
# Absent on Deployments patched before it was recorded, whose images read format 1.
ANNOTATION_TOOLS_MANIFEST_FORMAT: Final = "preshard.dev/tools-manifest-format"
# The user's: the vLLM release the container runs, when its image tag does not say.
ANNOTATION_VLLM_VERSION: Final = "preshard.dev/vllm-version"
OWNED_ANNOTATIONS: Final = (
    ANNOTATION_OWNER,
    ANNOTATION_ORIGINAL,
    ANNOTATION_PATCHED,
    ANNOTATION_INPUT_HASH,
    ANNOTATION_ARTIFACT_KEY,
    ANNOTATION_PREVIOUS_KEY,
    ANNOTATION_TP,
    ANNOTATION_IMAGE,
    ANNOTATION_PATCH_ROUNDS,
    ANNOTATION_TOOLS_MANIFEST_FORMAT,
)
# preshard's annotations that are records, not the patch: they never cause a write themselves.
RECORD_ANNOTATIONS: Final = (
    ANNOTATION_IMAGE,
    ANNOTATION_PATCH_ROUNDS,
    ANNOTATION_TOOLS_MANIFEST_FORMAT,
)

# The vLLM container's fields a patch changes, recorded before and after it.
CONTAINER_FIELDS: Final = ("command", "args", "env", "resources", "volumeMounts")
INIT_CONTAINER: Final = "preshard-fetch-config"
MODEL_VOLUME: Final = "preshard-model"
TENSORIZER_VOLUME: Final = "preshard-tensorizer"
OWNED_VOLUMES: Final = (MODEL_VOLUME, TENSORIZER_VOLUME, ENCRYPTION_VOLUME, CA_BUNDLE_VOLUME)
# Env vars preshard sets on the vLLM container (replacing any the user had).
MANAGED_ENV: Final = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL_S3",
)
# Set on the vLLM container only with `storage.caBundle`, then replacing any the user had:
# tensorizer reads through `curl`, which trusts `CURL_CA_BUNDLE`; boto3 (its presigning client)
# trusts `AWS_CA_BUNDLE`. Without a bundle, the user's own values stay.
CA_BUNDLE_ENV: Final = ("CURL_CA_BUNDLE", "AWS_CA_BUNDLE")
# Set on the vLLM container too, but merged with the user's value instead of replacing it.
PYTHONPATH_ENV: Final = "PYTHONPATH"
# The extended resources of the accelerators vLLM serves on, as their device plugins name them.
# A container's own GPU resource is kept (set to the TP size), never a second one added beside
# it: a pod asking for two vendors' GPUs fits no node.
GPU_RESOURCES: Final = (
    "nvidia.com/gpu",
    "amd.com/gpu",
    "gpu.intel.com/i915",
    "gpu.intel.com/xe",
    "habana.ai/gaudi",
)
# Any other `<domain>/gpu` resource counts too, also a renamed shared one (`nvidia.com/gpu.shared`).
_GPU_LIKE: Final = re.compile(r"^[a-z0-9.-]+/gpu([.-][a-z0-9._-]+)?$")
INIT_RESOURCES: Final[Manifest] = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"memory": "256Mi"},
}


@dataclass(frozen=True)
class TargetInput(BuildInput):
    """What patching one Deployment needs."""

    container: str | None
    allow_controller_owned: bool = False
    """Patch it even when another controller owns the Deployment (`allowControllerOwned`)."""
    shard_vllm_version: str | None = None
    """The vLLM release that wrote the shard set (its status entry, else the serializer
    image's); None when unknown."""
    allow_vllm_version_mismatch: bool = False
    """Patch it even when the server runs another vLLM release (`allowVllmVersionMismatch`)."""
    manifest_format: int = 1
    """The format of the set's manifest (its status entry; 1 for a set verified before formats
    were recorded, which only format 1 sets were)."""


@dataclass(frozen=True)
class Refusal:
    """Why a Deployment cannot be patched safely; nothing is written."""

    reason: str
    message: str


@dataclass(frozen=True)
class PatchedDeployment:
    """The Deployment as it must be to load the shard set, and what of the user's it changes."""

    deployment: Manifest
    overrides: tuple[str, ...]
    """Each value the user set in the vLLM command line that the patch replaces, in words."""
    version_note: str | None = None
    """What to tell the user about the vLLM versions: not checked, or allowed to differ."""


@dataclass(frozen=True)
class RestoredDeployment:
    """A patched Deployment with preshard's changes undone."""

    deployment: Manifest
    kept: tuple[str, ...]
    """What preshard had set that the user changed since and that is kept as it is."""


def annotations_of(deployment: Manifest) -> dict[str, str]:
    """The Deployment's annotations (empty when it has none)."""
    annotations: dict[str, str] = (deployment.get("metadata") or {}).get("annotations") or {}
    return annotations


def owner_of(deployment: Manifest) -> str | None:
    """The ShardedModel that patched this Deployment, if any."""
    owner: str | None = annotations_of(deployment).get(ANNOTATION_OWNER)
    return owner


def controller_of(deployment: Manifest) -> str | None:
    """The kind and name of the controller that owns the Deployment, if another one does.

    A controller (a KServe InferenceService, a LeaderWorkerSet, any operator) writes the pod
    template it wants back on its next sync, undoing a patch, and the two would keep fighting.
    """
    for reference in (deployment.get("metadata") or {}).get("ownerReferences") or []:
        if reference.get("controller") is True:
            return f"{reference.get('kind', '?')} {reference.get('name', '?')}"
    return None


def applied_artifact_key(deployment: Manifest) -> str | None:
    """The shard set this Deployment was last pointed at by preshard."""
    key: str | None = annotations_of(deployment).get(ANNOTATION_ARTIFACT_KEY)
    return key


def patch_rounds_of(deployment: Manifest) -> Manifest | None:
    """The record of how often the same patch was written (`ANNOTATION_PATCH_ROUNDS`); None
    when there is none or it was mangled."""
    return _recorded(annotations_of(deployment), ANNOTATION_PATCH_ROUNDS)


def patch_rounds_record(record: Manifest) -> str:
    """The annotation value of a record of patch rounds."""
    return _compact(record)


def choose_container(pod_spec: Manifest, wanted: str | None) -> Manifest | Refusal:
    """The vLLM container: the named one, the only one, or the only one that runs vLLM."""
    containers: list[Manifest] = pod_spec.get("containers") or []
    if wanted is not None:
        for container in containers:
            if container.get("name") == wanted:
                return container
        names = ", ".join(str(c.get("name")) for c in containers) or "none"
        return Refusal(
            reasons.CONTAINER_NOT_FOUND,
            f"container {wanted!r} not found (containers: {names})",
        )
    if len(containers) == 1:
        return containers[0]
    running_vllm = [
        c
        for c in containers
        if is_vllm_command(c.get("command"), c.get("args"), image=c.get("image"))
    ]
    if len(running_vllm) == 1:
        return running_vllm[0]
    return Refusal(
        reasons.CONTAINER_NOT_FOUND,
        f"{len(containers)} containers and {len(running_vllm)} of them run vLLM: "
        "name the vLLM container in the target's `container` field",
    )


def gpu_resources_of(container: Manifest, target: TargetInput) -> list[str]:
    """The GPU resources the container requests or limits, sorted.

    A GPU resource is one of `GPU_RESOURCES`, any other `<domain>/gpu` resource, or the one the
    spec or the operator's settings name.
    """
    named = {target.spec.serialization.gpu_resource_name, target.settings.gpu_resource_name}
    resources: Manifest = container.get("resources") or {}
    requested = {*(resources.get("limits") or {}), *(resources.get("requests") or {})}
    return sorted(
        name
        for name in requested
        if name in GPU_RESOURCES or name in named or _GPU_LIKE.match(name)
    )


def gpu_resource(container: Manifest, target: TargetInput) -> str | Refusal:
    """The resource that gets the TP size: the container's own GPU resource, or the spec's.

    A container without any GPU resource is refused unless `serialization.gpuResourceName`
    names the one to add: a vLLM server without GPUs cannot load shards into them, and adding
    the operator's default (`nvidia.com/gpu`) to, say, an Intel Gaudi pod would make it
    unschedulable.
    """
    found = gpu_resources_of(container, target)
    named = target.spec.serialization.gpu_resource_name
    name = container.get("name")
    if len(found) == 1:
        return found[0]
    if found:
        if named in found:
            return named
        return Refusal(
            reasons.AMBIGUOUS_GPU_RESOURCE,
            f"container {name} requests several GPU resources ({', '.join(found)}): name the "
            "one vLLM runs on in serialization.gpuResourceName",
        )
    if named is not None:
        return named
    return Refusal(
        reasons.NO_GPU_RESOURCE,
        f"container {name} requests no GPU (none of {', '.join(GPU_RESOURCES)} or another "
        "<domain>/gpu resource), so it cannot load the shards into GPUs: give it the GPUs it "
        "serves on, or name the GPU resource to add in serialization.gpuResourceName",
    )


def tensorizer_load(target: TargetInput) -> TensorizerLoad:
    """What the vLLM container must load for this shard set."""
    spec, settings = target.spec, target.settings
    endpoint = s3_endpoint_url(spec.storage)
    return TensorizerLoad(
        model_dir=settings.model_dir,
        tensor_parallel_size=target.shard_set.tensor_parallel_size,
        tensorizer_uri=tensorizer_uri(
            target.shard_set.location, target.shard_set.tensor_parallel_size
        ),
        num_readers=spec.loading.num_readers or settings.num_readers,
        s3_endpoint=endpoint if endpoint.startswith("https://") else None,
        encryption_keyfile=ENCRYPTION_KEYFILE if spec.encryption else None,
        verify_hash=spec.loading.verify_hash,
        dtype=spec.serialization.dtype,
        quantization=next(
            (
                value
                for name, value in spec.serialization.extra_engine_args.items()
                if name.replace("-", "_") == "quantization"
            ),
            None,
        ),
    )


def build_patched_deployment(deployment: Manifest, target: TargetInput) -> Manifest | Refusal:
    """The Deployment as it must be to load the shard set, or why it cannot be."""
    patched = patch_deployment(deployment, target)
    return patched if isinstance(patched, Refusal) else patched.deployment


def patch_deployment(deployment: Manifest, target: TargetInput) -> PatchedDeployment | Refusal:
    """The Deployment as it must be to load the shard set and what that overrides of the
    user's, or why it cannot be patched.

    The overrides are worked out from the user's own Deployment (the current one with
    preshard's changes undone), so they stay the same on every pass, not only on the first.
    """
    current_owner = owner_of(deployment)
    if current_owner is not None and current_owner != target.owner.name:
        return Refusal(
            reasons.TARGET_CONFLICT,
            f"Deployment {_name(deployment)} is already managed by ShardedModel {current_owner}",
        )
    controller = controller_of(deployment)
    if controller is not None and not target.allow_controller_owned:
        return Refusal(
            reasons.TARGET_MANAGED_BY_CONTROLLER,
            f"Deployment {_name(deployment)} is controlled by {controller} (its ownerReference "
            "with controller: true), which puts its own pod template back and would undo the "
            "patch: point that resource at the shards instead, or set allowControllerOwned: "
            "true on the target to patch the Deployment anyway",
        )
    desired = copy.deepcopy(deployment)
    pod_spec: Manifest = (
        desired.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    )
    chosen = choose_container(pod_spec, target.container)
    if isinstance(chosen, Refusal):
        return chosen
    version_note = vllm_version_check(deployment, chosen, target)
    if isinstance(version_note, Refusal):
        return version_note
    annotations = annotations_of(deployment)
    users = chosen
    if ANNOTATION_ORIGINAL in annotations:
        own, _ = _unpatched(deployment, keep_edits=False)
        users = _container_named(own, chosen.get("name")) or chosen
    original = snapshot_original(pod_spec, users)
    load = tensorizer_load(target)
    image = str(chosen.get("image") or "")
    try:
        intended = rewrite_vllm_command(users.get("command"), users.get("args"), load, image=image)
        rewritten = rewrite_vllm_command(
            chosen.get("command"), chosen.get("args"), load, image=image
        )
    except UnsupportedCommandError as error:
        return Refusal(error.reason, f"container {chosen.get('name')}: {error.message}")
    gpu = gpu_resource(chosen, target)
    if isinstance(gpu, Refusal):
        return gpu
    _set_or_drop(chosen, "command", rewritten.command)
    _set_or_drop(chosen, "args", rewritten.args)
    _apply_container(chosen, target, gpu)
    _apply_pod(pod_spec, target)
    template = desired["spec"]["template"]
    template.setdefault("metadata", {}).setdefault("labels", {})[LABEL_SHARDEDMODEL] = owner_label(
        target.owner
    )
    kept = _keep_tools_image(deployment, desired, chosen.get("name"), target.manifest_format)

    desired_annotations = desired.setdefault("metadata", {}).setdefault("annotations", {})
    if not kept:
        desired_annotations[ANNOTATION_TOOLS_MANIFEST_FORMAT] = str(MANIFEST_FORMAT)
    applied = annotations.get(ANNOTATION_ARTIFACT_KEY)
    if applied is not None and applied != target.shard_set.artifact_key:
        desired_annotations[ANNOTATION_PREVIOUS_KEY] = applied
    desired_annotations.update(
        {
            ANNOTATION_OWNER: target.owner.name,
            ANNOTATION_ORIGINAL: _compact(original),
            ANNOTATION_PATCHED: _compact(snapshot_original(pod_spec, chosen)),
            ANNOTATION_ARTIFACT_KEY: target.shard_set.artifact_key,
            ANNOTATION_TP: str(target.shard_set.tensor_parallel_size),
            ANNOTATION_IMAGE: str(chosen.get("image", "")),
            ANNOTATION_INPUT_HASH: input_hash(original, target, load),
        }
    )
    return PatchedDeployment(desired, intended.overrides, version_note)


def serving_vllm_version(deployment: Manifest, container: Manifest) -> tuple[str | None, str]:
    """The vLLM release the container serves with and where it was read, or None and why not.

    The Deployment's `preshard.dev/vllm-version` annotation comes first: the user's word beats
    a tag, which a custom image may use for versions of its own. Else the image's tag, when the
    image is a vLLM one (its name holds `vllm`: `vllm/vllm-openai`, `rocm/vllm`, ...);
    `latest`, a digest alone or another image's tag say nothing.
    """
    annotated = annotations_of(deployment).get(ANNOTATION_VLLM_VERSION)
    if annotated is not None:
        release = vllm_release(annotated)
        if release is not None:
            return release, f"the Deployment's annotation {ANNOTATION_VLLM_VERSION}"
        return None, f"its annotation {ANNOTATION_VLLM_VERSION}={annotated!r} names no vLLM release"
    image = str(container.get("image") or "")
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    tag = image_tag(image)
    release = vllm_release(tag) if tag and "vllm" in repository.lower() else None
    if release is not None:
        return release, f"its image {image}"
    return None, f"the image {image or '(none)'} names no vLLM release"


def vllm_version_check(
    deployment: Manifest, container: Manifest, target: TargetInput
) -> str | Refusal | None:
    """Whether the server runs the vLLM release that wrote the shards: a refusal when it does
    not (unless the target allows it), a note when that cannot be told or is allowed.

    Releases match when they are equal but for a build suffix (`identity.vllm_release`): vLLM's
    model code decides the names, shapes and fusing of the serialized weights and may change in
    any release, while the builds of one release for CUDA, ROCm or CPU share that code. An
    unknown side is no reason to refuse: most images are tagged by release, and refusing
    `latest` would refuse most first tries.
    """
    served, source = serving_vllm_version(deployment, container)
    written = vllm_release(target.shard_vllm_version)
    name = container.get("name")
    key = target.shard_set.artifact_key
    if served is None:
        return (
            f"the vLLM version could not be checked: {source} (set the Deployment's annotation "
            f"{ANNOTATION_VLLM_VERSION} to the release container {name} runs; the shards were "
            f"written by vLLM {written or 'of an unknown release'})"
        )
    if written is None:
        return (
            f"the vLLM version could not be checked: the vLLM release that wrote shard set {key} "
            f"is not known (container {name} runs {served})"
        )
    if served == written:
        return None
    if target.allow_vllm_version_mismatch:
        return (
            f"container {name} runs vLLM {served} and shard set {key} was written by vLLM "
            f"{written}: patched anyway (allowVllmVersionMismatch)"
        )
    return Refusal(
        reasons.VLLM_VERSION_MISMATCH,
        f"container {name} runs vLLM {served} (read from {source}) but shard set {key} was "
        f"written by vLLM {written}: another release may name, shape or fuse the weights "
        f"differently, and the server would fail to load them or load them wrong. Serve with "
        f"vLLM {written}, set serialization.image to a serializer image on vLLM {served} (a new "
        "shard set), or set allowVllmVersionMismatch: true on the target to patch it anyway",
    )


def build_restored_deployment(deployment: Manifest) -> Manifest | None:
    """The Deployment with preshard's changes undone; None when it was never patched."""
    restored = restore_deployment(deployment)
    return None if restored is None else restored.deployment


def restore_deployment(deployment: Manifest) -> RestoredDeployment | None:
    """The Deployment with preshard's changes undone, and what of the user's edits to fields
    preshard had set is kept; None when it was never patched.

    Each field preshard changed gets its original value back where it is still as preshard
    set it; what the user added meanwhile (flags, env vars, resources, mounts, containers,
    volumes) stays, and a field of preshard's that the user changed since is kept as the user
    left it and named in `kept`. preshard's init container, volumes, mounts and annotations go.
    """
    if ANNOTATION_ORIGINAL not in annotations_of(deployment):
        return None
    restored, kept = _unpatched(deployment, keep_edits=True)
    restored_annotations = (restored.get("metadata") or {}).get("annotations") or {}
    for key in OWNED_ANNOTATIONS:
        restored_annotations.pop(key, None)
    return RestoredDeployment(restored, kept)


def restore_message(name: str, kept: tuple[str, ...]) -> str:
    """The restore event's message: what was restored, and what of the user's was kept."""
    if not kept:
        return f"Deployment {name} restored"
    return (
        f"Deployment {name} restored; kept your own changes to what preshard had set: "
        + ", ".join(kept)
    )


def overrides_line(overrides: tuple[str, ...]) -> str:
    """The line a target's status message gives to what the patch changed of the user's."""
    return "changed in the vLLM command line: " + "; ".join(overrides)


def snapshot_original(pod_spec: Manifest, container: Manifest) -> Manifest:
    """What restoring needs: the vLLM container's fields that patching changes."""
    snapshot: Manifest = {"container": container.get("name")}
    for field in CONTAINER_FIELDS:
        if field in container:
            snapshot[field] = copy.deepcopy(container[field])
    return snapshot


def input_hash(original: Manifest, target: TargetInput, load: TensorizerLoad) -> str:
    """A hash of everything the patch is computed from, recorded on the Deployment.

    The tools image is not part of it: a new one alone is no reason to write (see
    `_keep_tools_image`).
    """
    inputs: dict[str, object] = {
        "original": original,
        "load": load.__dict__,
        "uri": target.shard_set.uri,
        "storage": target.spec.storage.model_dump(by_alias=True, exclude_none=True),
        "encryption": target.spec.encryption.model_dump(by_alias=True)
        if target.spec.encryption
        else None,
        "gpu": target.spec.serialization.gpu_resource_name or target.settings.gpu_resource_name,
    }
    if target.spec.job_pods.env:
        inputs["jobPodsEnv"] = _job_pods_env(target.spec)
    return hashlib.sha256(_compact(inputs).encode()).hexdigest()[:16]


def managed_view(deployment: Manifest, container_name: str | None) -> Manifest:
    """Only the fields preshard manages: two Deployments equal here need no write.

    Empty lists count as absent, as the API server stores them.
    """
    annotations = annotations_of(deployment)
    pod_spec: Manifest = deployment.get("spec", {}).get("template", {}).get("spec", {})
    containers = {c.get("name"): c for c in pod_spec.get("containers") or []}
    container = containers.get(container_name, {})
    init = next(
        (c for c in pod_spec.get("initContainers") or [] if c.get("name") == INIT_CONTAINER), None
    )
    return {
        "annotations": {
            k: annotations.get(k) for k in OWNED_ANNOTATIONS if k not in RECORD_ANNOTATIONS
        },
        "command": container.get("command"),
        "args": container.get("args"),
        "env": [
            e
            for e in container.get("env") or []
            if e.get("name") in (*MANAGED_ENV, *CA_BUNDLE_ENV, PYTHONPATH_ENV)
        ],
        "limits": (container.get("resources") or {}).get("limits"),
        "requests": (container.get("resources") or {}).get("requests"),
        "mounts": [
            m for m in container.get("volumeMounts") or [] if m.get("name") in OWNED_VOLUMES
        ],
        "init": None
        if init is None
        else {k: init.get(k) or None for k in ("image", "command", "args", "env", "volumeMounts")},
        "volumes": [v for v in pod_spec.get("volumes") or [] if v.get("name") in OWNED_VOLUMES],
    }


def generation_of(deployment: Manifest) -> int:
    """The Deployment's `metadata.generation` (0 before the API server set one)."""
    return int((deployment.get("metadata") or {}).get("generation") or 0)


def identity_of(deployment: Manifest) -> tuple[str, int]:
    """The Deployment's uid and generation: which object, and which version of its spec."""
    return str((deployment.get("metadata") or {}).get("uid") or ""), generation_of(deployment)


def deployment_patch(current: Manifest, desired: Manifest) -> list[Manifest]:
    """A JSON patch of the pod template and preshard's annotations, guarded by generation.

    The `test` of `metadata.generation` makes the API server refuse the write if the spec
    changed since it was read, so a concurrent edit is never overwritten; status updates by the
    Deployment controller (which change the resourceVersion, not the generation) do not get in
    the way. Annotations are set key by key, so other writers' annotations are kept.
    """
    ops: list[Manifest] = [
        {"op": "test", "path": "/metadata/generation", "value": generation_of(current)}
    ]
    have = annotations_of(current)
    want = (desired.get("metadata") or {}).get("annotations") or {}
    if not have and want:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    for key in OWNED_ANNOTATIONS:
        path = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
        if key in want and have.get(key) != want[key]:
            ops.append({"op": "add", "path": path, "value": want[key]})
        elif key not in want and key in have:
            ops.append({"op": "remove", "path": path})
    ops.append({"op": "replace", "path": "/spec/template", "value": desired["spec"]["template"]})
    return ops


def rollout_state(deployment: Manifest) -> str:
    """`complete` once every replica runs the current template, else `in progress`.

    Coarse on purpose: per-replica counts would change the status, and so cost a write, with
    every pod that becomes ready.
    """
    return "complete" if rollout_complete(deployment) else "in progress"


def rollout_complete(deployment: Manifest) -> bool:
    """Whether every replica runs the current pod template (old pods are gone)."""
    status: Manifest = deployment.get("status") or {}
    replicas = int((deployment.get("spec") or {}).get("replicas", 1))
    observed = int(status.get("observedGeneration", 0)) >= int(
        deployment.get("metadata", {}).get("generation", 0)
    )
    return (
        observed
        and int(status.get("updatedReplicas", 0)) == replicas
        and int(status.get("replicas", replicas)) == replicas
    )


def _apply_container(container: Manifest, target: TargetInput, gpu: str) -> None:
    spec = target.spec
    tp = str(target.shard_set.tensor_parallel_size)
    resources: Manifest = container.setdefault("resources", {})
    resources.setdefault("limits", {})[gpu] = tp
    if gpu in (resources.get("requests") or {}):
        resources["requests"][gpu] = tp
    env = [
        e
        for e in container.get("env") or []
        if e.get("name") not in MANAGED_ENV and not _is_ca_bundle_env(e, spec.storage)
    ]
    env += s3_env(spec.storage)
    # tensorizer refuses a plain-http endpoint passed as an argument, but reads this one; and
    # without either it would fall back to its own default store, not the region's AWS one.
    env.append({"name": "AWS_ENDPOINT_URL_S3", "value": s3_endpoint_url(spec.storage)})
    if spec.storage.ca_bundle is not None:
        env += [{"name": name, "value": CA_BUNDLE_PATH} for name in CA_BUNDLE_ENV]
    env = _with_tensorizer_on_path(env, target.settings.tensorizer_dir)
    env = _in_current_order(env, container.get("env"), lambda e: e.get("name"))
    _set_or_drop(container, "env", env or None)
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") not in OWNED_VOLUMES]
    mounts.append({"name": MODEL_VOLUME, "mountPath": target.settings.model_dir, "readOnly": True})
    mounts.append(
        {"name": TENSORIZER_VOLUME, "mountPath": target.settings.tensorizer_dir, "readOnly": True}
    )
    mounts += file_mounts(spec, encryption_key=True)
    container["volumeMounts"] = _in_current_order(
        mounts, container.get("volumeMounts"), lambda m: (m.get("name"), m.get("mountPath"))
    )


def _apply_pod(pod_spec: Manifest, target: TargetInput) -> None:
    spec, settings = target.spec, target.settings
    init_container: Manifest = {
        "name": INIT_CONTAINER,
        "image": settings.tools_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["preshard"],
        "args": [
            "fetch-config",
            target.shard_set.uri,
            settings.model_dir,
            "--tensorizer-dir",
            settings.tensorizer_dir,
            *tool_args(spec.storage, settings),
        ],
        "resources": INIT_RESOURCES,
        "volumeMounts": [
            {"name": MODEL_VOLUME, "mountPath": settings.model_dir},
            {"name": TENSORIZER_VOLUME, "mountPath": settings.tensorizer_dir},
            *file_mounts(spec, encryption_key=False),
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    _set_or_drop(init_container, "env", [*s3_env(spec.storage), *_job_pods_env(spec)] or None)
    init = [c for c in pod_spec.get("initContainers") or [] if c.get("name") != INIT_CONTAINER]
    pod_spec["initContainers"] = _in_current_order(
        [*init, init_container], pod_spec.get("initContainers"), lambda c: c.get("name")
    )
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") not in OWNED_VOLUMES]
    volumes.append({"name": MODEL_VOLUME, "emptyDir": {}})
    volumes.append({"name": TENSORIZER_VOLUME, "emptyDir": {}})
    volumes += file_volumes(spec, encryption_key=True)
    pod_spec["volumes"] = _in_current_order(
        volumes, pod_spec.get("volumes"), lambda v: v.get("name")
    )


def _job_pods_env(spec: models.ShardedModelSpec) -> list[Manifest]:
    # The init container reads the same store as the Jobs: through the same proxy and CA.
    return [e.model_dump(by_alias=True, exclude_none=True) for e in spec.job_pods.env]


def _is_ca_bundle_env(entry: Manifest, storage: models.Storage) -> bool:
    """Whether a CA variable of the container is replaced: any of them when the store has a
    bundle, else only one preshard set earlier (the bundle was removed from the spec)."""
    if entry.get("name") not in CA_BUNDLE_ENV:
        return False
    return storage.ca_bundle is not None or entry.get("value") == CA_BUNDLE_PATH


def _keep_tools_image(
    current: Manifest, desired: Manifest, container_name: object, manifest_format: int
) -> bool:
    """Give preshard's init container back the image it has, unless more of the patch changes or
    that image cannot read the set's manifest; whether it was kept.

    The tools image follows the operator's version. Writing a new one alone would restart every
    patched vLLM pod on each operator upgrade for nothing: the same `fetch-config` arguments do
    the same work. It moves with the next write the patch needs for another reason, or when the
    set is in a manifest format newer than the image reads (made again after an upgrade).
    """
    have, want = _fetch_config(current), _fetch_config(desired)
    if have is None or want is None or have.get("image") in (None, want.get("image")):
        return False
    if tools_manifest_format(current) < manifest_format:
        return False
    newer = want["image"]
    want["image"] = have["image"]
    name = container_name if isinstance(container_name, str) else None
    if _template_view(desired, name) != _template_view(current, name):
        want["image"] = newer
        return False
    return True


def tools_manifest_format(deployment: Manifest) -> int:
    """The newest manifest format the init container's image reads, as recorded (1 when not)."""
    recorded = annotations_of(deployment).get(ANNOTATION_TOOLS_MANIFEST_FORMAT, "1")
    return int(recorded) if recorded.isdigit() else 1


def _fetch_config(deployment: Manifest) -> Manifest | None:
    pod_spec: Manifest = (deployment.get("spec") or {}).get("template", {}).get("spec") or {}
    return next(
        (c for c in pod_spec.get("initContainers") or [] if c.get("name") == INIT_CONTAINER), None
    )


def _template_view(deployment: Manifest, container_name: str | None) -> Manifest:
    """The managed fields of the pod template (preshard's annotations left out)."""
    return {k: v for k, v in managed_view(deployment, container_name).items() if k != "annotations"}


def _in_current_order(
    entries: list[Manifest], current: list[Manifest] | None, key: Callable[[Manifest], Hashable]
) -> list[Manifest]:
    """`entries` in the order the same entries have now, when it holds exactly those.

    A patched list is the user's entries with preshard's after them; once the user adds one
    after preshard's, the next patch would move it and restart every pod for nothing.
    """
    keys = [key(entry) for entry in entries]
    position = {key(entry): index for index, entry in enumerate(current or [])}
    if len(set(keys)) != len(keys) or set(keys) != set(position) or len(position) != len(keys):
        return entries
    return sorted(entries, key=lambda entry: position[key(entry)])


def _with_tensorizer_on_path(env: list[Manifest], directory: str) -> list[Manifest]:
    """`env` with the bundled tensorizer first on `PYTHONPATH`, keeping the user's entries.

    The stock vLLM image has no tensorizer; the init container copies the version vLLM pins
    into `directory`. Entries after it are the user's own, so a second patch finds them and
    restoring the snapshot gives back exactly what the user wrote.
    """
    kept: list[Manifest] = []
    user_path = ""
    for entry in env:
        if entry.get("name") == PYTHONPATH_ENV and "valueFrom" not in entry:
            parts = [p for p in str(entry.get("value", "")).split(":") if p and p != directory]
            user_path = ":".join(parts)
        else:
            kept.append(entry)
    value = f"{directory}:{user_path}" if user_path else directory
    return [*kept, {"name": PYTHONPATH_ENV, "value": value}]


def _unpatched(deployment: Manifest, *, keep_edits: bool) -> tuple[Manifest, tuple[str, ...]]:
    """A copy of the Deployment with preshard's changes undone, and what of preshard's the
    user changed and was kept (only with `keep_edits`; without, those get their original
    values, which is the user's own Deployment while preshard re-asserts its fields)."""
    annotations = annotations_of(deployment)
    original = _recorded(annotations, ANNOTATION_ORIGINAL) or {}
    patched = _recorded(annotations, ANNOTATION_PATCHED)
    restored = copy.deepcopy(deployment)
    pod_spec: Manifest = (restored.get("spec") or {}).get("template", {}).get("spec") or {}
    kept: list[str] = []
    name = original.get("container")
    container = _container_named(restored, name)
    if container is not None and (patched is None or patched.get("container") != name):
        # Patched by a version that recorded only the original: put it back as it was.
        for field in CONTAINER_FIELDS:
            _set_or_drop(container, field, original.get(field))
    elif container is not None and patched is not None:
        kept = _unpatch_container(container, original, patched, keep_edits=keep_edits)
    if "initContainers" in pod_spec:
        init = [c for c in pod_spec["initContainers"] or [] if c.get("name") != INIT_CONTAINER]
        _set_or_drop(pod_spec, "initContainers", init or None)
    if "volumes" in pod_spec:
        volumes = [v for v in pod_spec["volumes"] or [] if v.get("name") not in OWNED_VOLUMES]
        _set_or_drop(pod_spec, "volumes", volumes or None)
    template: Manifest = (restored.get("spec") or {}).get("template") or {}
    labels = (template.get("metadata") or {}).get("labels")
    if labels and LABEL_SHARDEDMODEL in labels:
        del labels[LABEL_SHARDEDMODEL]
        _set_or_drop(template["metadata"], "labels", labels or None)
        _set_or_drop(template, "metadata", template["metadata"] or None)
    return restored, tuple(kept)


def _recorded(annotations: dict[str, str], key: str) -> Manifest | None:
    """A JSON annotation preshard wrote; None when it is missing or was mangled."""
    try:
        value = json.loads(annotations[key])
    except (KeyError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _container_named(deployment: Manifest, name: object) -> Manifest | None:
    pod_spec: Manifest = (deployment.get("spec") or {}).get("template", {}).get("spec") or {}
    return next((c for c in pod_spec.get("containers") or [] if c.get("name") == name), None)


def _unpatch_container(
    container: Manifest, original: Manifest, patched: Manifest, *, keep_edits: bool
) -> list[str]:
    """Undo the patch of the vLLM container field by field; what of preshard's is kept."""
    restored = restore_vllm_command(
        ContainerCommand(container.get("command"), container.get("args")),
        ContainerCommand(patched.get("command"), patched.get("args")),
        ContainerCommand(original.get("command"), original.get("args")),
        keep_edits=keep_edits,
    )
    _set_or_drop(container, "command", restored.command)
    _set_or_drop(container, "args", restored.args)
    kept = list(restored.kept)

    directory = _bundle_directory(patched.get("env"))
    env, edited = _merge_by_key(
        original.get("env"),
        _without_bundle(patched.get("env"), directory),
        _without_bundle(container.get("env"), directory),
        lambda entry: entry.get("name"),
        keep_edits=keep_edits,
        unchanged=_normal(container.get("env")) == _normal(patched.get("env")),
    )
    _set_or_drop(container, "env", env)
    kept += [f"env {name}" for name in edited]

    resources, edited_resources = _merge_resources(
        original.get("resources"),
        patched.get("resources"),
        container.get("resources"),
        keep_edits=keep_edits,
    )
    _set_or_drop(container, "resources", resources)
    kept += edited_resources

    mounts, edited = _merge_by_key(
        original.get("volumeMounts"),
        _without_owned_mounts(patched.get("volumeMounts")),
        _without_owned_mounts(container.get("volumeMounts")),
        lambda mount: (mount.get("name"), mount.get("mountPath")),
        keep_edits=keep_edits,
        unchanged=_normal(container.get("volumeMounts")) == _normal(patched.get("volumeMounts")),
    )
    _set_or_drop(container, "volumeMounts", mounts)
    kept += [f"volumeMount {k[1] if isinstance(k, tuple) else k}" for k in edited]
    return kept


def _bundle_directory(env: list[Manifest] | None) -> str | None:
    """The bundled tensorizer's directory: the first entry preshard put on `PYTHONPATH`."""
    for entry in env or []:
        if entry.get("name") == PYTHONPATH_ENV and "value" in entry:
            return str(entry["value"]).split(":", 1)[0]
    return None


def _without_bundle(env: list[Manifest] | None, directory: str | None) -> list[Manifest] | None:
    """`env` with the bundled tensorizer's directory taken off `PYTHONPATH` (an entry left
    empty goes): what remains of it is the user's own."""
    if env is None or directory is None:
        return env
    result: list[Manifest] = []
    for entry in env:
        if entry.get("name") == PYTHONPATH_ENV and "valueFrom" not in entry:
            parts = [p for p in str(entry.get("value", "")).split(":") if p and p != directory]
            if not parts:
                continue
            entry = {**entry, "value": ":".join(parts)}  # noqa: PLW2901 - a changed copy
        result.append(entry)
    return result


def _without_owned_mounts(mounts: list[Manifest] | None) -> list[Manifest] | None:
    if mounts is None:
        return None
    return [m for m in mounts if m.get("name") not in OWNED_VOLUMES]


def _merge_resources(
    original: Manifest | None,
    patched: Manifest | None,
    current: Manifest | None,
    *,
    keep_edits: bool,
) -> tuple[Manifest | None, list[str]]:
    """The container's resources restored resource by resource, in limits and requests."""
    if _normal(current) == _normal(patched):
        return original, []
    result: Manifest = {}
    kept: list[str] = []
    sections = dict.fromkeys([*(original or {}), *(current or {}), *(patched or {})])
    for section in sections:
        values = [(part or {}).get(section) for part in (original, patched, current)]
        if all(value is None or isinstance(value, dict) for value in values):
            before, set_, now = (None if v is None else list(v.items()) for v in values)
            merged, edited = _merge_by_key(
                before,
                set_,
                now,
                lambda item: item[0],
                keep_edits=keep_edits,
                unchanged=_normal(values[2]) == _normal(values[1]),
            )
            kept += [f"resources.{section} {name}" for name in edited]
            if merged:
                result[section] = dict(merged)
        else:
            value, edited_section = _pick(*values, keep_edits=keep_edits)
            kept += [f"resources.{section}"] if edited_section else []
            if value is not _MISSING and value is not None:
                result[section] = value
    return result or (original if original == {} else None), kept


_Entry = TypeVar("_Entry")
_MISSING: Final = object()


def _merge_by_key(
    original: list[_Entry] | None,
    patched: list[_Entry] | None,
    current: list[_Entry] | None,
    key: Callable[[_Entry], Hashable],
    *,
    keep_edits: bool,
    unchanged: bool,
) -> tuple[list[_Entry] | None, list[Any]]:
    """A list field (env, mounts, resources) restored entry by entry, keyed by `key`.

    An entry still as preshard set it gets its original value back (or goes, if preshard
    added it); an entry the user added or changed stays, where the user put it. Entries keep
    the original order, the user's new ones follow the entry they follow in the current list.
    Returns the list (None when empty) and the keys of preshard's entries the user changed
    that are kept. `unchanged`: the whole field is as preshard wrote it.
    """
    if unchanged:
        return original, []
    lists = [list(entries or []) for entries in (original, patched, current)]
    keyed = [[key(entry) for entry in entries] for entries in lists]
    if any(len(set(keys)) != len(keys) for keys in keyed):
        # Several entries with one key: no entry-by-entry answer, so the field as a whole.
        value, edited = _pick(original, patched, current, keep_edits=keep_edits)
        return (None if value is _MISSING else value), (["(all)"] if edited else [])
    before, set_, now = (dict(zip(k, e, strict=True)) for k, e in zip(keyed, lists, strict=True))
    kept: list[Any] = []

    def value_of(entry_key: Hashable) -> Any:
        value, edited = _pick(
            before.get(entry_key, _MISSING),
            set_.get(entry_key, _MISSING),
            now.get(entry_key, _MISSING),
            keep_edits=keep_edits,
        )
        if edited:
            kept.append(entry_key)
        return value

    result: list[tuple[Hashable, Any]] = []
    for entry_key in keyed[0]:
        value = value_of(entry_key)
        if value is not _MISSING:
            result.append((entry_key, value))
    for index, entry_key in enumerate(keyed[2]):
        if entry_key in before:
            continue
        value = value_of(entry_key)
        if value is _MISSING:
            continue
        placed = [k for k, _ in result]
        after = next((k for k in reversed(keyed[2][:index]) if k in placed), None)
        result.insert(0 if after is None else placed.index(after) + 1, (entry_key, value))
    for entry_key in keyed[1]:
        if entry_key not in before and entry_key not in now:
            value_of(entry_key)  # preshard's entry, removed by the user: noted if kept so
    return [value for _, value in result] or None, kept


def _pick(before: Any, set_: Any, now: Any, *, keep_edits: bool) -> tuple[Any, bool]:
    """One value restored: the original where it is still as preshard set it, else the
    user's (a change of one of preshard's values only with `keep_edits`, then noted)."""
    if _normal(now) == _normal(set_):
        return before, False
    if _normal(set_) == _normal(before):
        return now, False
    if keep_edits:
        return now, True
    return before, False


def _normal(value: Any) -> Any:
    """A value as the API server compares it: empty lists and maps count as absent."""
    if isinstance(value, dict):
        kept = {k: _normal(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, [], {})} or None
    if isinstance(value, list):
        return [_normal(v) for v in value] or None
    return None if value is _MISSING else value


def _name(deployment: Manifest) -> str:
    return str((deployment.get("metadata") or {}).get("name", "?"))


def _set_or_drop(obj: Manifest, key: str, value: Any) -> None:
    if value is None:
        obj.pop(key, None)
    else:
        obj[key] = value


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
