"""Patching a vLLM Deployment for a shard set, and restoring it, by exact equality."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from preshard.api.models import Storage, parse_spec
from preshard.builders.patching import (
    ANNOTATION_ORIGINAL,
    Refusal,
    TargetInput,
    build_patched_deployment,
    build_restored_deployment,
    deployment_patch,
    managed_view,
    rollout_complete,
    rollout_state,
)
from preshard.builders.pods import s3_endpoint_url
from preshard.builders.shardset import Owner, ShardSet
from preshard.contract import reasons
from preshard.controller.handlers import POD_SELECTOR
from preshard.settings import Settings

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deployments"
KEY = "0123456789abcdef0123"
SETTINGS = Settings(tools_image="tools:1")


def deployment() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": "ns", "resourceVersion": "7", "generation": 3},
        "spec": {
            "replicas": 3,
            "template": {
                "spec": {
                    "initContainers": [{"name": "warmup", "image": "busybox"}],
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.34.0",
                            "command": ["vllm", "serve"],
                            "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"],
                            "env": [
                                {"name": "HF_HOME", "value": "/cache"},
                                {"name": "AWS_REGION", "value": "old"},
                            ],
                            "resources": {
                                "requests": {"nvidia.com/gpu": "1", "cpu": "4"},
                                "limits": {"nvidia.com/gpu": "1"},
                            },
                            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                        },
                        {"name": "sidecar", "image": "envoy"},
                    ],
                    "volumes": [{"name": "cache", "emptyDir": {}}],
                }
            },
        },
    }


def target_input(
    extra: dict[str, Any] | None = None,
    container: str | None = "vllm",
    settings: Settings = SETTINGS,
) -> TargetInput:
    raw: dict[str, Any] = {
        "model": {"id": "meta-llama/Llama-3.1-8B-Instruct"},
        "storage": {
            "uri": "s3://models/shards",
            "endpoint": "http://minio.storage:9000",
            "region": "us-east-1",
            "credentialsSecretRef": {"name": "s3"},
        },
        "tensorParallelSizes": [4],
        **(extra or {}),
    }
    spec = parse_spec(raw)
    return TargetInput(
        owner=Owner(name="llama", namespace="ns", uid="u"),
        spec=spec,
        shard_set=ShardSet.for_spec(spec, 4, KEY),
        settings=settings,
        container=container,
    )


CREDENTIALS = [
    {
        "name": "AWS_ACCESS_KEY_ID",
        "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}},
    },
    {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}},
    },
    {"name": "AWS_REGION", "value": "us-east-1"},
    {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"},
]


def test_patch_points_the_container_at_the_shard_set() -> None:
    patched = build_patched_deployment(deployment(), target_input())
    assert isinstance(patched, dict)
    pod = patched["spec"]["template"]["spec"]
    vllm = pod["containers"][0]
    extra = json.dumps(
        {
            "num_readers": 8,
            "tensorizer_uri": f"s3://models/shards/{KEY}/model-rank-%03d.tensors",
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    assert vllm == {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.34.0",
        "command": ["vllm", "serve"],
        "args": [
            "/var/run/preshard/model",
            "--port",
            "8000",
            "--served-model-name",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--tensor-parallel-size",
            "4",
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            extra,
        ],
        "env": [
            {"name": "HF_HOME", "value": "/cache"},
            *CREDENTIALS,
            {"name": "AWS_ENDPOINT_URL_S3", "value": "http://minio.storage:9000"},
            {"name": "PYTHONPATH", "value": "/var/run/preshard/tensorizer"},
        ],
        "resources": {
            "requests": {"nvidia.com/gpu": "4", "cpu": "4"},
            "limits": {"nvidia.com/gpu": "4"},
        },
        "volumeMounts": [
            {"name": "cache", "mountPath": "/cache"},
            {"name": "preshard-model", "mountPath": "/var/run/preshard/model", "readOnly": True},
            {
                "name": "preshard-tensorizer",
                "mountPath": "/var/run/preshard/tensorizer",
                "readOnly": True,
            },
        ],
    }
    assert pod["containers"][1] == {"name": "sidecar", "image": "envoy"}
    assert pod["initContainers"] == [
        {"name": "warmup", "image": "busybox"},
        {
            "name": "preshard-fetch-config",
            "image": "tools:1",
            "imagePullPolicy": "IfNotPresent",
            "command": ["preshard"],
            "args": [
                "fetch-config",
                f"s3://models/shards/{KEY}/",
                "/var/run/preshard/model",
                "--tensorizer-dir",
                "/var/run/preshard/tensorizer",
                "--endpoint",
                "http://minio.storage:9000",
                "--region",
                "us-east-1",
            ],
            "env": CREDENTIALS,
            "resources": {
                "requests": {"cpu": "100m", "memory": "128Mi"},
                "limits": {"memory": "256Mi"},
            },
            "volumeMounts": [
                {"name": "preshard-model", "mountPath": "/var/run/preshard/model"},
                {"name": "preshard-tensorizer", "mountPath": "/var/run/preshard/tensorizer"},
            ],
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "terminationMessagePolicy": "FallbackToLogsOnError",
        },
    ]
    assert pod["volumes"] == [
        {"name": "cache", "emptyDir": {}},
        {"name": "preshard-model", "emptyDir": {}},
        {"name": "preshard-tensorizer", "emptyDir": {}},
    ]
    assert patched["spec"]["replicas"] == 3
    annotations = patched["metadata"]["annotations"]
    assert annotations["preshard.dev/owner"] == "llama"
    assert annotations["preshard.dev/artifact-key"] == KEY
    assert annotations["preshard.dev/tensor-parallel-size"] == "4"
    assert json.loads(annotations[ANNOTATION_ORIGINAL]) == {
        "container": "vllm",
        "command": ["vllm", "serve"],
        "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"],
        "env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "AWS_REGION", "value": "old"}],
        "resources": {
            "requests": {"nvidia.com/gpu": "1", "cpu": "4"},
            "limits": {"nvidia.com/gpu": "1"},
        },
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    }


def test_an_operator_that_logs_json_has_fetch_config_log_json() -> None:
    json_logging = replace(SETTINGS, log_format="json")
    patched = build_patched_deployment(deployment(), target_input(settings=json_logging))
    as_text = build_patched_deployment(deployment(), target_input())
    assert isinstance(patched, dict)
    assert isinstance(as_text, dict)
    init = patched["spec"]["template"]["spec"]["initContainers"][1]

    assert init["args"] == [
        "fetch-config",
        f"s3://models/shards/{KEY}/",
        "/var/run/preshard/model",
        "--tensorizer-dir",
        "/var/run/preshard/tensorizer",
        "--endpoint",
        "http://minio.storage:9000",
        "--region",
        "us-east-1",
        "--log-format",
        "json",
    ]
    # Nothing else differs from the patch of an operator that logs text.
    as_text["spec"]["template"]["spec"]["initContainers"][1]["args"] += ["--log-format", "json"]
    assert patched == as_text
    # The patch is stable: a second pass of the same operator writes nothing.
    again = build_patched_deployment(patched, target_input(settings=json_logging))
    assert again == patched


def test_an_operator_that_logs_text_passes_no_log_format() -> None:
    text_logging = replace(SETTINGS, log_format="text")
    patched = build_patched_deployment(deployment(), target_input(settings=text_logging))
    assert patched == build_patched_deployment(deployment(), target_input())
    assert isinstance(patched, dict)
    assert "--log-format" not in patched["spec"]["template"]["spec"]["initContainers"][1]["args"]


def test_the_init_container_reads_the_store_through_the_job_pods_proxy() -> None:
    proxy = [
        {"name": "HTTPS_PROXY", "value": "http://proxy.corp:3128"},
        {"name": "NO_PROXY", "value": ".svc,.cluster.local"},
    ]
    with_proxy = target_input({"jobPods": {"env": proxy}})
    patched = build_patched_deployment(deployment(), with_proxy)
    plain = build_patched_deployment(deployment(), target_input())
    assert isinstance(patched, dict)
    assert isinstance(plain, dict)
    init = patched["spec"]["template"]["spec"]["initContainers"][1]
    assert init["env"] == [*CREDENTIALS, *proxy]
    # The serving container keeps its own environment; a proxy change is a change to write.
    vllm = patched["spec"]["template"]["spec"]["containers"][0]
    assert not {e["name"] for e in vllm["env"]} & {"HTTPS_PROXY", "NO_PROXY"}
    hash_key = "preshard.dev/input-hash"
    assert (
        patched["metadata"]["annotations"][hash_key] != plain["metadata"]["annotations"][hash_key]
    )
    assert build_patched_deployment(patched, with_proxy) == patched
    restored = build_restored_deployment(patched)
    assert restored is not None
    original_init = deployment()["spec"]["template"]["spec"]["initContainers"]
    assert restored["spec"]["template"]["spec"]["initContainers"] == original_init


def test_patching_is_idempotent() -> None:
    once = build_patched_deployment(deployment(), target_input())
    assert isinstance(once, dict)
    twice = build_patched_deployment(once, target_input())
    assert twice == once


def test_restore_gives_back_the_original() -> None:
    original = deployment()
    patched = build_patched_deployment(original, target_input())
    assert isinstance(patched, dict)
    restored = build_restored_deployment(patched)
    assert restored is not None
    assert restored["spec"] == original["spec"]
    assert restored["metadata"]["annotations"] == {}
    assert build_restored_deployment(original) is None


def test_the_template_label_goes_with_the_patch_and_the_users_labels_stay() -> None:
    original = deployment()
    original["spec"]["template"]["metadata"] = {"labels": {"app": "vllm"}}
    patched = build_patched_deployment(original, target_input())
    assert isinstance(patched, dict)
    # The operator's pod stream selects by it (`handlers.POD_SELECTOR`).
    assert patched["spec"]["template"]["metadata"]["labels"] == {
        "app": "vllm",
        POD_SELECTOR: "llama",
    }
    restored = build_restored_deployment(patched)
    assert restored is not None
    assert restored["spec"] == original["spec"]


def test_a_template_patched_without_the_label_needs_no_write_for_it() -> None:
    """Patched by a preshard that set no label: adding it would roll every vLLM pod out on an
    operator upgrade, so it waits for the next patch."""
    patched = build_patched_deployment(deployment(), target_input())
    assert isinstance(patched, dict)
    earlier = copy.deepcopy(patched)
    del earlier["spec"]["template"]["metadata"]
    assert managed_view(earlier, "vllm") == managed_view(patched, "vllm")
    again = build_patched_deployment(earlier, target_input())
    assert isinstance(again, dict)
    assert again["spec"]["template"] == patched["spec"]["template"]


def test_encrypted_sets_mount_only_the_key_file() -> None:
    encrypted = target_input({"encryption": {"secretRef": {"name": "key", "key": "k"}}})
    patched = build_patched_deployment(deployment(), encrypted)
    assert isinstance(patched, dict)
    pod = patched["spec"]["template"]["spec"]
    assert pod["volumes"][-1] == {
        "name": "preshard-encryption-key",
        "secret": {
            "secretName": "key",
            "items": [{"key": "k", "path": "key"}],
            "defaultMode": 0o400,
        },
    }
    vllm = pod["containers"][0]
    assert vllm["volumeMounts"][-1] == {
        "name": "preshard-encryption-key",
        "mountPath": "/var/run/preshard/encryption",
        "readOnly": True,
    }
    config = json.loads(vllm["args"][vllm["args"].index("--model-loader-extra-config") + 1])
    assert config["encryption_keyfile"] == "/var/run/preshard/encryption/key"
    init = pod["initContainers"][-1]
    assert all(m["name"] != "preshard-encryption-key" for m in init["volumeMounts"])


def test_https_endpoint_goes_into_the_json_too() -> None:
    spec = target_input({"storage": {"uri": "s3://models/shards", "endpoint": "https://s3.x.io"}})
    patched = build_patched_deployment(deployment(), spec)
    assert isinstance(patched, dict)
    args = patched["spec"]["template"]["spec"]["containers"][0]["args"]
    config = json.loads(args[args.index("--model-loader-extra-config") + 1])
    assert config["s3_endpoint"] == "https://s3.x.io"


def extra_config_and_endpoint_env(storage: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The patched vLLM container's tensorizer JSON and its AWS_ENDPOINT_URL_S3 entries."""
    patched = build_patched_deployment(deployment(), target_input({"storage": storage}))
    assert isinstance(patched, dict)
    vllm = patched["spec"]["template"]["spec"]["containers"][0]
    args = vllm["args"]
    config = json.loads(args[args.index("--model-loader-extra-config") + 1])
    return config, [e for e in vllm["env"] if e["name"] == "AWS_ENDPOINT_URL_S3"]


@pytest.mark.parametrize(
    ("storage", "endpoint"),
    [
        ({"region": "us-west-2"}, "https://s3.us-west-2.amazonaws.com"),
        ({"region": "eu-central-1"}, "https://s3.eu-central-1.amazonaws.com"),
        ({"region": "us-east-1"}, "https://s3.amazonaws.com"),
        ({"region": "cn-north-1"}, "https://s3.cn-north-1.amazonaws.com.cn"),
        ({}, "https://s3.amazonaws.com"),
        ({"endpoint": "https://s3.x.io", "region": "us-west-2"}, "https://s3.x.io"),
    ],
)
def test_the_container_is_always_given_the_endpoint_boto3_would_use(
    storage: dict[str, Any], endpoint: str
) -> None:
    config, env = extra_config_and_endpoint_env({"uri": "s3://models/shards", **storage})
    assert config["s3_endpoint"] == endpoint
    assert env == [{"name": "AWS_ENDPOINT_URL_S3", "value": endpoint}]


def test_a_plain_http_endpoint_reaches_tensorizer_through_the_environment_only() -> None:
    config, env = extra_config_and_endpoint_env(
        {"uri": "s3://models/shards", "endpoint": "http://minio.storage:9000"}
    )
    assert "s3_endpoint" not in config
    assert env == [{"name": "AWS_ENDPOINT_URL_S3", "value": "http://minio.storage:9000"}]


@pytest.mark.parametrize(
    ("storage", "endpoint"),
    [
        (
            {"endpoint": "http://minio.storage:9000", "region": "us-west-2"},
            "http://minio.storage:9000",
        ),
        ({"region": "us-west-2"}, "https://s3.us-west-2.amazonaws.com"),
        ({"region": "us-east-1"}, "https://s3.amazonaws.com"),
        ({"region": "aws-global"}, "https://s3.amazonaws.com"),
        ({"region": "us-gov-west-1"}, "https://s3.us-gov-west-1.amazonaws.com"),
        ({"region": "cn-northwest-1"}, "https://s3.cn-northwest-1.amazonaws.com.cn"),
        ({"region": "us-iso-east-1"}, "https://s3.us-iso-east-1.c2s.ic.gov"),
        ({"region": "us-isob-east-1"}, "https://s3.us-isob-east-1.sc2s.sgov.gov"),
        ({"region": "us-isof-south-1"}, "https://s3.us-isof-south-1.csp.hci.ic.gov"),
        ({"region": "eu-isoe-west-1"}, "https://s3.eu-isoe-west-1.cloud.adc-e.uk"),
        ({"region": "eusc-de-east-1"}, "https://s3.eusc-de-east-1.amazonaws.eu"),
        ({}, "https://s3.amazonaws.com"),
    ],
)
def test_s3_endpoint_url(storage: dict[str, Any], endpoint: str) -> None:
    assert (
        s3_endpoint_url(Storage.model_validate({"uri": "s3://models/shards", **storage}))
        == endpoint
    )


def test_other_gpu_resource_names() -> None:
    amd = target_input({"serialization": {"gpuResourceName": "amd.com/gpu"}})
    source = deployment()
    source["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"amd.com/gpu": "1"}
    }
    patched = build_patched_deployment(source, amd)
    assert isinstance(patched, dict)
    assert patched["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"amd.com/gpu": "4"}
    }


def with_resources(resources: dict[str, Any] | None) -> dict[str, Any]:
    """The test Deployment with other resources on its vLLM container (None: none at all)."""
    source = deployment()
    vllm = source["spec"]["template"]["spec"]["containers"][0]
    if resources is None:
        vllm.pop("resources")
    else:
        vllm["resources"] = resources
    return source


def patched_resources(source: dict[str, Any], extra: dict[str, Any] | None = None) -> Any:
    patched = build_patched_deployment(source, target_input(extra))
    assert isinstance(patched, dict), patched
    return patched["spec"]["template"]["spec"]["containers"][0]["resources"]


@pytest.mark.parametrize(
    "gpu",
    [
        "amd.com/gpu",
        "gpu.intel.com/i915",
        "gpu.intel.com/xe",
        "habana.ai/gaudi",
        "nvidia.com/gpu.shared",
        "example.com/gpu",
    ],
)
def test_the_containers_own_gpu_resource_is_kept(gpu: str) -> None:
    source = with_resources({"requests": {gpu: "8", "cpu": "16"}, "limits": {gpu: "8"}})
    assert patched_resources(source) == {
        "requests": {gpu: "4", "cpu": "16"},
        "limits": {gpu: "4"},
    }


def test_no_second_gpu_vendor_is_added_beside_the_containers() -> None:
    source = with_resources({"limits": {"amd.com/gpu": "8"}})
    named_nvidia = {"serialization": {"gpuResourceName": "nvidia.com/gpu"}}
    assert patched_resources(source) == {"limits": {"amd.com/gpu": "4"}}
    assert patched_resources(source, named_nvidia) == {"limits": {"amd.com/gpu": "4"}}


def test_a_container_without_gpus_is_refused() -> None:
    for resources in (None, {}, {"requests": {"cpu": "8", "memory": "32Gi"}}):
        refused = build_patched_deployment(with_resources(resources), target_input())
        assert isinstance(refused, Refusal)
        assert refused.reason == reasons.NO_GPU_RESOURCE
        assert refused.message.startswith("container vllm requests no GPU (none of nvidia.com/gpu")
        assert "serialization.gpuResourceName" in refused.message


def test_a_gpu_resource_the_spec_names_is_added_to_a_container_without_one() -> None:
    named = {"serialization": {"gpuResourceName": "amd.com/gpu"}}
    assert patched_resources(with_resources(None), named) == {"limits": {"amd.com/gpu": "4"}}
    assert patched_resources(with_resources({"requests": {"cpu": "8"}}), named) == {
        "requests": {"cpu": "8"},
        "limits": {"amd.com/gpu": "4"},
    }


def test_several_gpu_resources_need_the_spec_to_name_one() -> None:
    source = with_resources({"limits": {"nvidia.com/gpu": "1", "example.com/gpu": "1"}})
    refused = build_patched_deployment(source, target_input())
    assert isinstance(refused, Refusal)
    assert refused.reason == reasons.AMBIGUOUS_GPU_RESOURCE
    assert "(example.com/gpu, nvidia.com/gpu)" in refused.message
    named = {"serialization": {"gpuResourceName": "example.com/gpu"}}
    assert patched_resources(source, named) == {
        "limits": {"nvidia.com/gpu": "1", "example.com/gpu": "4"}
    }


def vllm_docs_deployment(file: str) -> dict[str, Any]:
    """A Deployment of vLLM's own Kubernetes docs (`tests/fixtures/deployments`)."""
    loaded: dict[str, Any] = yaml.safe_load((FIXTURES / file).read_text())
    return loaded


def test_the_amd_deployment_of_the_vllm_docs_keeps_its_amd_gpus() -> None:
    patched = build_patched_deployment(
        vllm_docs_deployment("vllm-docs-k8s-amd.yaml"), target_input(container=None)
    )
    assert isinstance(patched, dict)
    assert patched["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"cpu": "10", "memory": "20G", "amd.com/gpu": "4"},
        "requests": {"cpu": "6", "memory": "6G", "amd.com/gpu": "4"},
    }


def test_the_cpu_deployment_of_the_vllm_docs_is_refused() -> None:
    refused = build_patched_deployment(
        vllm_docs_deployment("vllm-docs-k8s-cpu.yaml"), target_input(container=None)
    )
    assert isinstance(refused, Refusal)
    assert refused.reason == reasons.NO_GPU_RESOURCE


def test_restore_gives_back_another_vendors_resources() -> None:
    source = with_resources({"requests": {"amd.com/gpu": "8"}, "limits": {"amd.com/gpu": "8"}})
    patched = build_patched_deployment(source, target_input())
    assert isinstance(patched, dict)
    assert build_patched_deployment(patched, target_input()) == patched
    restored = build_restored_deployment(patched)
    assert restored is not None
    assert restored["spec"] == source["spec"]


def test_an_args_only_container_that_is_not_vllm_is_refused() -> None:
    source = deployment()
    pod = source["spec"]["template"]["spec"]
    pod["containers"] = [
        {
            "name": "sleeper",
            "image": "busybox",
            "args": ["sleep", "infinity"],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
        }
    ]
    refused = build_patched_deployment(source, target_input(container=None))
    assert isinstance(refused, Refusal)
    assert refused.reason == reasons.UNSUPPORTED_COMMAND
    assert refused.message.startswith(
        "container sleeper: the container sets only args, so it runs the entrypoint of its "
        "image 'busybox'"
    )
    pod["containers"][0].update(
        {"image": "vllm/vllm-openai:v0.34.0", "args": ["meta-llama/Llama-3.1-8B-Instruct"]}
    )
    patched = build_patched_deployment(source, target_input(container=None))
    assert isinstance(patched, dict)
    assert patched["spec"]["template"]["spec"]["containers"][0]["args"][:1] == [
        "/var/run/preshard/model"
    ]


def test_container_must_be_found() -> None:
    refused = build_patched_deployment(deployment(), target_input(container="nope"))
    assert not isinstance(refused, dict)
    assert refused.reason == reasons.CONTAINER_NOT_FOUND
    assert "vllm, sidecar" in refused.message


def test_the_vllm_container_is_found_among_several() -> None:
    patched = build_patched_deployment(deployment(), target_input(container=None))
    assert isinstance(patched, dict)
    assert "--load-format" in patched["spec"]["template"]["spec"]["containers"][0]["args"]


def test_deployment_of_another_owner_is_refused() -> None:
    owned = deployment()
    owned["metadata"]["annotations"] = {"preshard.dev/owner": "other"}
    refused = build_patched_deployment(owned, target_input())
    assert not isinstance(refused, dict)
    assert refused.reason == reasons.TARGET_CONFLICT


def test_unsupported_commands_are_refused_with_the_container_named() -> None:
    shell = deployment()
    shell["spec"]["template"]["spec"]["containers"][0].update(
        {"command": ["sh", "-c", "vllm serve x; sleep 1"], "args": None}
    )
    refused = build_patched_deployment(shell, target_input())
    assert not isinstance(refused, dict)
    assert refused.reason == reasons.UNSUPPORTED_COMMAND
    assert refused.message.startswith("container vllm: ")


def test_patch_is_guarded_by_the_generation_and_keeps_other_annotations() -> None:
    current = deployment()
    current["metadata"]["annotations"] = {"team": "inference"}
    patched = build_patched_deployment(current, target_input())
    assert isinstance(patched, dict)
    ops = deployment_patch(current, patched)
    assert ops[0] == {"op": "test", "path": "/metadata/generation", "value": 3}
    assert ops[-1] == {
        "op": "replace",
        "path": "/spec/template",
        "value": patched["spec"]["template"],
    }
    touched = [op["path"] for op in ops[1:-1]]
    assert "/metadata/annotations/preshard.dev~1owner" in touched
    assert all(path.startswith("/metadata/annotations/preshard.dev~1") for path in touched)
    restored = build_restored_deployment(patched)
    assert restored is not None
    removals = deployment_patch(patched, restored)[1:-1]
    assert {op["op"] for op in removals} == {"remove"}
    assert not any(op["path"].endswith("/team") for op in removals)


def test_server_defaults_do_not_look_like_drift() -> None:
    patched = build_patched_deployment(deployment(), target_input())
    assert isinstance(patched, dict)
    defaulted = copy.deepcopy(patched)
    init = defaulted["spec"]["template"]["spec"]["initContainers"][-1]
    init["terminationMessagePath"] = "/dev/termination-log"
    defaulted["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    assert managed_view(defaulted, "vllm") == managed_view(patched, "vllm")


def as_stored(value: Any) -> Any:
    """What the API server keeps of a manifest: empty lists are dropped (omitempty)."""
    if isinstance(value, dict):
        return {k: as_stored(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [as_stored(v) for v in value]
    return value


def test_a_patched_deployment_as_stored_needs_no_further_write() -> None:
    without_credentials = target_input({"storage": {"uri": "s3://models/shards"}})
    source = deployment()
    source["spec"]["template"]["spec"]["containers"][0].pop("env")
    patched = build_patched_deployment(source, without_credentials)
    assert isinstance(patched, dict)
    stored = as_stored(patched)
    again = build_patched_deployment(stored, without_credentials)
    assert isinstance(again, dict)
    assert managed_view(again, "vllm") == managed_view(stored, "vllm")


def test_rollout_state_is_coarse() -> None:
    item = deployment()
    item["status"] = {"observedGeneration": 3, "updatedReplicas": 3, "replicas": 3}
    assert rollout_state(item) == "complete"
    assert rollout_complete(item)
    item["status"] = {"observedGeneration": 2, "updatedReplicas": 1, "replicas": 4}
    assert rollout_state(item) == "in progress"
    assert not rollout_complete(item)


def test_the_bundled_tensorizer_goes_first_on_the_users_pythonpath() -> None:
    original = deployment()
    vllm = original["spec"]["template"]["spec"]["containers"][0]
    vllm["env"].append({"name": "PYTHONPATH", "value": "/opt/plugins"})
    patched = build_patched_deployment(original, target_input())
    assert isinstance(patched, dict)
    env = patched["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "PYTHONPATH"] == [
        {"name": "PYTHONPATH", "value": "/var/run/preshard/tensorizer:/opt/plugins"}
    ]
    again = build_patched_deployment(patched, target_input())
    assert again == patched
    restored = build_restored_deployment(patched)
    assert restored is not None
    assert restored["spec"]["template"]["spec"]["containers"][0]["env"] == vllm["env"]


def test_at_tp_1_the_rank_file_itself_is_named() -> None:
    raw = target_input()
    one = TargetInput(
        owner=raw.owner,
        spec=raw.spec,
        shard_set=ShardSet.for_spec(raw.spec, 1, KEY),
        settings=SETTINGS,
        container="vllm",
    )
    patched = build_patched_deployment(deployment(), one)
    assert isinstance(patched, dict)
    args = patched["spec"]["template"]["spec"]["containers"][0]["args"]
    extra = json.loads(args[args.index("--model-loader-extra-config") + 1])
    # vLLM expands the %03d template only when TP > 1; at TP 1 it opens the URI as written.
    assert extra["tensorizer_uri"] == f"s3://models/shards/{KEY}/model-rank-000.tensors"
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
