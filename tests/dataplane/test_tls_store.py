"""The data-plane commands against a real S3 server over TLS with a private CA.

SeaweedFS serves HTTPS with a certificate of a CA made for the test (`preshard_devenv.pki`).
Without the CA a command fails at once with `Unreachable` and a message that names the cause
and the fix; with `--ca-bundle` (what a Job gets from `storage.caBundle`) or boto3's own
`AWS_CA_BUNDLE` every command works: serialize (and its uploader), verify, fetch-config,
delete. Credentials that come from boto3's default chain rather than the environment (as with
IRSA or EKS Pod Identity) work as well.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from preshard.contract import reasons
from preshard.contract.outcome import exit_code
from preshard.dataplane.s3 import AddressingStyle, make_client
from preshard_devenv import cpuengine, pki
from preshard_devenv.s3server import S3Bucket
from preshard_devenv.tinymodel import TinyModel
from tests.dataplane.conftest import Cli, serialize_args
from tests.dataplane.tls_store import TlsStore, tls_s3_server
from tests.support.models import upload_model

pytestmark = [pytest.mark.s3, pytest.mark.slow]

BUCKET = "preshard-tls"
KEY = "tls-tp2"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsStore]:
    """SeaweedFS over TLS, with one bucket."""
    with tls_s3_server(tmp_path_factory.mktemp("tls-store")) as running:
        running.create_bucket(BUCKET)
        yield running


def admin(store: TlsStore) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=store.endpoint,
        region_name=store.server.region,
        aws_access_key_id=store.server.credentials.access_key_id,
        aws_secret_access_key=store.server.credentials.secret_access_key,
        verify=str(store.ca_file),
    )


@pytest.fixture
def tls_env(store: TlsStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process's environment as a Job's: the store's credentials and HTTPS endpoint, the
    CPU engine, and nothing of this machine's AWS configuration or CA settings."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "S3_", "BOTO")) or name.endswith("_CA_BUNDLE"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("PRESHARD_ENGINE", cpuengine.SPEC)
    for name, value in store.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def run_tls(tls_env: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Cli:
    """A runner of in-process `preshard` commands against the TLS store."""
    return Cli(capsys, tmp_path)


@pytest.fixture(scope="module")
def tls_set(
    store: TlsStore, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A TP-2 shard set that `preshard serialize` wrote over TLS; returns its URI."""
    source = upload_model(tiny_model, admin(store), BUCKET, "sources/tiny")
    scratch = tmp_path_factory.mktemp("tls-scratch")
    bucket = S3Bucket(name=BUCKET, server=store.server, client=admin(store))
    args = serialize_args(source, bucket, "sets", KEY, scratch / "s", tp=2)
    log = scratch / "termination-log"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (store.env() | {"PRESHARD_ENGINE": cpuengine.SPEC}).items():
            patch.setenv(name, value)
        from preshard import cli  # noqa: PLC0415 - the in-process entrypoint

        code = cli.main([*args, "--ca-bundle", str(store.ca_file), "--termination-log", str(log)])
    assert code == 0, log.read_text()
    return f"s3://{BUCKET}/sets/{KEY}/"


def verify_args(uri: str, *extra: str) -> list[str]:
    return ["verify", uri, "--tensor-parallel-size", "2", "--artifact-key", KEY, *extra]


def test_without_the_bundle_the_certificate_is_not_trusted(
    run_tls: Cli, store: TlsStore, tls_set: str
) -> None:
    result = run_tls(*verify_args(tls_set))

    assert result.code == exit_code(reasons.UNREACHABLE)
    assert result.outcome.reason == reasons.UNREACHABLE
    assert result.outcome.message.startswith(
        f"the TLS certificate of {store.endpoint} is not trusted (unable to get local issuer "
        "certificate) while reading "
    )
    assert result.outcome.message.endswith(
        "give the CA that signs it in storage.caBundle (--ca-bundle)"
    )
    assert "Traceback" not in result.stderr
    assert store.server.credentials.secret_access_key not in result.stdout + result.stderr


def test_with_the_bundle_verify_and_fetch_config_work(
    run_tls: Cli, store: TlsStore, tls_set: str, tmp_path: Path
) -> None:
    verified = run_tls(*verify_args(tls_set, "--ca-bundle", str(store.ca_file), "--deep"))
    assert (verified.code, verified.outcome.reason) == (0, reasons.VERIFIED)

    fetched = run_tls(
        "fetch-config", tls_set, str(tmp_path / "model"), "--ca-bundle", str(store.ca_file)
    )
    assert (fetched.code, fetched.outcome.reason) == (0, reasons.CONFIG_FETCHED)
    assert (tmp_path / "model" / "config.json").is_file()


def test_boto3s_own_variable_is_honoured_too(
    run_tls: Cli, store: TlsStore, tls_set: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(store.ca_file))
    result = run_tls(*verify_args(tls_set, "--addressing-style", "path"))
    assert (result.code, result.outcome.reason) == (0, reasons.VERIFIED)


def test_a_bundle_of_another_ca_is_not_enough(
    run_tls: Cli, store: TlsStore, tls_set: str, tmp_path: Path
) -> None:
    other = tmp_path / "other-ca.crt"
    other.write_bytes(pki.CertificateAuthority.create("someone-else").cert_pem)
    result = run_tls(*verify_args(tls_set, "--ca-bundle", str(other)))
    assert result.outcome.reason == reasons.UNREACHABLE
    assert "is not trusted" in result.outcome.message


@pytest.mark.parametrize(
    ("content", "problem"),
    [(None, "no such file"), (b"not a certificate\n", "holds no PEM CA certificate")],
)
def test_a_bundle_that_is_not_one_is_refused_before_any_request(
    run_tls: Cli, tmp_path: Path, content: bytes | None, problem: str
) -> None:
    bundle = tmp_path / "ca.pem"
    if content is not None:
        bundle.write_bytes(content)
    result = run_tls(*verify_args(f"s3://{BUCKET}/sets/{KEY}/", "--ca-bundle", str(bundle)))
    assert result.code == exit_code(reasons.INVALID_ARGUMENTS)
    assert result.outcome.message == f"--ca-bundle {bundle}: {problem}"


def test_an_unknown_addressing_style_is_refused(run_tls: Cli) -> None:
    result = run_tls(*verify_args(f"s3://{BUCKET}/sets/{KEY}/", "--addressing-style", "dns"))
    assert result.code == exit_code(reasons.INVALID_ARGUMENTS)
    assert result.outcome.message == ("--addressing-style 'dns' is not one of auto, path, virtual")


def test_delete_over_tls(run_tls: Cli, store: TlsStore, tls_set: str) -> None:
    client = admin(store)
    copy = f"sets/{secrets.token_hex(4)}"
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"sets/{KEY}/"
    ):
        for item in page.get("Contents", []):
            name = item["Key"][len(f"sets/{KEY}") :]
            client.copy_object(
                Bucket=BUCKET, Key=copy + name, CopySource={"Bucket": BUCKET, "Key": item["Key"]}
            )
    result = run_tls("delete", f"s3://{BUCKET}/{copy}/", "--ca-bundle", str(store.ca_file))
    assert (result.code, result.outcome.reason) == (0, reasons.DELETED)
    assert (result.outcome.files or 0) > 0
    assert "Contents" not in client.list_objects_v2(Bucket=BUCKET, Prefix=copy + "/")


def test_credentials_from_the_default_chain_need_no_variables(
    run_tls: Cli, store: TlsStore, tls_set: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `credentialsSecretRef` a pod has no key variables; boto3's chain finds the
    identity (a web identity token, a container credentials endpoint, here a file)."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[default]\n"
        f"aws_access_key_id = {store.server.credentials.access_key_id}\n"
        f"aws_secret_access_key = {store.server.credentials.secret_access_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))

    result = run_tls(*verify_args(tls_set, "--ca-bundle", str(store.ca_file)))
    assert (result.code, result.outcome.reason) == (0, reasons.VERIFIED)

    credentials.unlink()
    denied = run_tls(*verify_args(tls_set, "--ca-bundle", str(store.ca_file)))
    assert denied.outcome.reason == reasons.ACCESS_DENIED


@pytest.mark.parametrize(
    ("style", "url"),
    [
        ("auto", "https://objects.example.com/models/k"),
        ("path", "https://objects.example.com/models/k"),
        ("virtual", "https://models.objects.example.com/k"),
    ],
)
def test_the_addressing_style_reaches_boto3(
    style: AddressingStyle, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `--addressing-style` makes of a request (presigned: no request is sent)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    client = make_client(
        endpoint="https://objects.example.com", region="us-east-1", addressing_style=style
    )
    presigned = client.generate_presigned_url("get_object", Params={"Bucket": "models", "Key": "k"})
    assert presigned.split("?")[0] == url
