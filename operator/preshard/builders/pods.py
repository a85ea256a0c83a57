"""What the pods preshard runs or patches are given: the store's environment and flags, the
encryption key and CA bundle as files, where their scratch lives, the operator's log format.
"""

from __future__ import annotations

from typing import Final

from preshard.api import models
from preshard.builders import Manifest
from preshard.settings import Settings

# Where the data-plane containers find what they need.
SCRATCH_DIR: Final = "/var/run/preshard/scratch"
ENCRYPTION_DIR: Final = "/var/run/preshard/encryption"
ENCRYPTION_FILE: Final = "key"
ENCRYPTION_KEYFILE: Final = f"{ENCRYPTION_DIR}/{ENCRYPTION_FILE}"
ENCRYPTION_VOLUME: Final = "preshard-encryption-key"
# The store's CA bundle (`storage.caBundle`), mounted read-only where a pod talks to S3.
CA_BUNDLE_DIR: Final = "/var/run/preshard/ca"
CA_BUNDLE_FILE: Final = "ca.crt"
CA_BUNDLE_PATH: Final = f"{CA_BUNDLE_DIR}/{CA_BUNDLE_FILE}"
CA_BUNDLE_VOLUME: Final = "preshard-ca-bundle"

# What boto3 resolves for S3 without a region, and for us-east-1 and the pseudo-region
# aws-global.
AWS_GLOBAL_ENDPOINT: Final = "https://s3.amazonaws.com"
_AWS_GLOBAL_REGIONS: Final = frozenset({"us-east-1", "aws-global"})
# The DNS suffix of each AWS partition other than `aws` (botocore's partitions.json), by the
# prefix of its region names; every other region is in `aws` (amazonaws.com).
_AWS_PARTITION_DNS_SUFFIXES: Final = (
    ("cn-", "amazonaws.com.cn"),
    ("us-iso-", "c2s.ic.gov"),
    ("us-isob-", "sc2s.sgov.gov"),
    ("us-isof-", "csp.hci.ic.gov"),
    ("eu-isoe-", "cloud.adc-e.uk"),
    ("eusc-", "amazonaws.eu"),
)


def s3_env(storage: models.Storage) -> list[Manifest]:
    """Container env for S3: credentials by Secret reference (never by value), and the region."""
    env: list[Manifest] = []
    credentials = storage.credentials_secret_ref
    if credentials is not None:
        env.append(
            _secret_env("AWS_ACCESS_KEY_ID", credentials.name, credentials.access_key_id_key)
        )
        env.append(
            _secret_env(
                "AWS_SECRET_ACCESS_KEY", credentials.name, credentials.secret_access_key_key
            )
        )
        if credentials.session_token_key:
            env.append(
                _secret_env("AWS_SESSION_TOKEN", credentials.name, credentials.session_token_key)
            )
    if storage.region:
        env.append({"name": "AWS_REGION", "value": storage.region})
        env.append({"name": "AWS_DEFAULT_REGION", "value": storage.region})
    return env


def s3_endpoint_url(storage: models.Storage) -> str:
    """The S3 endpoint a pod must be given: the configured one, or the AWS endpoint of the region.

    boto3 finds the regional AWS endpoint by itself, but tensorizer does not: without an
    endpoint argument or `AWS_ENDPOINT_URL_S3` it reads from its own default, CoreWeave's
    `accel-object.ord1.coreweave.com`. So the patched vLLM container is always told the endpoint
    boto3 would use for the region (botocore's resolver, `s3_us_east_1_regional_endpoint`
    left at its default): `us-east-1` is the global `https://s3.amazonaws.com`, other regions
    `https://s3.<region>.<partition DNS suffix>`. Without a region either, the global endpoint,
    as boto3 resolves it without one: it serves buckets in `us-east-1`, so a bucket elsewhere
    needs `storage.region`.
    """
    if storage.endpoint:
        return storage.endpoint
    region = storage.region
    if region is None or region in _AWS_GLOBAL_REGIONS:
        return AWS_GLOBAL_ENDPOINT
    suffix = next(
        (dns for prefix, dns in _AWS_PARTITION_DNS_SUFFIXES if region.startswith(prefix)),
        "amazonaws.com",
    )
    return f"https://s3.{region}.{suffix}"


def s3_args(storage: models.Storage) -> list[str]:
    """Data-plane flags for the store's endpoint, region, CA bundle and addressing style (not
    secret). The last two only when set, so a spec without them builds what it always did."""
    args: list[str] = []
    if storage.endpoint:
        args += ["--endpoint", storage.endpoint]
    if storage.region:
        args += ["--region", storage.region]
    if storage.ca_bundle is not None:
        args += ["--ca-bundle", CA_BUNDLE_PATH]
    if storage.addressing_style != "auto":
        args += ["--addressing-style", storage.addressing_style]
    return args


def tool_args(storage: models.Storage, settings: Settings) -> list[str]:
    """The flags every data-plane command gets: the store's and the operator's log format."""
    return [*s3_args(storage), *_log_args(settings)]


def file_mounts(spec: models.ShardedModelSpec, *, encryption_key: bool) -> list[Manifest]:
    """Where a container sees the files it reads from the cluster: the encryption key (asked
    for with `encryption_key`, when the set is encrypted) and the store's CA bundle (when it
    has one), each read-only."""
    mounts: list[Manifest] = []
    if encryption_key and spec.encryption is not None:
        mounts.append({"name": ENCRYPTION_VOLUME, "mountPath": ENCRYPTION_DIR, "readOnly": True})
    if spec.storage.ca_bundle is not None:
        mounts.append({"name": CA_BUNDLE_VOLUME, "mountPath": CA_BUNDLE_DIR, "readOnly": True})
    return mounts


def file_volumes(spec: models.ShardedModelSpec, *, encryption_key: bool) -> list[Manifest]:
    """The volumes behind `file_mounts`: the Secret that holds the encryption key, with only the
    key in it as an owner-read file, and the ConfigMap of the CA bundle, only the bundle."""
    volumes: list[Manifest] = []
    if encryption_key and spec.encryption is not None:
        secret = spec.encryption.secret_ref
        volumes.append(
            {
                "name": ENCRYPTION_VOLUME,
                "secret": {
                    "secretName": secret.name,
                    "items": [{"key": secret.key, "path": ENCRYPTION_FILE}],
                    "defaultMode": 0o400,
                },
            }
        )
    ca_bundle = spec.storage.ca_bundle
    if ca_bundle is not None:
        volumes.append(
            {
                "name": CA_BUNDLE_VOLUME,
                "configMap": {
                    "name": ca_bundle.name,
                    "items": [{"key": ca_bundle.key, "path": CA_BUNDLE_FILE}],
                },
            }
        )
    return volumes


def _log_args(settings: Settings) -> list[str]:
    # `--log-format json` when the operator logs JSON; nothing for text, the data plane's
    # default, so the manifests of a text-logging operator are what they were without it.
    return ["--log-format", "json"] if settings.log_format == "json" else []


def _secret_env(name: str, secret: str, key: str) -> Manifest:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
