"""How a data-plane command reports back to the controller.

Every command ends by writing one small JSON `Outcome` to the pod's termination message and
exiting with the code of its reason. The controller reads both from the Job's pod: the exit
code drives the Job's pod failure policy (bad input is not retried), the message becomes the
condition's reason and text.
"""

from __future__ import annotations

import json
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from preshard.contract import reasons

# Kubernetes keeps at most 4096 bytes of a termination message.
TERMINATION_MESSAGE_LIMIT: Final = 4096
DEFAULT_TERMINATION_LOG: Final = "/dev/termination-log"

Command = Literal["serialize", "verify", "fetch-config", "delete", "reshard"]

# One exit code per reason, so a pod failure policy can tell bad input (never retried) from a
# transient fault (retried within the Job's backoff limit).
EXIT_CODES: Final[dict[str, int]] = {
    reasons.SERIALIZED: 0,
    reasons.VERIFIED: 0,
    reasons.CONFIG_FETCHED: 0,
    reasons.DELETED: 0,
    reasons.RESHARDED: 0,
    reasons.READY: 0,
    reasons.INTERNAL_ERROR: 1,
    reasons.MANIFEST_MISSING: 10,
    reasons.SHARD_MISSING: 11,
    reasons.SIZE_MISMATCH: 12,
    reasons.HASH_MISMATCH: 13,
    reasons.TP_MISMATCH: 14,
    reasons.MANIFEST_INVALID: 15,
    reasons.ACCESS_DENIED: 20,
    reasons.UNREACHABLE: 21,
    reasons.BUCKET_NOT_FOUND: 22,
    reasons.INSUFFICIENT_SCRATCH: 30,
    reasons.INVALID_ARGUMENTS: 31,
    reasons.MODEL_NOT_FOUND: 32,
    reasons.ENCRYPTION_KEY_INVALID: 33,
    reasons.RESHARD_UNSUPPORTED: 34,
    reasons.SERIALIZATION_FAILED: 40,
}

# Exit codes that mean "retrying the same pod cannot help".
PERMANENT_EXIT_CODES: Final = tuple(
    sorted(
        EXIT_CODES[r]
        for r in (
            reasons.ACCESS_DENIED,
            reasons.BUCKET_NOT_FOUND,
            reasons.INSUFFICIENT_SCRATCH,
            reasons.INVALID_ARGUMENTS,
            reasons.MODEL_NOT_FOUND,
            reasons.ENCRYPTION_KEY_INVALID,
        )
    )
)

_REASON_BY_EXIT_CODE: Final = {code: r for r, code in EXIT_CODES.items() if code != 0}


def exit_code(reason: str) -> int:
    """The process exit code for a reason (1 for a reason without its own code)."""
    return EXIT_CODES.get(reason, 1)


def reason_for_exit_code(code: int) -> str | None:
    """The reason a non-zero exit code stands for, if it is one of ours."""
    return _REASON_BY_EXIT_CODE.get(code)


class Outcome(BaseModel):
    """The result of one data-plane command."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    command: Command
    ok: bool
    reason: str
    message: str = ""
    uri: str | None = None
    artifact_key: str | None = Field(default=None, alias="artifactKey")
    tensor_parallel_size: int | None = Field(default=None, alias="tensorParallelSize")
    total_bytes: int | None = Field(default=None, alias="totalBytes")
    files: int | None = None
    vllm_version: str | None = Field(default=None, alias="vllmVersion")
    tensorizer_version: str | None = Field(default=None, alias="tensorizerVersion")
    encrypted: bool | None = None
    manifest_format: int | None = Field(default=None, alias="manifestFormat")
    seconds: float | None = None

    def to_message(self) -> str:
        """Compact JSON that fits the termination message limit (the message is shortened)."""
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        overflow = len(text.encode()) - TERMINATION_MESSAGE_LIMIT
        if overflow <= 0:
            return text
        keep = max(0, len(self.message.encode()) - overflow - 3)
        short = self.message.encode()[:keep].decode(errors="ignore") + "..."
        return self.model_copy(update={"message": short}).model_dump_json(
            by_alias=True, exclude_none=True
        )

    @classmethod
    def from_message(cls, text: str | None) -> Outcome | None:
        """Parse a termination message; None when it is absent or not ours."""
        if not text:
            return None
        try:
            return cls.model_validate(json.loads(text))
        except (ValueError, ValidationError):
            return None
