"""The Job builders, checked by exact equality against the manifests they must produce."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from preshard.api.models import InvalidSpecError, parse_spec
from preshard.builders.jobs import (
    JobInput,
    build_delete_job,
    build_reshard_job,
    build_serialize_job,
    build_verify_job,
    coerce_engine_arg,
)
from preshard.builders.shardset import Owner, ShardSet, child_name
from preshard.settings import Settings

OWNER = Owner(name="llama", namespace="models", uid="1234")
SETTINGS = Settings(serializer_image="serializer:1", tools_image="tools:1")
KEY = "0123456789abcdef0123"

SPEC: dict[str, Any] = {
    "model": {
        "id": "meta-llama/Llama-3.1-8B-Instruct",
        "revision": "0e9e39f",
        "tokenSecretRef": {"name": "hf"},
    },
    "storage": {
        "uri": "s3://models/shards",
        "endpoint": "https://s3.example.com",
        "region": "eu-west-1",
        "credentialsSecretRef": {"name": "s3-creds"},
    },
    "tensorParallelSizes": [2],
    "serialization": {
        "maxModelLen": 4096,
        "extraEngineArgs": {"quantization": "fp8", "trust-remote-code": "true"},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "memory": "200Gi",
        "scratchSize": "500Gi",
    },
    "encryption": {"secretRef": {"name": "shard-key", "key": "key"}},
}


def job_input(spec: dict[str, Any] = SPEC, run: int = 1, settings: Settings = SETTINGS) -> JobInput:
    parsed = parse_spec(spec)
    return JobInput(
        owner=OWNER,
        spec=parsed,
        shard_set=ShardSet.for_spec(parsed, 2, KEY),
        settings=settings,
        run=run,
    )


S3_ENV = [
    {
        "name": "AWS_ACCESS_KEY_ID",
        "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}},
    },
    {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}},
    },
    {"name": "AWS_REGION", "value": "eu-west-1"},
    {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"},
]


# The restricted Pod Security Standard's pod-level settings, on every Job pod.
POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def metadata(name: str, command: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": "models",
        "labels": {
            "app.kubernetes.io/name": "preshard",
            "app.kubernetes.io/managed-by": "preshard",
            "app.kubernetes.io/component": command,
            "preshard.dev/shardedmodel": "llama",
            "preshard.dev/artifact-key": KEY,
            "preshard.dev/command": command,
        },
        "annotations": {
            "preshard.dev/tensor-parallel-size": "2",
            "preshard.dev/uri": f"s3://models/shards/{KEY}/",
        },
        "ownerReferences": [
            {
                "apiVersion": "preshard.dev/v1alpha1",
                "kind": "ShardedModel",
                "name": "llama",
                "uid": "1234",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def container_of(job: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = job["spec"]["template"]["spec"]["containers"][0]
    return container


def test_serialize_job() -> None:
    job = build_serialize_job(job_input())
    meta = metadata("llama-01234567-serialize-1", "serialize")
    assert job == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": 21600,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": meta["labels"], "annotations": meta["annotations"]},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": POD_SECURITY,
                    "containers": [
                        {
                            "name": "preshard",
                            "image": "serializer:1",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["preshard"],
                            "args": [
                                "serialize",
                                "--model",
                                "meta-llama/Llama-3.1-8B-Instruct",
                                "--revision",
                                "0e9e39f",
                                "--tensor-parallel-size",
                                "2",
                                "--dtype",
                                "auto",
                                "--max-model-len",
                                "4096",
                                "--engine-args-json",
                                '{"quantization":"fp8","trust_remote_code":true}',
                                "--dest",
                                f"s3://models/shards/{KEY}/",
                                "--artifact-key",
                                KEY,
                                "--scratch-dir",
                                "/var/run/preshard/scratch",
                                "--scratch-size-limit",
                                "500Gi",
                                "--encryption-keyfile",
                                "/var/run/preshard/encryption/key",
                                "--endpoint",
                                "https://s3.example.com",
                                "--region",
                                "eu-west-1",
                            ],
                            "env": [
                                *S3_ENV,
                                {
                                    "name": "HF_TOKEN",
                                    "valueFrom": {
                                        "secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}
                                    },
                                },
                                {"name": "HF_HOME", "value": "/var/run/preshard/scratch/hf"},
                                {"name": "TMPDIR", "value": "/var/run/preshard/scratch/tmp"},
                            ],
                            "resources": {
                                "requests": {
                                    "nvidia.com/gpu": "2",
                                    "ephemeral-storage": "500Gi",
                                    "memory": "200Gi",
                                },
                                "limits": {"nvidia.com/gpu": "2", "memory": "200Gi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {"name": "scratch", "mountPath": "/var/run/preshard/scratch"},
                                {"name": "dshm", "mountPath": "/dev/shm"},
                                {
                                    "name": "preshard-encryption-key",
                                    "mountPath": "/var/run/preshard/encryption",
                                    "readOnly": True,
                                },
                            ],
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                        }
                    ],
                    "volumes": [
                        {"name": "scratch", "emptyDir": {"sizeLimit": "500Gi"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                        {
                            "name": "preshard-encryption-key",
                            "secret": {
                                "secretName": "shard-key",
                                "items": [{"key": "key", "path": "key"}],
                                "defaultMode": 0o400,
                            },
                        },
                    ],
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                    ],
                },
            },
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": "preshard",
                            "operator": "In",
                            "values": [20, 22, 30, 31, 32, 33],
                        },
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]
            },
        },
    }


def test_verify_job() -> None:
    job = build_verify_job(job_input(run=3))
    meta = metadata("llama-01234567-verify-3", "verify")
    assert job == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": meta["labels"], "annotations": meta["annotations"]},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": POD_SECURITY,
                    "containers": [
                        {
                            "name": "preshard",
                            "image": "tools:1",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["preshard"],
                            "args": [
                                "verify",
                                f"s3://models/shards/{KEY}/",
                                "--tensor-parallel-size",
                                "2",
                                "--artifact-key",
                                KEY,
                                "--endpoint",
                                "https://s3.example.com",
                                "--region",
                                "eu-west-1",
                            ],
                            "env": S3_ENV,
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "securityContext": {
                                "runAsNonRoot": True,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                        }
                    ],
                },
            },
        },
    }


def test_reshard_job() -> None:
    source = ShardSet.for_spec(parse_spec(SPEC), 1, "fedcba9876543210fedc")
    job = build_reshard_job(job_input(run=1), source.location)
    meta = metadata("llama-01234567-reshard-1", "reshard")
    assert job == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": meta["labels"], "annotations": meta["annotations"]},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": POD_SECURITY,
                    "containers": [
                        {
                            "name": "preshard",
                            "image": "serializer:1",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["preshard"],
                            "args": [
                                "reshard",
                                "s3://models/shards/fedcba9876543210fedc/",
                                "--to-tensor-parallel-size",
                                "2",
                                "--dest",
                                f"s3://models/shards/{KEY}/",
                                "--artifact-key",
                                KEY,
                                "--scratch-dir",
                                "/var/run/preshard/scratch",
                                "--scratch-size-limit",
                                "500Gi",
                                "--encryption-keyfile",
                                "/var/run/preshard/encryption/key",
                                "--endpoint",
                                "https://s3.example.com",
                                "--region",
                                "eu-west-1",
                            ],
                            "env": [
                                *S3_ENV,
                                {"name": "HF_HOME", "value": "/var/run/preshard/scratch/hf"},
                                {"name": "TMPDIR", "value": "/var/run/preshard/scratch/tmp"},
                            ],
                            "resources": {
                                "requests": {
                                    "cpu": "2",
                                    "memory": "4Gi",
                                    "ephemeral-storage": "500Gi",
                                },
                                "limits": {"memory": "16Gi"},
                            },
                            "securityContext": {
                                "runAsNonRoot": True,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {"name": "scratch", "mountPath": "/var/run/preshard/scratch"},
                                {
                                    "name": "preshard-encryption-key",
                                    "mountPath": "/var/run/preshard/encryption",
                                    "readOnly": True,
                                },
                            ],
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                        }
                    ],
                    "volumes": [
                        {"name": "scratch", "emptyDir": {"sizeLimit": "500Gi"}},
                        {
                            "name": "preshard-encryption-key",
                            "secret": {
                                "secretName": "shard-key",
                                "items": [{"key": "key", "path": "key"}],
                                "defaultMode": 256,
                            },
                        },
                    ],
                },
            },
        },
    }


def test_delete_job_runs_delete_on_the_set_only() -> None:
    job = build_delete_job(job_input())
    assert job["metadata"]["name"] == "llama-01234567-delete-1"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [
        "delete",
        f"s3://models/shards/{KEY}/",
        "--endpoint",
        "https://s3.example.com",
        "--region",
        "eu-west-1",
    ]
    assert job["spec"]["backoffLimit"] == 3


def test_an_operator_that_logs_json_has_its_jobs_log_json() -> None:
    json_logging = replace(SETTINGS, log_format="json")
    serialize = build_serialize_job(job_input(settings=json_logging))
    verify = build_verify_job(job_input(settings=json_logging))
    delete = build_delete_job(job_input(settings=json_logging))

    assert container_of(serialize)["args"] == [
        "serialize",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--revision",
        "0e9e39f",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "auto",
        "--max-model-len",
        "4096",
        "--engine-args-json",
        '{"quantization":"fp8","trust_remote_code":true}',
        "--dest",
        f"s3://models/shards/{KEY}/",
        "--artifact-key",
        KEY,
        "--scratch-dir",
        "/var/run/preshard/scratch",
        "--scratch-size-limit",
        "500Gi",
        "--encryption-keyfile",
        "/var/run/preshard/encryption/key",
        "--endpoint",
        "https://s3.example.com",
        "--region",
        "eu-west-1",
        "--log-format",
        "json",
    ]
    assert container_of(verify)["args"] == [
        "verify",
        f"s3://models/shards/{KEY}/",
        "--tensor-parallel-size",
        "2",
        "--artifact-key",
        KEY,
        "--endpoint",
        "https://s3.example.com",
        "--region",
        "eu-west-1",
        "--log-format",
        "json",
    ]
    assert container_of(delete)["args"] == [
        "delete",
        f"s3://models/shards/{KEY}/",
        "--endpoint",
        "https://s3.example.com",
        "--region",
        "eu-west-1",
        "--log-format",
        "json",
    ]
    # Nothing else differs from the Jobs of an operator that logs text.
    for build, job in (
        (build_serialize_job, serialize),
        (build_verify_job, verify),
        (build_delete_job, delete),
    ):
        as_text = build(job_input())
        container_of(as_text)["args"] += ["--log-format", "json"]
        assert job == as_text


def test_an_operator_that_logs_text_passes_no_log_format() -> None:
    text_logging = replace(SETTINGS, log_format="text")
    for build in (build_serialize_job, build_verify_job, build_delete_job):
        job = build(job_input(settings=text_logging))
        assert job == build(job_input())
        assert "--log-format" not in container_of(job)["args"]


def test_minimal_spec_uses_settings_defaults() -> None:
    spec = {
        "model": {"uri": "s3://models/src/llama"},
        "storage": {"uri": "s3://models/shards"},
        "tensorParallelSizes": [2],
        "verification": {"deep": True, "nodeSelector": {"pool": "cpu"}},
    }
    serialize = build_serialize_job(job_input(spec))
    pod = serialize["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "serializer:1"
    assert container["resources"] == {
        "requests": {"nvidia.com/gpu": "2", "ephemeral-storage": "200Gi"},
        "limits": {"nvidia.com/gpu": "2"},
    }
    assert "--encryption-keyfile" not in container["args"]
    assert "--engine-args-json" not in container["args"]
    assert pod["volumes"][0] == {"name": "scratch", "emptyDir": {"sizeLimit": "200Gi"}}
    assert "nodeSelector" not in pod
    verify = build_verify_job(job_input(spec))
    assert "--deep" in verify["spec"]["template"]["spec"]["containers"][0]["args"]
    assert verify["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "env" not in verify["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("size", ["1e11", "+100Gi", ".5Ti", "500Gi"])
def test_the_scratch_volume_is_requested_as_ephemeral_storage(size: str) -> None:
    spec = {**SPEC, "serialization": {"scratchSize": size}}
    pod = build_serialize_job(job_input(spec))["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["requests"]["ephemeral-storage"] == size
    assert "ephemeral-storage" not in container["resources"]["limits"]
    assert pod["volumes"][0] == {"name": "scratch", "emptyDir": {"sizeLimit": size}}
    args = container["args"]
    assert args[args.index("--scratch-size-limit") + 1] == size


@pytest.mark.parametrize(
    ("scratch_volume", "claim_class"),
    [({}, {}), ({"storageClassName": "local-nvme"}, {"storageClassName": "local-nvme"})],
)
def test_scratch_on_a_volume_of_its_own_is_a_claim_per_pod_and_no_node_disk(
    scratch_volume: dict[str, str], claim_class: dict[str, str]
) -> None:
    spec = {**SPEC, "serialization": {"scratchSize": "2Ti", "scratchVolume": scratch_volume}}
    source = ShardSet.for_spec(parse_spec(spec), 1, "fedcba9876543210fedc").location
    for job in (build_serialize_job(job_input(spec)), build_reshard_job(job_input(spec), source)):
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert "ephemeral-storage" not in container["resources"]["requests"]
        assert pod["volumes"][0] == {
            "name": "scratch",
            "ephemeral": {
                "volumeClaimTemplate": {
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "2Ti"}},
                        **claim_class,
                    }
                }
            },
        }
        assert container["volumeMounts"][0] == {
            "name": "scratch",
            "mountPath": "/var/run/preshard/scratch",
        }
        # A claim's free space is its own: no emptyDir limit to pass for it.
        assert "--scratch-size-limit" not in container["args"]


def test_gpu_resource_name_from_spec() -> None:
    spec = {**SPEC, "serialization": {"gpuResourceName": "amd.com/gpu"}}
    container = build_serialize_job(job_input(spec))["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"amd.com/gpu": "2"}


def test_secrets_are_referenced_never_inlined() -> None:
    for build in (build_serialize_job, build_verify_job, build_delete_job):
        job = build(job_input())
        for container in job["spec"]["template"]["spec"]["containers"]:
            for env in container["env"]:
                if env["name"] in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
                    assert "value" not in env
                    assert "secretKeyRef" in env["valueFrom"]


def test_child_names_fit_a_label_value() -> None:
    long_owner = Owner(name="a" * 250, namespace="x", uid="u")
    name = child_name(long_owner, job_input().shard_set, "serialize", 12)
    assert len(name) <= 63
    assert name == "a" * 30 + "-01234567-serialize-12"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("False", False),
        ("8", 8),
        ("-3", -3),
        ("0.9", 0.9),
        ("fp8", "fp8"),
        ("inf", "inf"),
        ("1e5", "1e5"),
        ("", ""),
    ],
)
def test_engine_argument_values_are_typed_conservatively(value: str, expected: object) -> None:
    assert coerce_engine_arg(value) == expected
    assert type(coerce_engine_arg(value)) is type(expected)


def test_job_pods_extras_reach_every_job() -> None:
    extras = {
        "labels": {"kueue.x-k8s.io/queue-name": "gpu-queue"},
        "annotations": {"example.com/team": "inference"},
        "env": [
            {"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"},
            {"name": "PROXY_AUTH", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "auth"}}},
        ],
        "priorityClassName": "batch-high",
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "imagePullSecrets": [{"name": "registry"}],
    }
    spec = job_input({**SPEC, "jobPods": extras})
    source = ShardSet.for_spec(spec.spec, 1, "fedcba9876543210fedc").location
    built = [
        build_serialize_job(spec),
        build_reshard_job(spec, source),
        build_verify_job(spec),
        build_delete_job(spec),
    ]
    for job in built:
        pod = job["spec"]["template"]
        for meta in (job["metadata"], pod["metadata"]):
            assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
            assert meta["labels"]["preshard.dev/shardedmodel"] == "llama"
            assert meta["annotations"]["example.com/team"] == "inference"
        env = container_of(job)["env"]
        assert env[-2:] == extras["env"], job["metadata"]["name"]
        assert pod["spec"]["priorityClassName"] == "batch-high"
        assert pod["spec"]["affinity"] == extras["affinity"]
        assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
        assert pod["spec"]["securityContext"] == POD_SECURITY


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ({"env": [{"name": "HF_TOKEN", "value": "x"}]}, "may not set HF_TOKEN"),
        ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "sets A more than"),
        ({"labels": {"preshard.dev/owner": "x"}}, "may not use preshard.dev/owner"),
        ({"annotations": {"app.kubernetes.io/name": "x"}}, "may not use app.kubernetes.io/name"),
        (
            {
                "env": [
                    {
                        "name": "A",
                        "value": "1",
                        "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
                    }
                ]
            },
            "not both",
        ),
    ],
)
def test_job_pods_may_not_take_over_what_preshard_sets(
    extras: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec({**SPEC, "jobPods": extras})
