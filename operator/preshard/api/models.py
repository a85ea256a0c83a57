"""The ShardedModel API: the one source of truth for its schema.

The CRD in `crds/` is generated from these models (`make crds`), and a test fails when the
committed file drifts. Field docstrings become the descriptions `kubectl explain` prints, and
the `x-kubernetes-validations` entries are CEL rules the API server enforces. What cannot be
said in the schema is checked here when the controller parses the resource at the edge.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from preshard.contract.engine_args import RESERVED_ENGINE_ARGS
from preshard.contract.layout import S3_URI_PATTERN
from preshard.contract.quantity import QUANTITY_PATTERN, QuantityError, parse_quantity, whole_bytes

GROUP: Final = "preshard.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "ShardedModel"
PLURAL: Final = "shardedmodels"
SINGULAR: Final = "shardedmodel"
SHORT_NAMES: Final = ("shm",)

# Tensor-parallel sizes vLLM can shard attention heads over on one node.
TENSOR_PARALLEL_SIZES: Final = (1, 2, 4, 8, 16)

DNS_LABEL_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A Secret data key: alphanumerics, '-', '_' and '.'.
SECRET_KEY_PATTERN: Final = r"^[-._a-zA-Z0-9]+$"  # noqa: S105 - a pattern, not a secret
# A Hugging Face repo id: `name` or `org/name`.
HF_MODEL_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"
ENGINE_ARG_PATTERN: Final = r"^[a-z][a-z0-9]*([-_][a-z0-9]+)*$"
HTTP_URL_PATTERN: Final = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$"
LABEL_KEY_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"

DnsLabel = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]
ResourceName = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
]
SecretKey = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)
]


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """A schema's `x-kubernetes-validations`: CEL rules the API server checks, each with the
    message it returns when the rule is false."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


def _kubernetes_quantity(value: str) -> str:
    # The CRD's pattern is the one Kubernetes publishes; its parser is stricter (`1e1.5`), and a
    # request, limit or size is never negative. One parser reads every quantity preshard uses.
    try:
        parsed = parse_quantity(value)
    except QuantityError as error:
        raise ValueError(str(error)) from None
    if parsed < 0:
        raise ValueError(f"{value!r} is negative")
    return value


def _byte_size(value: str) -> str:
    try:
        whole_bytes(value)
    except QuantityError as error:
        raise ValueError(str(error)) from None
    return value


Quantity = Annotated[
    str,
    StringConstraints(max_length=64, pattern=QUANTITY_PATTERN),
    AfterValidator(_kubernetes_quantity),
]
# A size in bytes: at least one whole byte, as `preshard serialize` reads it.
ByteSize = Annotated[Quantity, AfterValidator(_byte_size)]
LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN)
]
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE_PATTERN)]
S3Uri = Annotated[str, StringConstraints(max_length=1024, pattern=S3_URI_PATTERN)]


def _is_power_of_two(value: int) -> int:
    if value not in TENSOR_PARALLEL_SIZES:
        raise ValueError(f"must be one of {', '.join(map(str, TENSOR_PARALLEL_SIZES))}")
    return value


TensorParallelSize = Annotated[
    int,
    Field(json_schema_extra={"enum": list(TENSOR_PARALLEL_SIZES)}),
    AfterValidator(_is_power_of_two),
]


class ApiModel(BaseModel):
    """Common configuration: camelCase on the wire, unknown fields rejected, docstrings kept."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


class SecretKeyRef(ApiModel):
    """A key of a Secret in the ShardedModel's own namespace."""

    name: ResourceName
    """Name of the Secret. It must live in the same namespace as the ShardedModel."""

    key: SecretKey
    """Key within the Secret's data."""


class HubTokenRef(ApiModel):
    """The Secret holding a Hugging Face access token, for gated or private models."""

    name: ResourceName
    """Name of the Secret, in the ShardedModel's namespace."""

    key: SecretKey = "HF_TOKEN"
    """Key within the Secret holding the token."""


class ModelSource(ApiModel):
    """The model to shard: a Hugging Face repo id (with a revision) or an s3:// prefix."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "has(self.id) != has(self.uri)",
                "set exactly one of id (Hugging Face) or uri (s3://)",
            ),
            (
                "!has(self.uri) || (!has(self.revision) && !has(self.tokenSecretRef))",
                "revision and tokenSecretRef apply to Hugging Face models only",
            ),
            (
                "(has(self.id) ? self.id : '') == (has(oldSelf.id) ? oldSelf.id : '') "
                "&& (has(self.uri) ? self.uri : '') == (has(oldSelf.uri) ? oldSelf.uri : '')",
                "model.id and model.uri are immutable: create a new ShardedModel",
            ),
        )
    )

    id: Annotated[str, StringConstraints(max_length=192, pattern=HF_MODEL_ID_PATTERN)] | None = None
    """Hugging Face repo id, e.g. `meta-llama/Llama-3.1-8B-Instruct`. Immutable."""

    revision: (
        Annotated[
            str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._/-]+$")
        ]
        | None
    ) = None
    """Hub revision: a commit sha (recommended: a branch name can move under the same shards), a tag
    or a branch. Changing it builds a new shard set and then switches the targets to it.
    """

    uri: S3Uri | None = None
    """An s3:// prefix holding the model's safetensors, config.json and tokenizer files, read with
    the storage credentials. Immutable.
    """

    token_secret_ref: HubTokenRef | None = None
    """Secret with a Hugging Face token, passed to the serialization Job as HF_TOKEN."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.id is None) == (self.uri is None):
            raise ValueError("set exactly one of id (Hugging Face) or uri (s3://)")
        if self.uri is not None and (
            self.revision is not None or self.token_secret_ref is not None
        ):
            raise ValueError("revision and tokenSecretRef apply to Hugging Face models only")
        return self

    @property
    def name(self) -> str:
        """The model as vLLM and people name it: the repo id or the URI."""
        return self.id or self.uri or ""


class CredentialsRef(ApiModel):
    """A Secret with S3 credentials. Only pods read it: the operator never does."""

    name: ResourceName
    """Name of the Secret, in the ShardedModel's namespace."""

    access_key_id_key: SecretKey = "AWS_ACCESS_KEY_ID"
    """Key of the access key id in the Secret."""

    secret_access_key_key: SecretKey = "AWS_SECRET_ACCESS_KEY"  # noqa: S105 - a key name
    """Key of the secret access key in the Secret."""

    session_token_key: SecretKey | None = None
    """Key of an optional session token in the Secret."""


class ConfigMapKeyRef(ApiModel):
    """A key of a ConfigMap in the ShardedModel's own namespace."""

    name: ResourceName
    """Name of the ConfigMap. It must live in the same namespace as the ShardedModel."""

    key: SecretKey
    """Key within the ConfigMap's data."""


class Storage(ApiModel):
    """Where shard sets are written and read."""

    uri: S3Uri = Field(
        json_schema_extra=cel(
            ("self == oldSelf", "storage.uri is immutable: create a new ShardedModel"),
        )
    )
    """Prefix under which shard sets live, as `s3://bucket/prefix`. Each set is written to
    `<uri>/<artifact key>/`. Immutable.
    """

    endpoint: Annotated[str, StringConstraints(max_length=512, pattern=HTTP_URL_PATTERN)] | None = (
        None
    )
    """S3 endpoint URL for non-AWS stores (`https://...`). Without it, the AWS default endpoint of
    the region.
    """

    region: (
        Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")]
        | None
    ) = None
    """S3 region."""

    credentials_secret_ref: CredentialsRef | None = None
    """Secret with S3 credentials. Without it, pods use boto3's default chain: their
    ServiceAccount's identity (IRSA, EKS Pod Identity), or none.
    """

    retention: Literal["Retain", "Delete"] = "Retain"
    """What happens to shard sets when the ShardedModel is deleted or a set is superseded: `Retain`
    keeps them, `Delete` removes them with a Job.
    """

    ca_bundle: ConfigMapKeyRef | None = None
    """PEM certificates of the CAs to trust for the endpoint's TLS certificate (MinIO or Ceph
    behind a private CA), from a ConfigMap key. Every pod that talks to the store mounts it
    read-only and trusts only these CAs for the store: the Jobs and the `fetch-config` init
    container (boto3) and the patched vLLM container (tensorizer's curl, `CURL_CA_BUNDLE`, and
    boto3, `AWS_CA_BUNDLE`). It replaces the default CAs for those clients, so it must hold
    every CA the endpoint's certificate chain needs.
    """

    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """How requests name the bucket: `path` (`https://host/bucket/key`), `virtual`
    (`https://bucket.host/key`), or `auto` (boto3's choice: path-style for a configured
    endpoint, virtual-hosted for AWS). Applies to the Jobs and the `fetch-config` init
    container. tensorizer in the vLLM container has no such setting and reads path-style from
    the endpoint it is given; for a store that serves only virtual-hosted requests, see the
    install guide.
    """


class Toleration(ApiModel):
    """A Kubernetes toleration for the Job's pods."""

    key: Annotated[str, StringConstraints(max_length=317)] | None = None
    """Taint key the toleration applies to; empty matches all keys (with operator Exists)."""

    operator: Literal["Exists", "Equal"] | None = None
    """`Exists` or `Equal` (default)."""

    value: Annotated[str, StringConstraints(max_length=63)] | None = None
    """Taint value the toleration matches, with operator Equal."""

    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""

    toleration_seconds: Annotated[int, Field(ge=0)] | None = None
    """How long a NoExecute taint is tolerated."""


class ScratchVolume(ApiModel):
    """Scratch on a volume of its own instead of the node's disk: a generic ephemeral volume, a
    PersistentVolumeClaim of `scratchSize` made with each Job pod and deleted with it."""

    storage_class_name: ResourceName | None = None
    """StorageClass of the claim (a local NVMe class is the fastest); unset: the cluster's
    default class.
    """


class Serialization(ApiModel):
    """How the multi-GPU serialization Job runs."""

    image: (
        Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^[^\s]+$")] | None
    ) = None
    """Serializer image (vLLM + tensorizer + preshard). Defaults to the operator's configured image.
    Part of the artifact key: another vLLM version makes another shard set.
    """

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight dtype of the shards."""

    max_model_len: Annotated[int, Field(ge=1, le=16_777_216)] | None = None
    """Maximum context length the engine is started with while serializing (keeps KV-cache
    allocation small); does not change the shards.
    """

    extra_engine_args: dict[
        Annotated[str, StringConstraints(max_length=64, pattern=ENGINE_ARG_PATTERN)],
        Annotated[str, StringConstraints(max_length=1024)],
    ] = Field(
        default_factory=dict,
        json_schema_extra={
            "maxProperties": 32,
            **cel(
                (
                    f"self.all(k, k.matches('{ENGINE_ARG_PATTERN}'))",
                    "extraEngineArgs names are lower-case words joined by '-' or '_'",
                ),
            ),
        },
    )
    """Extra vLLM engine arguments by name (`quantization: fp8`, `trust-remote-code: "true"`).
    Values are strings; `true`/`false` and numbers are converted. Part of the artifact key.
    Arguments preshard sets itself are refused.
    """

    gpu_resource_name: (
        Annotated[str, StringConstraints(max_length=253, pattern=r"^[a-z0-9.-]+/[a-z0-9._-]+$")]
        | None
    ) = None
    """Extended resource name of the GPUs, e.g. `nvidia.com/gpu` or `amd.com/gpu`. Defaults to the
    operator's setting.
    """

    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    """Node labels the serialization pod must match."""

    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations of the serialization pod."""

    active_deadline_seconds: Annotated[int, Field(ge=60, le=7 * 24 * 3600)] = 6 * 3600
    """How long one serialization Job may run before it is stopped and marked failed."""

    backoff_limit: Annotated[int, Field(ge=0, le=10)] = 2
    """How many times a failed serialization pod is retried (bad input is never retried)."""

    scratch_size: ByteSize | None = None
    """Size of the local scratch volume the rank files (and an s3:// source) are written to before
    upload. Defaults to the operator's setting; make it at least twice the model's size.
    """

    scratch_volume: ScratchVolume | None = None
    """Put the scratch of the serialize and reshard Jobs on a PersistentVolumeClaim made for each
    pod (for models larger than what a node's disk can give an `emptyDir`); unset: an `emptyDir`
    with `scratchSize` as its size limit and as an `ephemeral-storage` request.
    """

    memory: Quantity | None = None
    """Memory request and limit of the serialization container (also sizes /dev/shm to half of it).
    """

    cpu: Quantity | None = None
    """CPU request of the serialization container."""

    service_account_name: DnsLabel | None = None
    """ServiceAccount of the serialization and verification pods (for cloud identities)."""

    reshard: bool = True
    """Make the set for a new tensor-parallel size on CPU, from a verified set of this
    ShardedModel at another TP size (`preshard reshard`, no GPU), instead of serializing it on
    GPUs. The resharded set is what vLLM writes at that TP size, under the same artifact key; a
    model reshard does not support falls back to the GPU Job. false: always serialize on GPUs.
    """

    @model_validator(mode="after")
    def _engine_args_not_reserved(self) -> Serialization:
        reserved = sorted(
            name
            for name in self.extra_engine_args
            if name.replace("-", "_") in RESERVED_ENGINE_ARGS
        )
        if reserved:
            raise ValueError(
                f"extraEngineArgs may not set {', '.join(reserved)}: preshard sets these itself"
            )
        return self


class Verification(ApiModel):
    """How shard sets are checked before use and while in use, by a small CPU Job."""

    interval_seconds: Annotated[int, Field(ge=0, le=30 * 24 * 3600)] = 3600
    """How often a verified shard set is checked again; 0 turns periodic checks off."""

    deep: bool = False
    """Re-hash every file against the manifest instead of checking presence and sizes (reads the
    whole set).
    """

    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    """Node labels the verification and deletion pods must match."""

    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations of the verification and deletion pods."""


class Loading(ApiModel):
    """How patched vLLM Deployments load the shards."""

    num_readers: Annotated[int, Field(ge=1, le=64)] | None = None
    """Parallel readers per rank file (tensorizer `num_readers`). Defaults to the operator's
    setting.
    """

    verify_hash: bool = False
    """Check the stored per-tensor hashes while loading (slower, safer)."""


class Encryption(ApiModel):
    """Encrypt the shards with tensorizer, using a key from a Secret."""

    secret_ref: SecretKeyRef
    """Secret key holding the 32-byte encryption key. It is mounted as a file into the serialization
    pod and the patched Deployments; it never leaves the Secret otherwise. Immutable.
    """


class LabelSelectorRequirement(ApiModel):
    """One label selector requirement."""

    key: LabelKey
    """Label key the selector applies to."""

    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key relates to the values."""

    values: list[LabelValue] = Field(default_factory=list, max_length=64)
    """Values for In and NotIn; empty for Exists and DoesNotExist."""


class LabelSelector(ApiModel):
    """A Kubernetes label selector; an empty selector is refused (it would match everything)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "(has(self.matchLabels) ? size(self.matchLabels) : 0) + "
                "(has(self.matchExpressions) ? size(self.matchExpressions) : 0) > 0",
                "an empty selector would match every Deployment",
            ),
        )
    )

    match_labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    """Labels a Deployment must have."""

    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)
    """Expressions a Deployment's labels must satisfy."""

    @model_validator(mode="after")
    def _not_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError("an empty selector would match every Deployment")
        return self

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether a set of labels satisfies this selector."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for expression in self.match_expressions:
            present = expression.key in labels
            value = labels.get(expression.key)
            satisfied = {
                "In": present and value in expression.values,
                "NotIn": not present or value not in expression.values,
                "Exists": present,
                "DoesNotExist": not present,
            }[expression.operator]
            if not satisfied:
                return False
        return True


class Target(ApiModel):
    """vLLM Deployments (in the ShardedModel's namespace) to point at a shard set."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("has(self.name) != has(self.selector)", "set exactly one of name or selector"),
        )
    )

    name: ResourceName | None = None
    """Name of one Deployment."""

    selector: LabelSelector | None = None
    """Label selector for several Deployments."""

    container: DnsLabel | None = None
    """Container that runs vLLM. Defaults to the only container, or the one whose command runs vLLM.
    """

    tensor_parallel_size: TensorParallelSize | None = None
    """TP size this target serves with; must be one of spec.tensorParallelSizes. Defaults to the
    first of them.
    """

    on_rollout_failure: Literal["Keep", "Restore"] = "Keep"
    """What happens when the rollout of the patched template exceeds the Deployment's
    `progressDeadlineSeconds`: `Keep` leaves the patched template in place (the target reports
    TargetUnavailable until its pods become available), `Restore` puts the Deployment's original
    template back and reports RolloutFailed; it is not patched again for the same shard set until
    the spec changes or the `preshard.dev/retry` annotation gets a new value.
    """

    allow_controller_owned: bool = False
    """Patch a Deployment that another controller owns (an ownerReference with `controller: true`:
    a KServe InferenceService, a LeaderWorkerSet, another operator). Such a Deployment is refused
    by default (TargetManagedByController): its controller puts its own pod template back,
    undoing the patch, and preshard would patch it again, restarting GPU pods each time. Set it
    only when that controller leaves the pod template alone.
    """

    allow_vllm_version_mismatch: bool = False
    """Patch the Deployment even when its vLLM release (its image tag, or its
    `preshard.dev/vllm-version` annotation) is not the one that wrote the shard set. Refused by
    default (VLLMVersionMismatch): another vLLM release may lay out the weights differently.
    Builds of one release (`+cu126`, `-cu128`) count as the same release.
    """

    @model_validator(mode="after")
    def _one_way(self) -> Target:
        if (self.name is None) == (self.selector is None):
            raise ValueError("set exactly one of name or selector")
        return self

    @property
    def label(self) -> str:
        """How the target reads in messages."""
        if self.name is not None:
            return f"Deployment {self.name}"
        return "Deployments selected by " + json_compact(
            self.selector.model_dump(by_alias=True, exclude_defaults=True) if self.selector else {}
        )


# What preshard sets on its Job pods itself: these names are refused in jobPods.env and labels.
RESERVED_JOB_ENV: Final = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL_S3",
        "HF_TOKEN",
        "HF_HOME",
        "TMPDIR",
    }
)
RESERVED_LABEL_PREFIXES: Final = ("preshard.dev/", "app.kubernetes.io/", "batch.kubernetes.io/")
ENV_NAME_PATTERN: Final = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


class KeyRef(ApiModel):
    """A key of a Secret or ConfigMap in the ShardedModel's namespace."""

    name: ResourceName
    """Name of the Secret or ConfigMap."""

    key: SecretKey
    """Key within its data."""


class EnvSource(ApiModel):
    """Where an environment variable's value comes from (one of the two)."""

    secret_key_ref: KeyRef | None = None
    """A key of a Secret (a proxy's credentials, say): referenced, never copied."""

    config_map_key_ref: KeyRef | None = None
    """A key of a ConfigMap."""

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("valueFrom needs exactly one of secretKeyRef and configMapKeyRef")
        return self


class EnvVar(ApiModel):
    """An environment variable of the Job pods: a value, or a reference."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN)]
    """Name of the variable."""

    value: Annotated[str, StringConstraints(max_length=4096)] | None = None
    """Its value (not for secrets: use valueFrom)."""

    value_from: EnvSource | None = None
    """A Secret or ConfigMap key to read it from."""

    @model_validator(mode="after")
    def _value_or_reference(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self


class LocalObjectReference(ApiModel):
    """An object in the ShardedModel's namespace, by name."""

    name: ResourceName
    """Its name."""


class JobPods(ApiModel):
    """What the pods of every Job preshard runs (serialize, reshard, verify, delete) get besides
    what preshard sets: for proxies, admission and queueing systems, and scheduling."""

    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, json_schema_extra={"maxProperties": 32}
    )
    """Labels of the Jobs and their pods, e.g. `kueue.x-k8s.io/queue-name` (Kueue reads it from
    the Job). Keys under `preshard.dev/`, `app.kubernetes.io/` and `batch.kubernetes.io/` are
    preshard's or Kubernetes' own and are refused.
    """

    annotations: dict[
        Annotated[str, StringConstraints(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN)],
        Annotated[str, StringConstraints(max_length=4096)],
    ] = Field(default_factory=dict, json_schema_extra={"maxProperties": 32})
    """Annotations of the Jobs and their pods (keys under `preshard.dev/` are refused)."""

    env: list[EnvVar] = Field(default_factory=list, max_length=32)
    """Extra environment of the Job containers and of the init container preshard adds to
    patched Deployments (both read the store): `HTTPS_PROXY`, `NO_PROXY`, `HF_ENDPOINT`,
    `AWS_CA_BUNDLE`, ... Variables preshard sets itself (S3 credentials, region and endpoint,
    `HF_TOKEN`, `HF_HOME`, `TMPDIR`) are refused.
    """

    priority_class_name: ResourceName | None = None
    """PriorityClass of the Job pods."""

    affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    )
    """A Kubernetes `affinity` (nodeAffinity, podAffinity, podAntiAffinity) for the Job pods,
    as in a pod spec; the API server checks it when the Job is created.
    """

    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    """Secrets the Job pods pull the serializer and tools images with, besides the
    ServiceAccount's. A patched Deployment pulls the tools image of its init container with its
    own pull secrets or its ServiceAccount's; preshard does not add these to it.
    """

    @model_validator(mode="after")
    def _not_preshards_own(self) -> JobPods:
        reserved_env = sorted({e.name for e in self.env} & RESERVED_JOB_ENV)
        if reserved_env:
            raise ValueError(
                f"jobPods.env may not set {', '.join(reserved_env)}: preshard sets these itself"
            )
        names = [e.name for e in self.env]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"jobPods.env sets {', '.join(duplicated)} more than once")
        reserved = sorted(
            key
            for key in [*self.labels, *self.annotations]
            if key.startswith(RESERVED_LABEL_PREFIXES)
        )
        if reserved:
            raise ValueError(
                f"jobPods labels and annotations may not use {', '.join(reserved)}: "
                "these prefixes are preshard's and Kubernetes' own"
            )
        return self


class ShardedModelSpec(ApiModel):
    """What to shard, where to put it, and which vLLM Deployments load it."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.targets) || self.targets.all(t, "
                "!has(t.tensorParallelSize) || "
                "t.tensorParallelSize in self.tensorParallelSizes)",
                "every target's tensorParallelSize must be in tensorParallelSizes",
            ),
            (
                "!has(self.targets) || self.targets.all(t, !has(t.name) || "
                "self.targets.filter(u, has(u.name) && u.name == t.name).size() == 1)",
                "a Deployment may be named by only one target",
            ),
            (
                "has(self.encryption) == has(oldSelf.encryption) && "
                "(!has(self.encryption) || self.encryption == oldSelf.encryption)",
                "encryption cannot be added, removed or changed: create a new ShardedModel",
            ),
        )
    )

    model: ModelSource
    """The model to shard."""

    storage: Storage
    """Where the shard sets go."""

    tensor_parallel_sizes: list[TensorParallelSize] = Field(
        min_length=1, max_length=5, json_schema_extra={"x-kubernetes-list-type": "set"}
    )
    """Tensor-parallel sizes to build a shard set for (one set per size, one file per rank)."""

    serialization: Serialization = Field(default_factory=Serialization)
    """How the serialization Job runs."""

    verification: Verification = Field(default_factory=Verification)
    """How shard sets are verified."""

    loading: Loading = Field(default_factory=Loading)
    """How patched Deployments load the shards."""

    encryption: Encryption | None = None
    """Encrypt the shards; without it they are stored in the clear."""

    job_pods: JobPods = Field(default_factory=JobPods)
    """Extra labels, annotations, environment, priority, affinity and pull secrets of the pods of
    every Job preshard runs."""

    targets: list[Target] = Field(default_factory=list, max_length=64)
    """Deployments to patch once their shard set is verified."""

    @model_validator(mode="after")
    def _consistent(self) -> ShardedModelSpec:
        if len(set(self.tensor_parallel_sizes)) != len(self.tensor_parallel_sizes):
            raise ValueError("tensorParallelSizes has duplicates")
        for target in self.targets:
            if (
                target.tensor_parallel_size is not None
                and target.tensor_parallel_size not in self.tensor_parallel_sizes
            ):
                raise ValueError(
                    f"{target.label}: tensorParallelSize {target.tensor_parallel_size} is not "
                    "listed in tensorParallelSizes"
                )
        names = [t.name for t in self.targets if t.name is not None]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"Deployment {', '.join(duplicated)} is named by more than one target")
        return self

    def target_tp(self, target: Target) -> int:
        """The TP size a target serves with."""
        return target.tensor_parallel_size or self.tensor_parallel_sizes[0]


def json_compact(value: Any) -> str:
    """Deterministic compact JSON, for messages and hashes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class InvalidSpecError(ValueError):
    """A ShardedModel spec that does not parse; the message names every bad field."""


def parse_spec(raw: Any) -> ShardedModelSpec:
    """Parse a spec at the edge, turning Pydantic's errors into one readable message."""
    try:
        return ShardedModelSpec.model_validate(raw)
    except ValidationError as error:
        problems = []
        for item in error.errors(include_url=False):
            where = ".".join(str(part) for part in ("spec", *item["loc"]))
            if item["type"] == "string_pattern_mismatch":
                shown = str(item["input"])
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                problems.append(f"{where}: {shown!r} has an invalid format")
            else:
                problems.append(f"{where}: {item['msg']}")
        raise InvalidSpecError("; ".join(problems)) from None
