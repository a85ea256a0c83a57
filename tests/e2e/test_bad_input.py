"""Malformed and hostile ShardedModels and target Deployments, as a table.

Every row is either refused by the API server (the test asserts the status code and that the
message names the field) or accepted and turned by the operator into a condition with a
CamelCase reason. Whatever happens, the operator stays up with no traceback in its log, no
target Deployment changes, and every Job an input caused finishes (the one exception is a
Secret that does not exist: the Job's pod waits for it without running anything, as a kubelet
makes it wait, until its deadline or until the Secret appears).

All accepted rows run at once, against one operator, each in a namespace of its own.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard.api import models
from preshard.contract import reasons
from preshard_devenv import workloads
from preshard_devenv.nodes import on_node
from preshard_devenv.operatorprocess import OperatorProcess
from preshard_devenv.procs import wait_for
from tests.support import shardedmodels as shm
from tests.support import specs, timings
from tests.support.cluster import job_finished, job_names, pods, read_job
from tests.support.namespaces import Namespaces

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

Manifest = dict[str, Any]
PREFIX: Final = "shards"
NAME: Final = "bad"
DROP: Final = object()
WAIT_SECONDS: Final = 120.0


@dataclass(frozen=True)
class Case:
    """One malformed or hostile input and what must become of it."""

    name: str
    changes: Mapping[str, Any] = field(default_factory=dict)
    """Dotted paths of the spec set to a value (DROP removes the field)."""
    rejected: str | None = None
    """The field the API server names when it refuses the object."""
    status: int = 422
    """The API server's status code for a refusal."""
    strict: bool = False
    """Send with strict field validation, as `kubectl apply` does."""
    reason: str | None = None
    """The Ready condition's reason when the operator handles it."""
    ready: str = "False"
    containers: tuple[Manifest, ...] = ()
    """The target Deployment's containers; none given: one plain `vllm serve` container."""
    deployment: bool = True
    credentials: Literal["valid", "wrong", "missing"] = "valid"
    key: bytes | None = None
    """Bytes of an `encryption-key` Secret created for the row."""
    annotations: Mapping[str, str] | None = None

    @property
    def accepted(self) -> bool:
        """Whether the API server stores it (the operator decides what becomes of it)."""
        return self.rejected is None


def shell(script: str) -> tuple[Manifest, ...]:
    """A vLLM container started through a shell string."""
    return (specs.vllm_container(command=["/bin/sh", "-c"], args=[script]),)


def serve(*arguments: str) -> tuple[Manifest, ...]:
    """A `vllm serve ...` container."""
    return (specs.vllm_container(args=list(arguments)),)


def plain(name: str, *command: str) -> Manifest:
    """A container that does not run vLLM."""
    return {"name": name, "image": "python:3.12", "command": list(command)}


ENGINE: Final = "serialization.extraEngineArgs"
CASES: Final = [
    # Wrong types, empty and huge values.
    Case("tp-not-a-list", {"tensorParallelSizes": "2"}, rejected="spec.tensorParallelSizes"),
    Case("tp-empty", {"tensorParallelSizes": []}, rejected="spec.tensorParallelSizes"),
    Case("tp-three", {"tensorParallelSizes": [3]}, rejected="spec.tensorParallelSizes[0]"),
    Case("tp-huge", {"tensorParallelSizes": [2**40]}, rejected="spec.tensorParallelSizes[0]"),
    Case("tp-duplicated", {"tensorParallelSizes": [2, 2]}, rejected="spec.tensorParallelSizes[1]"),
    Case("no-storage", {"storage": DROP}, rejected="spec.storage"),
    Case("model-empty", {"model": {}}, rejected="spec.model"),
    Case("model-id-empty-string", {"model": {"id": ""}}, rejected="spec.model.id"),
    Case(
        "interval-not-a-number",
        {"verification.intervalSeconds": "often"},
        rejected="spec.verification.intervalSeconds",
    ),
    Case(
        "deadline-huge",
        {"serialization.activeDeadlineSeconds": 10**12},
        rejected="spec.serialization.activeDeadlineSeconds",
    ),
    Case(
        "backoff-negative",
        {"serialization.backoffLimit": -1},
        rejected="spec.serialization.backoffLimit",
    ),
    Case("readers-zero", {"loading.numReaders": 0}, rejected="spec.loading.numReaders"),
    Case(
        "scratch-not-a-quantity",
        {"serialization.scratchSize": "lots"},
        rejected="spec.serialization.scratchSize",
    ),
    Case(
        "engine-arg-not-a-string",
        {ENGINE: {"max-num-seqs": 4}},
        rejected="spec.serialization.extraEngineArgs.max-num-seqs",
    ),
    Case(
        "engine-arg-value-huge",
        {ENGINE: {"quantization": "x" * 2000}},
        rejected="spec.serialization.extraEngineArgs.quantization",
    ),
    Case(
        "engine-args-too-many",
        {ENGINE: {f"arg{i}": "1" for i in range(33)}},
        rejected="spec.serialization.extraEngineArgs",
    ),
    Case("retention-unknown", {"storage.retention": "Forever"}, rejected="spec.storage.retention"),
    Case(
        "annotations-huge",
        annotations={"example.com/blob": "x" * 300_000},
        rejected="metadata.annotations",
    ),
    # Path traversal, unicode and command text where names and URIs go.
    Case("model-id-traversal", {"model": {"id": "../../etc/passwd"}}, rejected="spec.model.id"),
    Case("model-id-unicode", {"model": {"id": "org/mödel"}}, rejected="spec.model.id"),
    Case(
        "model-uri-dotdot",
        {"model": {"uri": "s3://bucket/models/../private/"}},
        rejected="spec.model.uri",
    ),
    Case("model-uri-dot", {"model": {"uri": "s3://bucket/a/./b/"}}, rejected="spec.model.uri"),
    Case("model-uri-not-s3", {"model": {"uri": "file:///etc/"}}, rejected="spec.model.uri"),
    Case(
        "storage-uri-dotdot", {"storage.uri": "s3://bucket/shards/.."}, rejected="spec.storage.uri"
    ),
    Case("storage-uri-unicode", {"storage.uri": "s3://bucket/shärds"}, rejected="spec.storage.uri"),
    Case(
        "storage-uri-huge",
        {"storage.uri": "s3://bucket/" + "a" * 5000},
        rejected="spec.storage.uri",
    ),
    Case(
        "endpoint-command-substitution",
        {"storage.endpoint": "http://s3.example.com/$(cat /etc/passwd)"},
        rejected="spec.storage.endpoint",
    ),
    Case(
        "image-with-shell",
        {"serialization.image": "vllm:latest; rm -rf /"},
        rejected="spec.serialization.image",
    ),
    Case(
        "secret-name-traversal",
        {"storage.credentialsSecretRef": {"name": "../kube-system/admin"}},
        rejected="spec.storage.credentialsSecretRef.name",
    ),
    Case(
        "key-name-with-space",
        {"encryption": {"secretRef": {"name": "k", "key": "key with space"}}},
        rejected="spec.encryption.secretRef.key",
    ),
    Case(
        "node-selector-value-huge",
        {"serialization.nodeSelector": {"pool": "x" * 64}},
        rejected="spec.serialization.nodeSelector.pool",
    ),
    # Targets.
    Case("target-empty", {"targets": [{}]}, rejected="spec.targets[0]"),
    Case("target-duplicated", {"targets": [{"name": "vllm"}, {"name": "vllm"}]}, rejected="spec"),
    Case(
        "target-selector-empty",
        {"targets": [{"selector": {}}]},
        rejected="spec.targets[0].selector",
    ),
    Case(
        "target-tp-not-listed",
        {"targets": [{"name": "vllm", "tensorParallelSize": 4}]},
        rejected="spec",
    ),
    Case(
        "target-in-another-namespace",
        {"targets": [{"name": "other/vllm"}]},
        rejected="spec.targets[0].name",
    ),
    Case(
        "target-namespace-field",
        {"targets": [{"name": "vllm", "namespace": "other"}]},
        rejected="spec.targets[0].namespace",
        status=400,
        strict=True,
    ),
    # Arguments smuggled through extra engine arguments.
    Case(
        "engine-arg-key-with-spaces",
        {ENGINE: {"x --load-format": "dummy"}},
        rejected="spec.serialization.extraEngineArgs",
    ),
    Case(
        "engine-arg-key-is-a-flag",
        {ENGINE: {"--load-format": "dummy"}},
        rejected="spec.serialization.extraEngineArgs",
    ),
    # Accepted by the API server, refused by the operator.
    Case("tp-exceeds-gpus-per-node", {"tensorParallelSizes": [16]}, reason=reasons.TP_EXCEEDS_GPUS),
    Case(
        "engine-arg-sets-tp", {ENGINE: {"tensor-parallel-size": "4"}}, reason=reasons.INVALID_SPEC
    ),
    Case(
        "engine-arg-sets-load-format",
        {ENGINE: {"load_format": "dummy"}},
        reason=reasons.INVALID_SPEC,
    ),
    Case(
        "engine-arg-sets-served-name",
        {ENGINE: {"served-model-name": "other"}},
        reason=reasons.INVALID_SPEC,
    ),
    Case(
        "engine-arg-value-carries-a-flag",
        {ENGINE: {"quantization": "fp8 --load-format dummy"}, "targets": []},
        reason=reasons.READY,
        ready="True",
    ),
    Case(
        "shell-pipe",
        containers=shell("vllm serve org/tiny | tee /tmp/log"),
        reason=reasons.UNSUPPORTED_COMMAND,
    ),
    Case(
        "shell-two-commands",
        containers=shell("vllm serve $MODEL && sleep 1"),
        reason=reasons.UNSUPPORTED_COMMAND,
    ),
    Case("no-model-argument", containers=serve(), reason=reasons.UNSUPPORTED_COMMAND),
    Case(
        "pipeline-parallel",
        containers=serve("org/tiny", "--pipeline-parallel-size", "2"),
        reason=reasons.UNSUPPORTED_COMMAND,
    ),
    Case(
        "data-parallel",
        containers=serve("org/tiny", "--data-parallel-size", "2"),
        reason=reasons.UNSUPPORTED_COMMAND,
    ),
    Case(
        "abbreviated-tp-flag",
        containers=serve("org/tiny", "--tensor-parallel", "2"),
        reason=reasons.UNSUPPORTED_COMMAND,
    ),
    Case(
        "config-file",
        containers=serve("org/tiny", "--config", "/etc/vllm.yaml"),
        reason=reasons.UNSUPPORTED_COMMAND,
    ),
    Case(
        "container-not-there",
        {"targets": [{"name": "vllm", "container": "nope"}]},
        reason=reasons.CONTAINER_NOT_FOUND,
    ),
    Case(
        "no-vllm-container",
        containers=(
            plain("app", "python", "-m", "http.server"),
            plain("proxy", "envoy", "-c", "/etc/envoy.yaml"),
        ),
        reason=reasons.CONTAINER_NOT_FOUND,
    ),
    Case("target-missing", deployment=False, reason=reasons.TARGET_NOT_FOUND),
    Case(
        "selector-matches-nothing",
        {"targets": [{"selector": {"matchLabels": {"app": "nothing-has-this"}}}]},
        reason=reasons.TARGET_NOT_FOUND,
    ),
    # Accepted, and failing in the data plane: the Jobs run for real and finish.
    Case(
        "model-not-there",
        {"model": {"uri": "s3://{bucket}/models/none/"}},
        reason=reasons.MODEL_NOT_FOUND,
    ),
    Case(
        "bucket-not-there",
        {"storage.uri": "s3://no-such-bucket-here/shards"},
        reason=reasons.BUCKET_NOT_FOUND,
    ),
    Case("wrong-secret-key", credentials="wrong", reason=reasons.ACCESS_DENIED),
    Case("credentials-secret-missing", credentials="missing", reason=reasons.SECRET_NOT_FOUND),
    Case(
        "encryption-key-too-short",
        {"encryption": {"secretRef": {"name": "encryption-key", "key": "key"}}},
        key=secrets.token_bytes(16),
        reason=reasons.ENCRYPTION_KEY_INVALID,
    ),
]
ACCEPTED: Final = [case for case in CASES if case.accepted]
REJECTED: Final = [case for case in CASES if not case.accepted]


def edited(base: Manifest, changes: Mapping[str, Any], store: specs.Store) -> Manifest:
    """`base` with the dotted paths of `changes` set (or dropped)."""
    result = copy.deepcopy(base)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = result
        for key in parents:
            node = node.setdefault(key, {})
        if value is DROP:
            node.pop(last, None)
        else:
            node[last] = json.loads(json.dumps(value).replace("{bucket}", store.bucket))
    return result


def body_of(case: Case, namespace: str, store: specs.Store, name: str = NAME) -> Manifest:
    """The ShardedModel object of a row."""
    manifest = workloads.sharded_model(
        name, edited(specs.spec(store, PREFIX), case.changes, store), namespace=namespace
    )
    if case.annotations:
        manifest["metadata"]["annotations"] = dict(case.annotations)
    return manifest


@dataclass
class Row:
    """An accepted row as it ran: its namespace, its Deployment before, what it became."""

    case: Case
    namespace: str
    before: Manifest | None
    started: float
    resource: Manifest | None = None
    seconds: float | None = None


def matched(case: Case, resource: Manifest) -> bool:
    """Whether a row's ShardedModel has reached the expected Ready condition."""
    ready = workloads.condition(resource, "Ready")
    return ready is not None and (ready["status"], ready["reason"]) == (case.ready, case.reason)


def set_up(api: k8s.ApiClient, namespaces: Namespaces, case: Case, store: specs.Store) -> Row:
    """A namespace with what a row needs, and its ShardedModel."""
    namespace = namespaces.create(case.name[:30].strip("-"))
    if case.credentials != "missing":
        specs.create_credentials(api, namespace, store.server)
    if case.credentials == "wrong":
        k8s.CoreV1Api(api).patch_namespaced_secret(
            specs.CREDENTIALS, namespace, {"stringData": {"AWS_SECRET_ACCESS_KEY": "wrong-key-0"}}
        )
    if case.key is not None:
        specs.create_secret(api, namespace, "encryption-key", {"key": case.key})
    before = None
    if case.deployment:
        containers = list(case.containers) or [specs.vllm_container()]
        before = workloads.create_deployment(
            api, namespace, "vllm", pod_spec={**on_node("auto"), "containers": containers}
        )
    body = body_of(case, namespace, store)
    workloads.create_sharded_model(api, namespace, NAME, body["spec"])
    return Row(case=case, namespace=namespace, before=before, started=time.monotonic())


@pytest.fixture(scope="module")
def rows(
    kube_api: k8s.ApiClient, operator: OperatorProcess, store: specs.Store
) -> Iterator[dict[str, Row]]:
    """Every accepted row, run at once after a shard set to point at exists."""
    namespaces = Namespaces(kube_api, "bad")
    try:
        seed = namespaces.create("seed")
        specs.create_credentials(kube_api, seed, store.server)
        workloads.create_sharded_model(
            kube_api, seed, "seed", specs.spec(store, PREFIX, targets=())
        )
        shm.wait_ready(kube_api, seed, "seed", operator=operator)
        started = time.monotonic()
        table = {case.name: set_up(kube_api, namespaces, case, store) for case in ACCEPTED}

        def all_matched() -> bool:
            shm.forbid_tracebacks(operator)
            for row in table.values():
                if row.resource is None:
                    resource = shm.get(kube_api, row.namespace, NAME)
                    if matched(row.case, resource):
                        row.resource, row.seconds = resource, time.monotonic() - row.started
            return all(row.resource is not None for row in table.values())

        try:
            wait_for(
                all_matched, what="every accepted row to reach its condition", timeout=WAIT_SECONDS
            )
        except TimeoutError:
            missing = {
                row.case.name: workloads.condition(shm.get(kube_api, row.namespace, NAME), "Ready")
                for row in table.values()
                if row.resource is None
            }
            raise AssertionError(f"rows without their condition: {missing}") from None
        jobs = sum(len(job_names(kube_api, row.namespace)) for row in table.values())
        timings.record(
            f"bad input: {len(table)} accepted rows (as many namespaces and ShardedModels, "
            f"{sum(row.before is not None for row in table.values())} Deployments, {jobs} Jobs) "
            "to their conditions, at once",
            time.monotonic() - started,
        )
        timed = sorted((row.seconds or 0.0, name) for name, row in table.items())
        for rank, (seconds, name) in zip(
            ("fastest", "median", "slowest"),
            (timed[0], timed[len(timed) // 2], timed[-1]),
            strict=True,
        ):
            timings.record(f"bad input, {rank} row: {name}", seconds)
        yield table
    finally:
        namespaces.delete_all()


@pytest.fixture(scope="module")
def rejections_namespace(kube_api: k8s.ApiClient) -> Iterator[str]:
    """One namespace for every refused row, with a Deployment nothing may touch."""
    namespaces = Namespaces(kube_api, "bad")
    try:
        namespace = namespaces.create("rejected")
        specs.create_vllm_deployment(kube_api, namespace, node_kind="auto")
        yield namespace
    finally:
        namespaces.delete_all()


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 30
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", REJECTED, ids=lambda case: case.name)
def test_the_api_server_refuses(
    case: Case,
    kube_api: k8s.ApiClient,
    rejections_namespace: str,
    store: specs.Store,
    operator: OperatorProcess,
) -> None:
    namespace = rejections_namespace
    name = f"{NAME}-{secrets.token_hex(3)}"
    body = body_of(case, namespace, store, name)
    with pytest.raises(ApiException) as refused:
        k8s.CustomObjectsApi(kube_api).create_namespaced_custom_object(
            models.GROUP,
            models.VERSION,
            namespace,
            models.PLURAL,
            body,
            field_validation="Strict" if case.strict else None,
        )
    assert refused.value.status == case.status
    message = json.loads(refused.value.body or "{}")["message"]
    assert case.rejected is not None
    assert case.rejected in message, message
    assert shm.gone(kube_api, namespace, name)
    assert job_names(kube_api, namespace) == []
    assert "preshard.dev/owner" not in (
        shm.read_deployment(kube_api, namespace, "vllm")["metadata"].get("annotations") or {}
    )
    shm.forbid_tracebacks(operator)


def jobs_settled(api: k8s.ApiClient, row: Row) -> list[str]:
    """Wait until every Job the row has caused so far is finished; returns their names."""
    names = job_names(api, row.namespace)
    if row.case.credentials == "missing":
        for pod in pods(api, row.namespace, "app.kubernetes.io/managed-by=preshard"):
            (status,) = pod.status.container_statuses
            assert status.state.waiting.reason == "CreateContainerConfigError"
            assert status.restart_count == 0
            assert status.state.terminated is None
        return names
    for name in names:

        def finished(name: str = name) -> str | None:
            return job_finished(read_job(api, row.namespace, name))

        wait_for(finished, what=f"Job {row.namespace}/{name} to finish", timeout=60)
    return names


@pytest.mark.parametrize("case", ACCEPTED, ids=lambda case: case.name)
def test_the_operator_reports_and_touches_nothing(
    case: Case, kube_api: k8s.ApiClient, rows: dict[str, Row], operator: OperatorProcess
) -> None:
    row = rows[case.name]
    assert row.resource is not None
    assert row.case.reason is not None
    assert shm.is_camel_case(row.case.reason)
    assert row.case.reason in shm.KNOWN_REASONS
    ready = workloads.condition(row.resource, "Ready") or {}
    assert ready.get("message"), "the condition says why"
    if row.before is not None:
        after = shm.read_deployment(kube_api, row.namespace, "vllm")
        assert after["metadata"]["generation"] == row.before["metadata"]["generation"]
        assert after["spec"]["template"] == row.before["spec"]["template"]
        annotations = after["metadata"].get("annotations") or {}
        assert not [key for key in annotations if key.startswith("preshard.dev/")]
    names = jobs_settled(kube_api, row)
    if case.name == "engine-arg-value-carries-a-flag":
        (serialize,) = [n for n in names if "-serialize-" in n]
        job = read_job(kube_api, row.namespace, serialize)
        argv = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--load-format" not in argv
        carried = argv[argv.index("--engine-args-json") + 1]
        assert json.loads(carried) == {"quantization": "fp8 --load-format dummy"}
    shm.forbid_tracebacks(operator)
