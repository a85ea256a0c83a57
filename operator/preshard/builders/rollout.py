"""How far a patched Deployment's rollout is, and which of its pods run the patched template.

Pure reads of a Deployment's status and of pod specs; no I/O. A patched target serves only
once the Deployment controller reports the rollout of the patched template complete, by the same
test it uses itself: it has observed the current generation, and every replica it runs
(`status.replicas`, so no old pod is left) is updated and available. A Deployment scaled to
zero has nothing to roll out: once its controller observed the template it counts as done,
serving nothing. The `Progressing` condition with reason `ProgressDeadlineExceeded` says the
rollout failed its `progressDeadlineSeconds`.

Which pods run the patched template is told by their spec, not by their ReplicaSet: a pod whose
`preshard-fetch-config` init container and vLLM container have the command, args and image the
Deployment's template has now (`container_digest`). Sidecars injected into pods, and labels or
volumes admission adds, do not matter to that comparison.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Final, Literal

from preshard.builders import Manifest
from preshard.builders.patching import INIT_CONTAINER

DEADLINE_EXCEEDED: Final = "ProgressDeadlineExceeded"

Phase = Literal["Progressing", "Complete", "ScaledToZero", "DeadlineExceeded"]


@dataclass(frozen=True)
class Rollout:
    """Where the rollout of a Deployment's current template stands."""

    phase: Phase
    detail: str = ""
    """What the Deployment controller says about it (the Progressing condition's message)."""

    @property
    def serving(self) -> bool:
        """Whether the current template is rolled out (to zero replicas, possibly)."""
        return self.phase in ("Complete", "ScaledToZero")

    @property
    def summary(self) -> str:
        """The coarse word the status records: `in progress`, `complete`, `scaled to zero`,
        `failed`. Coarse on purpose: replica counts would cost a status write per pod."""
        return {
            "Progressing": "in progress",
            "Complete": "complete",
            "ScaledToZero": "scaled to zero",
            "DeadlineExceeded": "failed",
        }[self.phase]


def rollout_of(deployment: Manifest) -> Rollout:
    """The rollout of the Deployment's current template, from its status."""
    metadata: Manifest = deployment.get("metadata") or {}
    spec: Manifest = deployment.get("spec") or {}
    status: Manifest = deployment.get("status") or {}
    wanted = int(spec.get("replicas", 1))
    generation = int(metadata.get("generation") or 0)
    if int(status.get("observedGeneration") or 0) < generation:
        return Rollout("Progressing", "the Deployment controller has not seen the template yet")
    running = int(status.get("replicas") or 0)
    if wanted == 0 and running == 0:
        return Rollout("ScaledToZero", "scaled to zero replicas")
    updated = int(status.get("updatedReplicas") or 0)
    available = int(status.get("availableReplicas") or 0)
    if running == wanted and updated == wanted and available >= wanted:
        return Rollout("Complete", f"{wanted} replica(s) updated and available")
    progressing: Manifest = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {}
    )
    message = str(progressing.get("message") or "")
    if progressing.get("reason") == DEADLINE_EXCEEDED and progressing.get("status") == "False":
        return Rollout("DeadlineExceeded", message or "the rollout exceeded its progress deadline")
    if spec.get("paused"):
        return Rollout("Progressing", "the Deployment is paused")
    return Rollout("Progressing", message)


def container_digest(container: Manifest) -> str:
    """A short hash of what a container runs: image, command and args (never env)."""
    fields = [container.get("image") or "", container.get("command"), container.get("args")]
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def template_digests(deployment: Manifest, container: str | None) -> tuple[str, str] | None:
    """The digests of the template's fetch-config init container and of the named container;
    None when the template has not both (it is not patched)."""
    pod_spec: Manifest = (deployment.get("spec") or {}).get("template", {}).get("spec") or {}
    init = next(
        (c for c in pod_spec.get("initContainers") or [] if c.get("name") == INIT_CONTAINER), None
    )
    main = next((c for c in pod_spec.get("containers") or [] if c.get("name") == container), None)
    if init is None or main is None:
        return None
    return container_digest(init), container_digest(main)
