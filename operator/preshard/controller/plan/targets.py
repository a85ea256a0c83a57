"""The target Deployments: which ones the spec names, the set each should load, the patch or
restore that takes it there, and how far its rollout is.

A target is pointed at a set only once it is Verified; while a new set is built it keeps
serving the one it has (an ordered transition).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from preshard.api import models
from preshard.api.status import ShardSetStatus, TargetStatus
from preshard.builders import Manifest, patching
from preshard.builders.identity import serializer_vllm_version
from preshard.builders.rollout import Rollout, rollout_of, template_digests
from preshard.builders.shardset import ShardSet
from preshard.contract import reasons
from preshard.controller.plan.context import Actions, Context
from preshard.controller.plan.model import (
    ANNOTATION_RETRY,
    MESSAGE_LIMIT,
    DeploymentPatch,
    Event,
    clip,
    parse_time,
    timestamp,
)

# The same patch (same inputs, spec generation and retry value) is written at most this many
# times within the window; when something reverts it once more, the target is refused
# (TargetReverted) instead of restarting its GPU pods round after round.
PATCH_ROUNDS: Final = 3
PATCH_ROUNDS_WINDOW: Final = timedelta(minutes=10)


@dataclass(frozen=True)
class Targets:
    """The targets' statuses, the sets they load, and the patches and events they need."""

    statuses: tuple[TargetStatus, ...]
    in_use: frozenset[str]
    """Sets a Deployment loads now, or its old pods load until its rollout completes."""
    actions: Actions


def plan_targets(
    context: Context, desired: Mapping[int, ShardSet], entries: Mapping[str, ShardSetStatus]
) -> Targets:
    """Every target of the spec, and the restore of each Deployment this resource patched that
    is no target any more. `desired` holds the wanted set by TP size, `entries` the sets'
    entries (this pass's for the wanted ones) by artifact key."""
    spec = context.spec
    owner = context.resource.owner
    deployments = context.observed.deployments
    statuses: list[TargetStatus] = []
    actions = Actions()
    matched: set[str] = set()
    for spec_target in spec.targets:
        tp = spec.target_tp(spec_target)
        names = _resolve(context, spec_target)
        if not names:
            statuses.append(
                TargetStatus(
                    name=spec_target.name or "(selector)",
                    tensor_parallel_size=tp,
                    state="NotFound",
                    reason=reasons.TARGET_NOT_FOUND,
                    message=f"{spec_target.label} not found in namespace "
                    f"{owner.namespace}; waiting for it",
                )
            )
        for name in names:
            if name in matched:
                continue
            matched.add(name)
            status, needed = _target(context, name, spec_target, desired[tp], entries)
            statuses.append(status)
            actions += needed
    for name, deployment in sorted(deployments.items()):
        if name not in matched and patching.owner_of(deployment) == owner.name:
            actions += _restore(name, deployment)
    owned = [d for d in deployments.values() if patching.owner_of(d) == owner.name]
    in_use = frozenset(key for deployment in owned for key in _loaded_sets(deployment))
    return Targets(statuses=tuple(statuses), in_use=in_use, actions=actions)


def _resolve(context: Context, spec_target: models.Target) -> list[str]:
    deployments = context.observed.deployments
    if spec_target.name is not None:
        return [spec_target.name] if spec_target.name in deployments else []
    assert spec_target.selector is not None  # noqa: S101 - the model guarantees one of both
    return sorted(
        name
        for name, deployment in deployments.items()
        if spec_target.selector.matches((deployment.get("metadata") or {}).get("labels") or {})
    )


def _target(
    context: Context,
    name: str,
    spec_target: models.Target,
    wanted: ShardSet,
    entries: Mapping[str, ShardSetStatus],
) -> tuple[TargetStatus, Actions]:
    deployment = context.observed.deployments[name]
    spec = context.spec
    tp = wanted.tensor_parallel_size
    base = TargetStatus(name=name, tensor_parallel_size=tp, state="Waiting")
    owner = patching.owner_of(deployment)
    if owner is not None and owner != context.resource.owner.name:
        conflict = base.model_copy(
            update={
                "state": "Conflict",
                "reason": reasons.TARGET_CONFLICT,
                "message": f"Deployment {name} is already managed by ShardedModel {owner}",
            }
        )
        return conflict, Actions()
    applied = patching.applied_artifact_key(deployment) if owner else None
    wanted_entry = entries.get(wanted.artifact_key)
    serving = _serving_set(wanted, wanted_entry, applied, entries, spec)
    if serving is None:
        entry_reason = wanted_entry.reason if wanted_entry else reasons.WAITING_FOR_SHARDS
        failed = wanted_entry is not None and wanted_entry.stage == "Failed"
        waiting = base.model_copy(
            update={
                "artifact_key": applied,
                "reason": entry_reason if failed else reasons.WAITING_FOR_SHARDS,
                "message": f"waiting for the TP {tp} shard set {wanted.artifact_key}"
                + (
                    f" ({wanted_entry.reason}: {wanted_entry.message})"
                    if failed and wanted_entry
                    else ""
                ),
                "rollout": rollout_of(deployment).summary if applied else None,
            }
        )
        return waiting, Actions()
    serving_entry = entries.get(serving.artifact_key)
    target_input = patching.TargetInput(
        owner=context.resource.owner,
        spec=spec,
        shard_set=serving,
        settings=context.settings,
        container=spec_target.container,
        allow_controller_owned=spec_target.allow_controller_owned,
        shard_vllm_version=(serving_entry.vllm_version if serving_entry else None)
        or serializer_vllm_version(spec, context.settings),
        allow_vllm_version_mismatch=spec_target.allow_vllm_version_mismatch,
        manifest_format=(serving_entry.manifest_format if serving_entry else None) or 1,
    )
    patched = patching.patch_deployment(deployment, target_input)
    if isinstance(patched, patching.Refusal):
        refused = base.model_copy(
            update={
                "artifact_key": applied,
                "state": "Refused",
                "reason": patched.reason,
                "message": patched.message,
            }
        )
        return refused, Actions()
    status, actions = _patched_target(
        context, name, spec_target, deployment, patched.deployment, base, serving, wanted
    )
    if status.state == "Refused":
        return status, actions
    overridden, warning = _with_overrides(context, status, patched.overrides)
    return _with_line(overridden, patched.version_note), actions + warning


def _patched_target(
    context: Context,
    name: str,
    spec_target: models.Target,
    deployment: Manifest,
    desired: Manifest,
    base: TargetStatus,
    serving: ShardSet,
    wanted: ShardSet,
) -> tuple[TargetStatus, Actions]:
    """The state of a target its set can be loaded by, and the patch it needs. `desired` is
    the Deployment as the patch makes it: this pass's own copy, which takes the record of patch
    rounds."""
    tp = wanted.tensor_parallel_size
    owner = patching.owner_of(deployment)
    container = patching.choose_container(
        desired["spec"]["template"]["spec"], spec_target.container
    )
    container_name = container.get("name") if isinstance(container, dict) else None
    switched = serving.artifact_key == wanted.artifact_key
    base = base.model_copy(
        update={
            "container": container_name,
            "artifact_key": serving.artifact_key,
            "tensor_parallel_size": serving.tensor_parallel_size,
        }
    )
    rolled_back = _rolled_back(context, name, serving.artifact_key)
    if rolled_back is not None:
        # Its patched rollout failed and the original template was put back: not again for
        # this set until the spec or the retry annotation changes.
        if owner != context.resource.owner.name:
            return rolled_back, Actions()
        return rolled_back, _restore(name, deployment)  # the restore is not in the index yet
    patches: tuple[DeploymentPatch, ...] = ()
    if patching.managed_view(desired, container_name) != patching.managed_view(
        deployment, container_name
    ):
        rounds = _patch_rounds(context, name, deployment, desired)
        if rounds is None:
            return _reverted(name, deployment, base), Actions()
        patching.annotations_of(desired)[patching.ANNOTATION_PATCH_ROUNDS] = rounds
        patches = (
            DeploymentPatch(
                name=name,
                patch=patching.deployment_patch(deployment, desired),
                planned_from=patching.identity_of(deployment),
            ),
        )
    rollout = rollout_of(deployment)
    # A template patched now starts a rollout the Deployment's status does not show yet.
    summary = "in progress" if patches else rollout.summary
    if not switched:
        serves = base.model_copy(
            update={
                "reason": reasons.WAITING_FOR_SHARDS,
                "message": f"serves {serving.uri} until TP {tp} set "
                f"{wanted.artifact_key} is verified",
                "rollout": summary,
            }
        )
        return serves, Actions(patches=patches)
    if patches:
        rolling = base.model_copy(
            update={
                "state": "RollingOut",
                "reason": reasons.ROLLING_OUT,
                "message": f"rolling out the patched template that loads {serving.uri}",
                "rollout": summary,
            }
        )
        return rolling, Actions(patches=patches)
    return _rollout_state(context, name, spec_target, deployment, base, serving, rollout)


def _patch_rounds(
    context: Context, name: str, deployment: Manifest, desired: Manifest
) -> str | None:
    """The record of patch rounds to write with this patch; None when writing it again
    would be one round too many.

    A round is a write of the same patch: the same inputs (`preshard.dev/input-hash`), spec
    generation and retry value. Only a revert of the patch (a GitOps tool's, or a hand edit
    of a managed field) makes preshard write the same patch again; a changed input starts
    over at one. Once refused, it stays refused for the same record, however long ago the
    rounds were: a new spec generation or retry value tries again.
    """
    resource = context.resource
    record = patching.patch_rounds_of(deployment)
    wanted = {
        "inputHash": patching.annotations_of(desired).get(patching.ANNOTATION_INPUT_HASH),
        "generation": resource.generation,
        "retry": resource.annotations.get(ANNOTATION_RETRY),
    }
    same = record is not None and all(record.get(k) == v for k, v in wanted.items())
    previous = next((t for t in resource.status.targets if t.name == name), None)
    if same and previous is not None and previous.reason == reasons.TARGET_REVERTED:
        return None
    since = _time_of(record.get("since")) if same and record else None
    count = record.get("count") if same and record else None
    if since is None or not isinstance(count, int) or context.now - since > PATCH_ROUNDS_WINDOW:
        since, count = context.now, 0
    if count >= PATCH_ROUNDS:
        return None
    return patching.patch_rounds_record({**wanted, "count": count + 1, "since": timestamp(since)})


def _reverted(name: str, deployment: Manifest, base: TargetStatus) -> TargetStatus:
    """A target whose patch something keeps reverting: left as that writer made it."""
    record = patching.patch_rounds_of(deployment) or {}
    minutes = int(PATCH_ROUNDS_WINDOW.total_seconds() // 60)
    return base.model_copy(
        update={
            "state": "Refused",
            "reason": reasons.TARGET_REVERTED,
            "message": clip(
                f"the patch of Deployment {name} was undone {record.get('count', '?')} times "
                f"within {minutes} minutes of its first write: something else (Argo CD or "
                "Flux with self-heal, another controller, a script) puts its own pod "
                "template back. preshard stops patching it rather than restart its GPU pods "
                "each round, and leaves it as that writer made it. Make the two coexist: "
                "have that tool ignore the fields preshard manages (Argo CD: "
                "ignoreDifferences with managedFieldsManagers: [preshard] and "
                "RespectIgnoreDifferences=true; see the GitOps section of docs/install.md), "
                f"then set a new {ANNOTATION_RETRY} value or change the spec to patch again"
            ),
            "rollout": rollout_of(deployment).summary,
        }
    )


def _with_line(status: TargetStatus, line: str | None) -> TargetStatus:
    """The status with one more line in its message (clipped to fit)."""
    if line is None or status.state == "RolledBack":
        return status
    return status.model_copy(update={"message": clip(f"{status.message}\n{line}")})


def _with_overrides(
    context: Context, status: TargetStatus, overrides: tuple[str, ...]
) -> tuple[TargetStatus, Actions]:
    """The status with a line on what the patch changed of the user's command line, and a
    Warning event when that line is new: nothing of theirs is replaced without a word."""
    if not overrides or status.state == "RolledBack":
        return status, Actions()
    line = patching.overrides_line(overrides)
    line = line if len(line) <= MESSAGE_LIMIT // 2 else line[: MESSAGE_LIMIT // 2 - 3] + "..."
    previous = next((t for t in context.resource.status.targets if t.name == status.name), None)
    warning = Actions()
    if previous is None or line not in previous.message:
        warning = Actions(
            events=(
                Event(
                    "Warning",
                    reasons.ARGS_OVERRIDDEN,
                    f"Deployment {status.name}: {line}",
                    deployment=status.name,
                ),
            )
        )
    room = MESSAGE_LIMIT - len(line) - 1
    message = status.message if len(status.message) <= room else status.message[: room - 3]
    if message != status.message:
        message += "..."
    return status.model_copy(update={"message": f"{message}\n{line}"}), warning


def _rollout_state(
    context: Context,
    name: str,
    spec_target: models.Target,
    deployment: Manifest,
    base: TargetStatus,
    serving: ShardSet,
    rollout: Rollout,
) -> tuple[TargetStatus, Actions]:
    """The state of a patched target from its rollout and its pods."""
    container_name = base.container
    if rollout.serving:
        image_note = _image_note(deployment, container_name)
        scaled = rollout.phase == "ScaledToZero"
        patched = base.model_copy(
            update={
                "state": "Patched",
                "reason": reasons.TARGET_IMAGE_CHANGED
                if image_note
                else reasons.SCALED_TO_ZERO
                if scaled
                else reasons.PATCHED,
                "message": image_note
                or f"loads {serving.uri}"
                + ("; scaled to zero replicas, it serves nothing" if scaled else ""),
                "rollout": rollout.summary,
            }
        )
        return patched, Actions()
    problem = _pod_problem(context, name, deployment, container_name)
    resource = context.resource
    if rollout.phase == "DeadlineExceeded":
        failure = f"the rollout of {serving.uri} exceeded its progress deadline"
        detail = problem or rollout.detail
        if spec_target.on_rollout_failure == "Restore":
            rolled_back = base.model_copy(
                update={
                    "state": "RolledBack",
                    "artifact_key": None,
                    "reason": reasons.ROLLOUT_FAILED,
                    "message": clip(
                        f"{failure} ({detail}); the original template is restored. A spec "
                        f"change or a new {ANNOTATION_RETRY} value patches it again"
                    ),
                    "rollout": "restored",
                    "failed_artifact_key": serving.artifact_key,
                    "failed_generation": resource.generation,
                    "retry_token": resource.annotations.get(ANNOTATION_RETRY),
                }
            )
            return rolled_back, _restore(name, deployment)
        return _unavailable(base, f"{failure} ({detail})", rollout), Actions()
    if problem is not None:
        failing = f"patched pods of {serving.uri} fail: {problem}"
        return _unavailable(base, failing, rollout), Actions()
    rolling = base.model_copy(
        update={
            "state": "RollingOut",
            "reason": reasons.ROLLING_OUT,
            "message": f"rolling out the patched template that loads {serving.uri}",
            "rollout": rollout.summary,
        }
    )
    return rolling, Actions()


def _unavailable(base: TargetStatus, message: str, rollout: Rollout) -> TargetStatus:
    """A patched target whose pods do not come up."""
    return base.model_copy(
        update={
            "state": "Unavailable",
            "reason": reasons.TARGET_UNAVAILABLE,
            "message": clip(message),
            "rollout": rollout.summary,
        }
    )


def _pod_problem(
    context: Context, name: str, deployment: Manifest, container_name: str | None
) -> str | None:
    """What the first failing pod of the current patched template says, if one fails."""
    digests = template_digests(deployment, container_name)
    if digests is None:
        return None
    pods = sorted(context.observed.target_pods.get(name, ()), key=lambda p: (p.created, p.name))
    for pod in pods:
        if not pod.runs(digests[0], container_name, digests[1]):
            continue
        problem = pod.problem(container_name)
        if problem is not None:
            return problem.describe(pod.name)
    return None


def _rolled_back(context: Context, name: str, key: str) -> TargetStatus | None:
    """The previous status of a target rolled back for this set, unless tried again since."""
    resource = context.resource
    previous = next((t for t in resource.status.targets if t.name == name), None)
    if (
        previous is None
        or previous.state != "RolledBack"
        or previous.failed_artifact_key != key
        or previous.failed_generation is None
        or resource.generation > previous.failed_generation
        or resource.annotations.get(ANNOTATION_RETRY) != previous.retry_token
    ):
        return None
    return previous


def _loaded_sets(deployment: Manifest) -> frozenset[str]:
    """The sets a Deployment this resource patched loads: the one applied, and the one before
    while its old pods remain."""
    annotations = patching.annotations_of(deployment)
    applied = annotations.get(patching.ANNOTATION_ARTIFACT_KEY)
    previous = annotations.get(patching.ANNOTATION_PREVIOUS_KEY)
    loaded = {applied} if applied else set()
    if previous and not patching.rollout_complete(deployment):
        loaded.add(previous)
    return frozenset(loaded)


def _restore(name: str, deployment: Manifest) -> Actions:
    restored = patching.restore_deployment(deployment)
    if restored is None:
        return Actions()
    patch = DeploymentPatch(
        name=name,
        patch=patching.deployment_patch(deployment, restored.deployment),
        planned_from=patching.identity_of(deployment),
        restore=True,
        kept=restored.kept,
    )
    return Actions(patches=(patch,))


def _serving_set(
    wanted: ShardSet,
    wanted_entry: ShardSetStatus | None,
    applied: str | None,
    entries: Mapping[str, ShardSetStatus],
    spec: models.ShardedModelSpec,
) -> ShardSet | None:
    """The set a target should load now: the wanted one once verified, else the one it has."""
    if wanted_entry is not None and wanted_entry.stage == "Verified":
        return wanted
    if applied is None or applied == wanted.artifact_key:
        return None
    current = entries.get(applied)
    if current is None or current.stage not in ("Verified", "Superseded"):
        return None
    return ShardSet.for_spec(spec, current.tensor_parallel_size, current.artifact_key)


def _image_note(deployment: Manifest, container_name: str | None) -> str | None:
    recorded = patching.annotations_of(deployment).get(patching.ANNOTATION_IMAGE)
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers")
    current = next(
        (c.get("image") for c in containers or [] if c.get("name") == container_name), None
    )
    if recorded and current and recorded != current:
        return (
            f"container image changed from {recorded} to {current} after the shards were "
            "pointed at; check that it runs the vLLM version the shards were made with"
        )
    return None


def _time_of(value: object) -> datetime | None:
    """A time preshard recorded (`timestamp`); None when it is not one."""
    try:
        return parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None
