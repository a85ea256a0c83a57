"""The patched vLLM container reads from the S3 endpoint boto3 would use, not tensorizer's default.

Two contracts. botocore's own resolver gives, for every region it knows, the endpoint
`s3_endpoint_url` writes. And tensorizer's own `open_stream`, run with exactly the environment
and the `--model-loader-extra-config` JSON of a patched container, presigns its request for that
endpoint and that region: without an endpoint it would read from CoreWeave's
`accel-object.ord1.coreweave.com` (`tensorizer.stream_io.default_s3_read_endpoint`). Only the
HTTP transfer is replaced, so nothing leaves the machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from preshard.api.models import Storage, parse_spec
from preshard.builders.patching import TargetInput, build_patched_deployment
from preshard.builders.pods import s3_endpoint_url
from preshard.builders.shardset import Owner, ShardSet
from preshard.settings import Settings
from preshard_devenv import workloads

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorizer") is None
        or importlib.util.find_spec("botocore") is None,
        reason="tensorizer and botocore are not installed",
    ),
]

KEY = "0123456789abcdef0123"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret"}
COREWEAVE = "coreweave.com"


@pytest.fixture
def no_aws_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing from this machine's environment or files reaches boto3 or tensorizer."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "S3_", "BOTO")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def all_s3_regions() -> list[str]:
    import botocore.session  # noqa: PLC0415

    session = botocore.session.get_session()
    return sorted(
        region
        for partition in session.get_available_partitions()
        for region in session.get_available_regions("s3", partition)
    )


@pytest.mark.usefixtures("no_aws_configuration")
def test_botocore_resolves_the_endpoint_preshard_writes_for_every_region() -> None:
    import botocore.session  # noqa: PLC0415

    session = botocore.session.get_session()
    regions = all_s3_regions()
    assert {"us-east-1", "us-west-2", "cn-north-1", "us-gov-west-1"} <= set(regions)
    for region in [None, *regions]:
        client = session.create_client(
            "s3", region_name=region, aws_access_key_id="a", aws_secret_access_key="b"
        )
        storage = Storage.model_validate({"uri": "s3://models/shards", "region": region})
        assert s3_endpoint_url(storage) == client.meta.endpoint_url, region


def patched_container(storage: dict[str, Any]) -> dict[str, Any]:
    spec = parse_spec(
        {
            "model": {"id": "meta-llama/Llama-3.1-8B-Instruct"},
            "storage": {
                "uri": "s3://models/shards",
                "credentialsSecretRef": {"name": "s3"},
                **storage,
            },
            "tensorParallelSizes": [2],
        }
    )
    target = TargetInput(
        owner=Owner(name="llama", namespace="ns", uid="u"),
        spec=spec,
        shard_set=ShardSet.for_spec(spec, 2, KEY),
        settings=Settings(),
        container=None,
    )
    # The stock image's entrypoint serves: the container sets only the args.
    args_only = workloads.vllm_container(
        "meta-llama/Llama-3.1-8B-Instruct", command=None, port=None
    )
    deployment = workloads.vllm_deployment(namespace="ns", container=args_only)
    deployment["metadata"]["generation"] = 1
    patched = build_patched_deployment(deployment, target)
    assert isinstance(patched, dict)
    container: dict[str, Any] = patched["spec"]["template"]["spec"]["containers"][0]
    return container


def container_environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet gives it: Secret references resolved."""
    env: dict[str, str] = {}
    for entry in container.get("env") or []:
        if "valueFrom" in entry:
            env[entry["name"]] = CREDENTIALS[entry["valueFrom"]["secretKeyRef"]["key"]]
        else:
            env[entry["name"]] = entry["value"]
    return env


def tensorizer_reads(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> str:
    """The URL tensorizer's `open_stream` requests rank 0 from, called the way vLLM calls it.

    vLLM 0.34 (`vllm/model_executor/model_loader/tensorizer.py`, `TensorizerArgs`) passes
    `s3_access_key_id`, `s3_secret_access_key` and `s3_endpoint` from the JSON (None where it
    has none) and lets tensorizer find the rest in the environment.
    """
    from tensorizer import stream_io  # noqa: PLC0415

    for name, value in container_environment(container).items():
        monkeypatch.setenv(name, value)
    # No ~/.s3cfg of this machine: tensorizer would take an endpoint from it.
    monkeypatch.setattr(stream_io, "_s3_default_config_paths", ("/nonexistent/.s3cfg",))
    stream_io._get_s3cfg_values.cache_clear()
    requested: list[str] = []

    class Recorder:
        def __init__(self, url: str, **_: object) -> None:
            requested.append(url)

    monkeypatch.setattr(stream_io, "CURLStreamFile", Recorder)
    args = container["args"]
    config = json.loads(args[args.index("--model-loader-extra-config") + 1])
    stream_io.open_stream(
        config["tensorizer_uri"] % 0,
        mode="rb",
        s3_access_key_id=config.get("s3_access_key_id"),
        s3_secret_access_key=config.get("s3_secret_access_key"),
        s3_endpoint=config.get("s3_endpoint"),
    )
    (url,) = requested
    return url


@pytest.mark.parametrize(
    ("storage", "origin", "region"),
    [
        ({"region": "us-west-2"}, "https://s3.us-west-2.amazonaws.com", "us-west-2"),
        ({"region": "eu-west-1"}, "https://s3.eu-west-1.amazonaws.com", "eu-west-1"),
        ({"region": "us-east-1"}, "https://s3.amazonaws.com", "us-east-1"),
        ({"region": "cn-north-1"}, "https://s3.cn-north-1.amazonaws.com.cn", "cn-north-1"),
        # Neither endpoint nor region: the global endpoint, as boto3 resolves it.
        ({}, "https://s3.amazonaws.com", "us-east-1"),
        (
            {"endpoint": "https://objects.example.com", "region": "auto"},
            "https://objects.example.com",
            "auto",
        ),
        ({"endpoint": "http://minio.storage:9000"}, "http://minio.storage:9000", "us-east-1"),
    ],
)
@pytest.mark.usefixtures("no_aws_configuration")
def test_tensorizer_reads_the_patched_container_from_the_right_endpoint(
    storage: dict[str, Any], origin: str, region: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = tensorizer_reads(patched_container(storage), monkeypatch)

    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}" == origin
    assert COREWEAVE not in parts.netloc
    assert parts.path == f"/models/shards/{KEY}/model-rank-000.tensors"
    credential = parse_qs(parts.query)["X-Amz-Credential"][0]
    assert credential.split("/")[0] == CREDENTIALS["AWS_ACCESS_KEY_ID"]
    assert credential.split("/")[2] == region


@pytest.mark.usefixtures("no_aws_configuration")
def test_without_the_endpoint_tensorizer_would_read_from_coreweave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the fix prevents, shown with the same code path: the region alone is not enough."""
    container = patched_container({"region": "us-west-2"})
    args = container["args"]
    index = args.index("--model-loader-extra-config") + 1
    config = json.loads(args[index])
    config.pop("s3_endpoint")
    args[index] = json.dumps(config)
    container["env"] = [e for e in container["env"] if e["name"] != "AWS_ENDPOINT_URL_S3"]

    url = tensorizer_reads(container, monkeypatch)

    assert urlsplit(url).netloc.endswith("accel-object.ord1.coreweave.com")
