"""`preshard run` (the operator) and `preshard render` (an offline preview of its output)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from preshard.api import models
from preshard.builders import Manifest, jobs, patching
from preshard.builders.identity import serializer_vllm_version, shard_set_key
from preshard.builders.shardset import Owner, ShardSet
from preshard.contract import reasons
from preshard.settings import Settings, SettingsError

Subparsers = argparse._SubParsersAction


def register(subcommands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add `run` and `render` to the top-level parser."""
    run = subcommands.add_parser(
        "run",
        help="run the operator against the current kube context",
        description=(
            "Run the ShardedModel controller. Settings come from PRESHARD_* environment "
            "variables (see the Helm chart's values.yaml); credentials from the kubeconfig "
            "or the in-cluster ServiceAccount."
        ),
    )
    run.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: PRESHARD_NAMESPACES or all)",
    )
    run.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL kopf serves (default: %(default)s; empty to disable)",
    )
    run.add_argument("--verbose", action="store_true", help="log every step kopf takes")
    run.set_defaults(run=_run)

    render = subcommands.add_parser(
        "render",
        help="print the Jobs and patched Deployments a ShardedModel produces, without a cluster",
        description=(
            "Read a ShardedModel and Deployments from YAML files and print, as YAML, the Jobs "
            "the controller creates and each target Deployment as it will be patched once its "
            "shard set is verified. A target that would be refused is named on stderr with its "
            "reason, and the exit code is 1. Settings come from PRESHARD_* variables."
        ),
    )
    render.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        type=Path,
        help="a YAML file with a ShardedModel and/or Deployments (repeatable; - for stdin)",
    )
    render.add_argument(
        "-n", "--namespace", default="default", help="namespace of objects that name none"
    )
    render.set_defaults(run=_render)


def _run(args: argparse.Namespace) -> int:
    import kopf  # noqa: PLC0415 - kopf is only needed by the operator itself

    # Imported here, not at the top: the data-plane images run `preshard` without kopf, the
    # Kubernetes client or prometheus_client.
    from preshard.controller import (  # noqa: PLC0415
        handlers,  # noqa: F401 - registers the handlers
        kopf_barrier,
        metrics,
    )

    try:
        settings = Settings.from_env()
    except SettingsError as error:
        sys.stderr.write(f"preshard run: {error}\n")
        return 2
    configure_logging(settings, verbose=args.verbose)
    namespaces = tuple(args.namespace) or settings.namespaces
    recorder = metrics.Metrics.for_process()
    server: metrics.MetricsServer | None = None
    if settings.metrics_port:
        # Bound before the operator starts, so a port in use stops it at once, with the reason.
        try:
            server = recorder.serve(settings.metrics_port)
        except OSError as error:
            sys.stderr.write(
                f"preshard run: cannot serve metrics on port {settings.metrics_port}: {error}\n"
            )
            return 2
    kopf_barrier.install()
    try:
        asyncio.run(
            kopf.operator(
                standalone=True,
                clusterwide=not namespaces,
                namespaces=namespaces,
                liveness_endpoint=args.liveness or None,
                memo=kopf.Memo(settings=settings, metrics=recorder, namespaces=namespaces),
            )
        )
    finally:
        if server is not None:
            server.close()
    return 0


def configure_logging(settings: Settings, *, verbose: bool) -> None:
    """The operator's log: one line per record, text or JSON, each naming its ShardedModel.

    A record about one object (kopf's per-object logger, and the reconciler's `object_log`)
    carries its reference: a JSON line has it as its `object` field, a text line starts with
    `[namespace/name]`.
    """
    import kopf  # noqa: PLC0415 - kopf is only needed by the operator itself

    json_lines = settings.log_format == "json"
    kopf.configure(
        verbose=verbose,
        log_format=kopf.LogFormat.JSON if json_lines else kopf.LogFormat.PLAIN,
        log_prefix=not json_lines,
    )
    if not verbose:
        # kopf logs every handled watch event at INFO; keep the operator's own log readable.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


def _render(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env()
        documents = [doc for path in args.filename for doc in _load(path)]
    except (SettingsError, OSError, yaml.YAMLError) as error:
        sys.stderr.write(f"preshard render: {error}\n")
        return 2
    sharded = [d for d in documents if d.get("kind") == models.KIND]
    if not sharded:
        sys.stderr.write("preshard render: no ShardedModel in the input\n")
        return 2
    output: list[Manifest] = []
    refused = False
    for resource in sharded:
        metadata = resource.get("metadata") or {}
        namespace = metadata.get("namespace") or args.namespace
        name = str(metadata.get("name", "shardedmodel"))
        try:
            spec = models.parse_spec(resource.get("spec"))
        except models.InvalidSpecError as error:
            sys.stderr.write(f"ShardedModel {name}: {reasons.INVALID_SPEC}: {error}\n")
            refused = True
            continue
        owner = Owner(name=name, namespace=namespace, uid=str(metadata.get("uid", "")))
        sets = {
            tp: ShardSet.for_spec(
                spec, tp, shard_set_key(spec, tp, namespace=namespace, settings=settings)
            )
            for tp in spec.tensor_parallel_sizes
        }
        for shard_set in sets.values():
            tp = shard_set.tensor_parallel_size
            if tp > settings.max_gpus_per_job:
                # The operator fails this set without a Job, and patches nothing to load it.
                sys.stderr.write(
                    f"ShardedModel {name}: {reasons.TP_EXCEEDS_GPUS}: tensor-parallel size {tp} "
                    "needs more GPUs than one serialization Job may request "
                    f"({settings.max_gpus_per_job})\n"
                )
                refused = True
                continue
            job = jobs.JobInput(
                owner=owner, spec=spec, shard_set=shard_set, settings=settings, run=1
            )
            output += [jobs.build_verify_job(job), jobs.build_serialize_job(job)]
        in_namespace = [
            d
            for d in documents
            if (d.get("metadata") or {}).get("namespace", namespace) == namespace
        ]
        for problem in _missing_targets(spec, in_namespace):
            sys.stderr.write(f"ShardedModel {name}: {reasons.TARGET_NOT_FOUND}: {problem}\n")
            refused = True
        for spec_target, deployment in _matches(spec, in_namespace):
            shard_set = sets[spec.target_tp(spec_target)]
            if shard_set.tensor_parallel_size > settings.max_gpus_per_job:
                continue
            patched = patching.patch_deployment(
                deployment,
                patching.TargetInput(
                    owner=owner,
                    spec=spec,
                    shard_set=shard_set,
                    settings=settings,
                    container=spec_target.container,
                    allow_controller_owned=spec_target.allow_controller_owned,
                    # No status here: the version the serializer image's reference names.
                    shard_vllm_version=serializer_vllm_version(spec, settings),
                    allow_vllm_version_mismatch=spec_target.allow_vllm_version_mismatch,
                ),
            )
            deployment_name = (deployment.get("metadata") or {}).get("name")
            if isinstance(patched, patching.Refusal):
                sys.stderr.write(
                    f"Deployment {deployment_name}: {patched.reason}: {patched.message}\n"
                )
                refused = True
                continue
            if patched.overrides:
                sys.stderr.write(
                    f"Deployment {deployment_name}: {reasons.ARGS_OVERRIDDEN}: "
                    f"{patching.overrides_line(patched.overrides)}\n"
                )
            if patched.version_note:
                sys.stderr.write(f"Deployment {deployment_name}: {patched.version_note}\n")
            output.append(patched.deployment)
    sys.stdout.write(yaml.safe_dump_all(output, sort_keys=False, width=100))
    return 1 if refused else 0


def _matches(
    spec: models.ShardedModelSpec, documents: list[Manifest]
) -> Iterator[tuple[models.Target, Manifest]]:
    for spec_target in spec.targets:
        for document in documents:
            if document.get("kind") == "Deployment" and _selects(spec_target, document):
                yield spec_target, document


def _missing_targets(spec: models.ShardedModelSpec, documents: list[Manifest]) -> list[str]:
    """Why each target that matches no Deployment in the input is not found, as the operator
    would find it: it looks at Deployments only, so a StatefulSet of that name is no target."""
    problems: list[str] = []
    for spec_target in spec.targets:
        if any(t is spec_target for t, _ in _matches(spec, documents)):
            continue
        others = [
            f"{d.get('kind')} {(d.get('metadata') or {}).get('name')}"
            for d in documents
            if d.get("kind") not in ("Deployment", models.KIND) and _selects(spec_target, d)
        ]
        problems.append(
            f"{spec_target.label} not found in the input"
            + (
                f": {', '.join(others)} is not a Deployment, and preshard patches Deployments only"
                if others
                else ""
            )
        )
    return problems


def _selects(spec_target: models.Target, document: Manifest) -> bool:
    metadata = document.get("metadata") or {}
    if spec_target.name is not None:
        return bool(metadata.get("name") == spec_target.name)
    return spec_target.selector is not None and spec_target.selector.matches(
        metadata.get("labels") or {}
    )


def _load(path: Path) -> list[dict[str, Any]]:
    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    return [doc for doc in yaml.safe_load_all(text) if isinstance(doc, dict)]
