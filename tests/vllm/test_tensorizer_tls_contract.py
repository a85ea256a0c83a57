"""What tensorizer in the patched vLLM container makes of the store's CA bundle and addressing.

tensorizer (`tensorizer.stream_io`) reads a rank file by presigning a GET with boto3 and
streaming it through a `curl` subprocess (`CURLStreamFile`); vLLM passes it no
`certificate_handling`, so curl's own defaults decide whom it trusts. These tests run
tensorizer's real `open_stream` and the real `curl` against SeaweedFS over TLS with a private
CA, in exactly the environment a patched container gets (the ConfigMap's file where the mount
puts it): the `CURL_CA_BUNDLE` preshard sets is what makes the read work; boto3's, requests'
and OpenSSL's variables alone do not reach curl.

tensorizer has no addressing-style setting either: its boto3 client is built without one, so
it presigns path-style URLs for the endpoint it is given whatever `addressingStyle` says; only
botocore's shared config file (`AWS_CONFIG_FILE`, `s3.addressing_style`) changes that.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest

from tests.dataplane.tls_store import TlsStore, tls_s3_server
from tests.vllm.test_s3_endpoint_contract import (
    KEY,
    container_environment,
    no_aws_configuration,
    patched_container,
    tensorizer_reads,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.s3,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorizer") is None or shutil.which("curl") is None,
        reason="tensorizer and curl are not installed",
    ),
]

CA_PATH = "/var/run/preshard/ca/ca.crt"
RANK_FILE = b"rank 0 of a shard set\n" * 1000
CA_VARIABLES = ("CURL_CA_BUNDLE", "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
__all__ = ["no_aws_configuration"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsStore]:
    """SeaweedFS over TLS holding one rank file where the patched container looks for it."""
    with tls_s3_server(tmp_path_factory.mktemp("tls-store")) as running:
        running.create_bucket("models")
        client = boto3.client(
            "s3",
            endpoint_url=running.endpoint,
            region_name=running.server.region,
            aws_access_key_id=running.server.credentials.access_key_id,
            aws_secret_access_key=running.server.credentials.secret_access_key,
            verify=str(running.ca_file),
        )
        client.put_object(
            Bucket="models", Key=f"shards/{KEY}/model-rank-000.tensors", Body=RANK_FILE
        )
        yield running


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch, no_aws_configuration: None) -> None:
    """No CA or proxy setting of this machine reaches curl or boto3."""
    for name in list(os.environ):
        if name in CA_VARIABLES or name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)


def tls_container(store: TlsStore) -> dict[str, Any]:
    return patched_container(
        {"endpoint": store.endpoint, "caBundle": {"name": "store-ca", "key": "ca.crt"}}
    )


def read_rank_zero(
    container: dict[str, Any], store: TlsStore, monkeypatch: pytest.MonkeyPatch
) -> bytes:
    """Rank 0 as vLLM 0.34 opens it: `open_stream` with the JSON's keys, the rest from the
    container's environment (Secret references resolved, the CA file where the mount is)."""
    from tensorizer import stream_io  # noqa: PLC0415

    secrets = {
        "AWS_ACCESS_KEY_ID": store.server.credentials.access_key_id,
        "AWS_SECRET_ACCESS_KEY": store.server.credentials.secret_access_key,
    }
    for name, value in container_environment(container).items():
        if name in secrets:
            value = secrets[name]  # noqa: PLW2901 - the Secret's value, as the kubelet gives it
        monkeypatch.setenv(name, str(store.ca_file) if value == CA_PATH else value)
    monkeypatch.setattr(stream_io, "_s3_default_config_paths", ("/nonexistent/.s3cfg",))
    stream_io._get_s3cfg_values.cache_clear()
    args = container["args"]
    config = json.loads(args[args.index("--model-loader-extra-config") + 1])
    with stream_io.open_stream(
        config["tensorizer_uri"] % 0,
        mode="rb",
        s3_access_key_id=config.get("s3_access_key_id"),
        s3_secret_access_key=config.get("s3_secret_access_key"),
        s3_endpoint=config.get("s3_endpoint"),
    ) as stream:
        data: bytes = stream.read()
    return data


@pytest.mark.usefixtures("clean_environment")
def test_the_patched_container_reads_through_curl_with_the_bundle(
    store: TlsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = tls_container(store)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CURL_CA_BUNDLE"] == CA_PATH
    assert env["AWS_CA_BUNDLE"] == CA_PATH

    assert read_rank_zero(container, store, monkeypatch) == RANK_FILE


@pytest.mark.parametrize("variable", CA_VARIABLES)
@pytest.mark.usefixtures("clean_environment")
def test_which_variable_curl_honours(
    variable: str, store: TlsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each variable alone: curl reads `CURL_CA_BUNDLE`; boto3's and requests' variables never
    reach it, nor does OpenSSL's `SSL_CERT_FILE` (curl sets its own CA file), and the read
    fails on the certificate."""
    container = tls_container(store)
    container["env"] = [
        e for e in container["env"] if e["name"] not in ("CURL_CA_BUNDLE", "AWS_CA_BUNDLE")
    ] + [{"name": variable, "value": CA_PATH}]

    if variable == "CURL_CA_BUNDLE":
        assert read_rank_zero(container, store, monkeypatch) == RANK_FILE
    else:
        # curl ends without a response (its exit code 60: an untrusted certificate).
        with pytest.raises(OSError, match="Failed to open stream"):
            read_rank_zero(container, store, monkeypatch)


@pytest.mark.parametrize("style", ["auto", "path", "virtual"])
@pytest.mark.usefixtures("no_aws_configuration")
def test_tensorizer_reads_path_style_whatever_the_addressing_style(
    style: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = patched_container(
        {"endpoint": "https://objects.example.com", "addressingStyle": style}
    )
    url = urlsplit(tensorizer_reads(container, monkeypatch))
    assert (url.netloc, url.path) == (
        "objects.example.com",
        f"/models/shards/{KEY}/model-rank-000.tensors",
    )


@pytest.mark.usefixtures("no_aws_configuration")
def test_a_shared_config_file_of_the_users_makes_tensorizer_read_virtual_hosted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The way documented for stores that serve only virtual-hosted requests: the user's own
    `AWS_CONFIG_FILE` in the vLLM container, which the patch keeps."""
    config = tmp_path / "aws-config"
    config.write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    container = patched_container(
        {"endpoint": "https://objects.example.com", "addressingStyle": "virtual"}
    )
    container["env"].append({"name": "AWS_CONFIG_FILE", "value": str(config)})
    url = urlsplit(tensorizer_reads(container, monkeypatch))
    assert (url.netloc, url.path) == (
        "models.objects.example.com",
        f"/shards/{KEY}/model-rank-000.tensors",
    )
