"""What kopf's watch streams ask the API server for: the Job stream only the operator's Jobs, the
pod stream only the pods of its Jobs and of the templates it patched."""

from __future__ import annotations

import kopf

from preshard.api import models
from preshard.builders import jobs
from preshard.builders.shardset import Owner, ShardSet
from preshard.contract.layout import S3Location
from preshard.controller.handlers import (
    JOB_SELECTOR,
    JOBS,
    POD_SELECTOR,
    PODS,
    WATCHED,
    configure_watching,
)
from preshard.settings import Settings
from tests.support.specs import kwok_spec


def test_the_job_and_pod_streams_are_narrowed_by_the_api_server() -> None:
    settings = kopf.OperatorSettings()
    configure_watching(settings)

    selectors = {
        resource: settings.watching.label_selectors.collect(kopf.Resource(*resource))
        for resource in WATCHED
    }

    narrowed = {JOBS: [JOB_SELECTOR], PODS: [POD_SELECTOR]}
    assert selectors == {resource: narrowed.get(resource, []) for resource in WATCHED}


def test_every_job_preshard_builds_is_in_the_job_stream() -> None:
    spec = models.parse_spec(kwok_spec())
    job = jobs.JobInput(
        owner=Owner(name="llama", namespace="models", uid="1"),
        spec=spec,
        shard_set=ShardSet.for_spec(spec, 2, "0123456789abcdef0123"),
        settings=Settings(),
        run=1,
    )
    source = S3Location.parse("s3://models/shards/fedcba9876543210fedc/")
    built = [
        jobs.build_serialize_job(job),
        jobs.build_reshard_job(job, source),
        jobs.build_verify_job(job),
        jobs.build_delete_job(job),
    ]
    key, value = JOB_SELECTOR.split("=")

    for manifest in built:
        assert manifest["metadata"]["labels"][key] == value
        assert manifest["spec"]["template"]["metadata"]["labels"][key] == value
        # Their pods are in the pod stream.
        assert POD_SELECTOR in manifest["spec"]["template"]["metadata"]["labels"]
