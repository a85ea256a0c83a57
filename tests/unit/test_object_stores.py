"""The store's CA bundle and addressing style in every pod that talks to S3, by exact equality.

`storage.caBundle` is mounted read-only into the Jobs, the `fetch-config` init container and
the patched vLLM container, and each uses it: the data-plane commands through `--ca-bundle`,
tensorizer's curl through `CURL_CA_BUNDLE` and its boto3 through `AWS_CA_BUNDLE`. Restoring a
Deployment takes all of it away again and gives back the user's own values.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from preshard.api.models import InvalidSpecError, parse_spec
from preshard.builders.jobs import (
    JobInput,
    build_delete_job,
    build_reshard_job,
    build_serialize_job,
    build_verify_job,
)
from preshard.builders.patching import (
    TargetInput,
    build_patched_deployment,
    build_restored_deployment,
    managed_view,
)
from preshard.builders.pods import s3_args, s3_env
from preshard.builders.shardset import Owner, ShardSet
from preshard.contract.layout import S3Location
from preshard.settings import Settings
from preshard_devenv import workloads

OWNER = Owner(name="llama", namespace="models", uid="1234")
SETTINGS = Settings(serializer_image="serializer:1", tools_image="tools:1")
KEY = "0123456789abcdef0123"
CA_PATH = "/var/run/preshard/ca/ca.crt"
CA_VOLUME = {
    "name": "preshard-ca-bundle",
    "configMap": {"name": "minio-ca", "items": [{"key": "ca.pem", "path": "ca.crt"}]},
}
CA_MOUNT = {"name": "preshard-ca-bundle", "mountPath": "/var/run/preshard/ca", "readOnly": True}
CA_ENV = [
    {"name": "CURL_CA_BUNDLE", "value": CA_PATH},
    {"name": "AWS_CA_BUNDLE", "value": CA_PATH},
]
STORE_FLAGS = [
    "--endpoint",
    "https://minio.storage:9000",
    "--ca-bundle",
    CA_PATH,
    "--addressing-style",
    "path",
]


def raw_spec(**storage: Any) -> dict[str, Any]:
    return {
        "model": {"id": "meta-llama/Llama-3.1-8B-Instruct"},
        "storage": {
            "uri": "s3://models/shards",
            "endpoint": "https://minio.storage:9000",
            "credentialsSecretRef": {"name": "s3"},
            "caBundle": {"name": "minio-ca", "key": "ca.pem"},
            "addressingStyle": "path",
            **storage,
        },
        "tensorParallelSizes": [2],
    }


def job_input(raw: dict[str, Any]) -> JobInput:
    spec = parse_spec(raw)
    return JobInput(
        owner=OWNER,
        spec=spec,
        shard_set=ShardSet.for_spec(spec, 2, KEY),
        settings=SETTINGS,
        run=1,
    )


def target_input(raw: dict[str, Any]) -> TargetInput:
    spec = parse_spec(raw)
    return TargetInput(
        owner=OWNER,
        spec=spec,
        shard_set=ShardSet.for_spec(spec, 2, KEY),
        settings=SETTINGS,
        container="vllm",
    )


def deployment(env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    container = workloads.vllm_container(
        "meta-llama/Llama-3.1-8B-Instruct",
        port=None,
        volumeMounts=[{"name": "cache", "mountPath": "/cache"}],
    )
    if env is not None:
        container["env"] = env
    manifest = workloads.vllm_deployment(
        namespace="models",
        container=container,
        pod_spec={"volumes": [{"name": "cache", "emptyDir": {}}]},
    )
    manifest["metadata"]["generation"] = 1
    return manifest


def pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = manifest["spec"]["template"]["spec"]
    return spec


def test_the_storage_defaults_and_refusals() -> None:
    plain = parse_spec({**raw_spec(), "storage": {"uri": "s3://models/shards"}})
    assert plain.storage.ca_bundle is None
    assert plain.storage.addressing_style == "auto"
    assert s3_args(plain.storage) == []
    with pytest.raises(InvalidSpecError, match=r"storage\.addressingStyle"):
        parse_spec(raw_spec(addressingStyle="dns"))
    with pytest.raises(InvalidSpecError, match=r"storage\.caBundle\.key"):
        parse_spec(raw_spec(caBundle={"name": "minio-ca"}))


def test_store_flags_name_the_bundle_and_the_style_only_when_set() -> None:
    spec = parse_spec(raw_spec())
    assert s3_args(spec.storage) == STORE_FLAGS
    assert s3_args(parse_spec(raw_spec(addressingStyle="auto")).storage) == STORE_FLAGS[:4]
    virtual = parse_spec(raw_spec(caBundle=None, addressingStyle="virtual"))
    assert s3_args(virtual.storage) == [
        "--endpoint",
        "https://minio.storage:9000",
        "--addressing-style",
        "virtual",
    ]


@pytest.mark.parametrize("build", [build_verify_job, build_delete_job])
def test_tools_jobs_mount_the_bundle_and_pass_it(build: Any) -> None:
    job = build(job_input(raw_spec()))
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"][-len(STORE_FLAGS) :] == STORE_FLAGS
    assert container["volumeMounts"] == [CA_MOUNT]
    assert spec["volumes"] == [CA_VOLUME]


def test_tools_jobs_without_a_bundle_have_no_volumes() -> None:
    job = build_verify_job(job_input(raw_spec(caBundle=None, addressingStyle="auto")))
    spec = job["spec"]["template"]["spec"]
    assert "volumes" not in spec
    assert "volumeMounts" not in spec["containers"][0]
    assert "--ca-bundle" not in spec["containers"][0]["args"]


def test_the_serialize_job_mounts_the_bundle_beside_scratch_and_shm() -> None:
    job = build_serialize_job(job_input(raw_spec()))
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert [f for f in container["args"] if f in ("--ca-bundle", CA_PATH)] == [
        "--ca-bundle",
        CA_PATH,
    ]
    assert container["volumeMounts"] == [
        {"name": "scratch", "mountPath": "/var/run/preshard/scratch"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        CA_MOUNT,
    ]
    assert spec["volumes"] == [
        {"name": "scratch", "emptyDir": {"sizeLimit": "200Gi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        CA_VOLUME,
    ]


def test_the_reshard_job_mounts_the_bundle() -> None:
    source = S3Location.parse("s3://models/shards/fedcba9876543210fedc/")
    job = build_reshard_job(job_input(raw_spec()), source)
    spec = job["spec"]["template"]["spec"]
    assert spec["containers"][0]["volumeMounts"][-1] == CA_MOUNT
    assert spec["volumes"][-1] == CA_VOLUME
    assert "--ca-bundle" in spec["containers"][0]["args"]


def test_without_credentials_no_credential_variables_are_set() -> None:
    spec = parse_spec(raw_spec(credentialsSecretRef=None, region="eu-west-1"))
    assert s3_env(spec.storage) == [
        {"name": "AWS_REGION", "value": "eu-west-1"},
        {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"},
    ]
    job = build_verify_job(job_input(raw_spec(credentialsSecretRef=None)))
    assert "env" not in job["spec"]["template"]["spec"]["containers"][0]
    patched = build_patched_deployment(
        deployment(), target_input(raw_spec(credentialsSecretRef=None))
    )
    assert isinstance(patched, dict)
    names = [e["name"] for e in pod_spec(patched)["containers"][0]["env"]]
    assert names == ["AWS_ENDPOINT_URL_S3", "CURL_CA_BUNDLE", "AWS_CA_BUNDLE", "PYTHONPATH"]


def test_the_patched_pod_mounts_the_bundle_in_both_containers() -> None:
    patched = build_patched_deployment(deployment(), target_input(raw_spec()))
    assert isinstance(patched, dict)
    spec = pod_spec(patched)
    (init,) = spec["initContainers"]
    assert init["args"] == [
        "fetch-config",
        f"s3://models/shards/{KEY}/",
        "/var/run/preshard/model",
        "--tensorizer-dir",
        "/var/run/preshard/tensorizer",
        *STORE_FLAGS,
    ]
    assert init["volumeMounts"] == [
        {"name": "preshard-model", "mountPath": "/var/run/preshard/model"},
        {"name": "preshard-tensorizer", "mountPath": "/var/run/preshard/tensorizer"},
        CA_MOUNT,
    ]
    (vllm,) = spec["containers"]
    assert vllm["env"] == [
        {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}},
        },
        {
            "name": "AWS_SECRET_ACCESS_KEY",
            "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}},
        },
        {"name": "AWS_ENDPOINT_URL_S3", "value": "https://minio.storage:9000"},
        *CA_ENV,
        {"name": "PYTHONPATH", "value": "/var/run/preshard/tensorizer"},
    ]
    assert vllm["volumeMounts"] == [
        {"name": "cache", "mountPath": "/cache"},
        {"name": "preshard-model", "mountPath": "/var/run/preshard/model", "readOnly": True},
        {
            "name": "preshard-tensorizer",
            "mountPath": "/var/run/preshard/tensorizer",
            "readOnly": True,
        },
        CA_MOUNT,
    ]
    assert spec["volumes"] == [
        {"name": "cache", "emptyDir": {}},
        {"name": "preshard-model", "emptyDir": {}},
        {"name": "preshard-tensorizer", "emptyDir": {}},
        CA_VOLUME,
    ]


def test_restore_takes_the_bundle_away_and_gives_back_the_users_own() -> None:
    own = [{"name": "CURL_CA_BUNDLE", "value": "/etc/ssl/mine.pem"}]
    original = deployment(env=own)
    patched = build_patched_deployment(copy.deepcopy(original), target_input(raw_spec()))
    assert isinstance(patched, dict)
    env = pod_spec(patched)["containers"][0]["env"]
    assert [e for e in env if e["name"] in ("CURL_CA_BUNDLE", "AWS_CA_BUNDLE")] == CA_ENV

    restored = build_restored_deployment(patched)
    assert restored is not None
    assert pod_spec(restored) == pod_spec(original)


def test_without_a_bundle_the_users_own_ca_variables_stay() -> None:
    own = [
        {"name": "CURL_CA_BUNDLE", "value": "/etc/ssl/mine.pem"},
        {"name": "AWS_CA_BUNDLE", "value": "/etc/ssl/mine.pem"},
    ]
    target = target_input(raw_spec(caBundle=None))
    patched = build_patched_deployment(deployment(env=own), target)
    assert isinstance(patched, dict)
    env = pod_spec(patched)["containers"][0]["env"]
    assert [e for e in env if e["name"] in ("CURL_CA_BUNDLE", "AWS_CA_BUNDLE")] == own
    assert all(v["name"] != "preshard-ca-bundle" for v in pod_spec(patched)["volumes"])


def test_removing_the_bundle_from_the_spec_removes_what_preshard_set() -> None:
    with_bundle = build_patched_deployment(deployment(), target_input(raw_spec()))
    assert isinstance(with_bundle, dict)
    without = build_patched_deployment(with_bundle, target_input(raw_spec(caBundle=None)))
    assert isinstance(without, dict)
    spec = pod_spec(without)
    names = [e["name"] for e in spec["containers"][0]["env"]]
    assert "CURL_CA_BUNDLE" not in names
    assert "AWS_CA_BUNDLE" not in names
    assert CA_MOUNT not in spec["containers"][0]["volumeMounts"]
    assert CA_MOUNT not in spec["initContainers"][0]["volumeMounts"]
    assert CA_VOLUME not in spec["volumes"]
    fresh = build_patched_deployment(deployment(), target_input(raw_spec(caBundle=None)))
    assert isinstance(fresh, dict)
    assert managed_view(without, "vllm") == managed_view(fresh, "vllm")


def test_a_removed_ca_variable_is_a_difference_preshard_puts_back() -> None:
    patched = build_patched_deployment(deployment(), target_input(raw_spec()))
    assert isinstance(patched, dict)
    edited = copy.deepcopy(patched)
    container = pod_spec(edited)["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "CURL_CA_BUNDLE"]
    assert managed_view(edited, "vllm") != managed_view(patched, "vllm")
    again = build_patched_deployment(edited, target_input(raw_spec()))
    assert isinstance(again, dict)
    assert managed_view(again, "vllm") == managed_view(patched, "vllm")
