"""Every reason preshard reports, in one place.

Reasons are CamelCase constants (Kubernetes API conventions). The data plane reports them in
its termination message and exit code; the controller copies them into conditions and events,
so a person sees the same word in `kubectl describe` as in the Job's pod.
"""

from typing import Final

# Progress and success.
READY: Final = "Ready"
RECONCILING: Final = "Reconciling"
PROBING: Final = "Probing"
SERIALIZING: Final = "Serializing"
SERIALIZED: Final = "Serialized"
RESHARDING: Final = "Resharding"
RESHARDED: Final = "Resharded"
WAITING_FOR_SOURCE: Final = "WaitingForSource"
ALREADY_SERIALIZED: Final = "AlreadySerialized"
VERIFYING: Final = "Verifying"
VERIFIED: Final = "Verified"
CONFIG_FETCHED: Final = "ConfigFetched"
PATCHED: Final = "Patched"
ROLLING_OUT: Final = "RollingOut"
SCALED_TO_ZERO: Final = "ScaledToZero"
NO_TARGETS: Final = "NoTargets"
WAITING_FOR_SHARDS: Final = "WaitingForShards"
DELETED: Final = "Deleted"
RESTORED: Final = "Restored"
ARGS_OVERRIDDEN: Final = "ArgsOverridden"
AS_EXPECTED: Final = "AsExpected"
SUPERSEDED: Final = "Superseded"
RELEASED: Final = "Released"

# Bad input found by the controller.
INVALID_SPEC: Final = "InvalidSpec"
TP_EXCEEDS_GPUS: Final = "TPExceedsGPUs"
TARGET_NOT_FOUND: Final = "TargetNotFound"
CONTAINER_NOT_FOUND: Final = "ContainerNotFound"
UNSUPPORTED_COMMAND: Final = "UnsupportedCommand"
TARGET_CONFLICT: Final = "TargetConflict"
TARGET_IMAGE_CHANGED: Final = "TargetImageChanged"
NO_GPU_RESOURCE: Final = "NoGPUResource"
AMBIGUOUS_GPU_RESOURCE: Final = "AmbiguousGPUResource"
DTYPE_CONFLICT: Final = "DtypeConflict"
QUANTIZATION_CONFLICT: Final = "QuantizationConflict"
UNSUPPORTED_LOADER_CONFIG: Final = "UnsupportedLoaderConfig"
TARGET_MANAGED_BY_CONTROLLER: Final = "TargetManagedByController"

# Failures reported by the data plane (termination message and exit code).
MANIFEST_MISSING: Final = "ManifestMissing"
MANIFEST_INVALID: Final = "ManifestInvalid"
SHARD_MISSING: Final = "ShardMissing"
SIZE_MISMATCH: Final = "SizeMismatch"
HASH_MISMATCH: Final = "HashMismatch"
TP_MISMATCH: Final = "TPMismatch"
ACCESS_DENIED: Final = "AccessDenied"
UNREACHABLE: Final = "Unreachable"
BUCKET_NOT_FOUND: Final = "BucketNotFound"
INSUFFICIENT_SCRATCH: Final = "InsufficientScratch"
INVALID_ARGUMENTS: Final = "InvalidArguments"
MODEL_NOT_FOUND: Final = "ModelNotFound"
ENCRYPTION_KEY_INVALID: Final = "EncryptionKeyInvalid"
RESHARD_UNSUPPORTED: Final = "ReshardUnsupported"
SERIALIZATION_FAILED: Final = "SerializationFailed"
INTERNAL_ERROR: Final = "InternalError"

# Failures the controller sees on Jobs and pods.
JOB_FAILED: Final = "JobFailed"
DEADLINE_EXCEEDED: Final = "DeadlineExceeded"
BACKOFF_LIMIT_EXCEEDED: Final = "BackoffLimitExceeded"
OOM_KILLED: Final = "OOMKilled"
EVICTED: Final = "Evicted"
SECRET_NOT_FOUND: Final = "SecretNotFound"  # noqa: S105 - a reason, not a secret
IMAGE_PULL_FAILED: Final = "ImagePullFailed"
UNSCHEDULABLE: Final = "Unschedulable"

# Failures the controller sees on patched Deployments and their pods.
TARGET_UNAVAILABLE: Final = "TargetUnavailable"
ROLLOUT_FAILED: Final = "RolloutFailed"

# Deletion.
CLEANUP_FAILED: Final = "CleanupFailed"

# Targets left alone: a server on another vLLM than the shards', a patch something keeps reverting.
VLLM_VERSION_MISMATCH: Final = "VLLMVersionMismatch"
TARGET_REVERTED: Final = "TargetReverted"
