"""The operator's Prometheus metrics: a small recorder the reconciler calls, and its endpoint.

The reconciler decides what happened (a Job started, a result read, a patch applied, Ready
reached) by comparing the plan with the status before it; this module only counts. Labels stay
few and bounded, and never carry a Secret, a URI, a message or an argument: Job kinds and
reasons are checked against the closed sets preshard defines (anything else is counted as
`Other`), and only the shard-set gauge names a ShardedModel, whose series go when it goes.
"""

from __future__ import annotations

import http
import re
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, get_args
from wsgiref.simple_server import WSGIServer

from kubernetes.client.exceptions import ApiException
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from preshard import __version__
from preshard.contract import reasons
from preshard.contract.outcome import Command, Outcome

# The metric names; Prometheus adds `_total` to counters and `_bucket`, `_sum` and `_count` to
# histograms in what it scrapes.
BUILD_INFO: Final = "preshard_build_info"
RECONCILE_PASSES: Final = "preshard_reconcile_passes"
RECONCILE_DURATION: Final = "preshard_reconcile_duration_seconds"
RECONCILE_ERRORS: Final = "preshard_reconcile_errors"
SHARD_SETS: Final = "preshard_shard_sets"
JOBS_STARTED: Final = "preshard_jobs_started"
JOBS_SUCCEEDED: Final = "preshard_jobs_succeeded"
JOBS_FAILED: Final = "preshard_jobs_failed"
DEPLOYMENT_PATCHES: Final = "preshard_deployment_patches"
VERIFICATIONS: Final = "preshard_verifications"
TIME_TO_READY: Final = "preshard_time_to_ready_seconds"
DATAPLANE_BYTES: Final = "preshard_dataplane_bytes"
DATAPLANE_DURATION: Final = "preshard_dataplane_duration_seconds"
DATAPLANE_THROUGHPUT: Final = "preshard_dataplane_throughput_bytes_per_second"

# Label values that are not one of preshard's own.
OTHER: Final = "Other"
UNKNOWN_KIND: Final = "unknown"
# The Job kinds: the data-plane commands a Job runs (the `preshard.dev/command` label).
KINDS: Final = frozenset(get_args(Command))
# Every reason preshard reports; a reason read from a pod is counted only if it is one of them.
REASONS: Final = frozenset(
    value for name, value in vars(reasons).items() if name.isupper() and isinstance(value, str)
)
# Kinds whose bytes are moved, not only listed: their bytes per second are a throughput.
MOVES_BYTES: Final = frozenset({"serialize", "reshard"})

# `check` of a verification: a probe for an existing set, the check of a set just written, or
# the periodic re-check of a verified one.
PROBE: Final = "probe"
VERIFY: Final = "verify"
REVERIFY: Final = "reverify"
CHECKS: Final = frozenset({PROBE, VERIFY, REVERIFY})
# `action` and `result` of a Deployment patch.
PATCH: Final = "patch"
RESTORE: Final = "restore"
APPLIED: Final = "applied"
CONFLICT: Final = "conflict"
NOT_FOUND: Final = "not_found"

RECONCILE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From a set found in storage (a minute) to a 70B model serialized and rolled out (hours).
READY_BUCKETS: Final = (10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 86400)
# Job run times: a verify (seconds) to a large serialization (hours).
DATAPLANE_BUCKETS: Final = (1, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200, 14400)
# 1 MB/s to 10 GB/s.
THROUGHPUT_BUCKETS: Final = (1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10)

SHUTDOWN_SECONDS: Final = 5.0
_WORD: Final = re.compile(r"[A-Za-z0-9]+")


def kind_label(kind: str) -> str:
    """A Job kind as a label value: one of `KINDS`, else `unknown`."""
    return kind if kind in KINDS else UNKNOWN_KIND


def reason_label(reason: str) -> str:
    """A reason as a label value: one of preshard's reasons, else `Other`. Reasons come from
    pods' termination messages, which anything in the pod can write."""
    return reason if reason in REASONS else OTHER


def error_reason(error: BaseException) -> str:
    """Why a reconcile pass failed, as a bounded word: the HTTP status of an API error in
    CamelCase (`Forbidden`, `TooManyRequests`), else the exception's class name. Never its
    message, which may quote an object."""
    if isinstance(error, ApiException) and error.status:
        try:
            phrase = http.HTTPStatus(int(error.status)).phrase
        except ValueError:
            return "ApiException"
        return "".join(word[:1].upper() + word[1:] for word in _WORD.findall(phrase))
    return type(error).__name__


@dataclass
class ReconcilePass:
    """One reconcile pass being counted."""

    error: str | None = None
    """Why the pass failed: the exception it raised, or a failure it handled and returned from
    (a spec that does not parse)."""


@dataclass
class MetricsServer:
    """The `/metrics` endpoint, served from a thread of its own."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen, when asked for port 0)."""
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=SHUTDOWN_SECONDS)


class Metrics:
    """Every metric the operator exports, in one registry.

    Thread-safe: kopf runs reconcile passes of different ShardedModels in parallel threads.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._stages: dict[tuple[str, str], frozenset[str]] = {}
        Gauge(
            BUILD_INFO,
            "The running preshard version; always 1.",
            ["version"],
            registry=self.registry,
        ).labels(__version__).set(1)
        self._passes = Counter(
            RECONCILE_PASSES, "Reconcile passes of ShardedModels.", registry=self.registry
        )
        self._duration = Histogram(
            RECONCILE_DURATION,
            "Time one reconcile pass took: plan, Job and Deployment writes, status write.",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self._errors = Counter(
            RECONCILE_ERRORS,
            "Reconcile passes that failed (an API error, a bug) or found a spec that does not "
            "parse (InvalidSpec), by reason.",
            ["reason"],
            registry=self.registry,
        )
        self._shard_sets = Gauge(
            SHARD_SETS,
            "Shard sets in each ShardedModel's status, by stage.",
            ["namespace", "shardedmodel", "stage"],
            registry=self.registry,
        )
        self._jobs_started = Counter(
            JOBS_STARTED, "Jobs the operator created, by kind.", ["kind"], registry=self.registry
        )
        self._jobs_succeeded = Counter(
            JOBS_SUCCEEDED,
            "Jobs whose result the operator read: succeeded, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self._jobs_failed = Counter(
            JOBS_FAILED,
            "Jobs whose result the operator read: failed, by kind and reason.",
            ["kind", "reason"],
            registry=self.registry,
        )
        self._patches = Counter(
            DEPLOYMENT_PATCHES,
            "Deployment patches sent (patch: point at a shard set; restore: the original "
            "template), by whether the API server applied them.",
            ["action", "result"],
            registry=self.registry,
        )
        self._verifications = Counter(
            VERIFICATIONS,
            "Results of verify Jobs, by check (probe, verify, reverify) and reason.",
            ["check", "reason"],
            registry=self.registry,
        )
        self._time_to_ready = Histogram(
            TIME_TO_READY,
            "Time from a ShardedModel's creation to its first Ready=True.",
            buckets=READY_BUCKETS,
            registry=self.registry,
        )
        self._bytes = Counter(
            DATAPLANE_BYTES,
            "Bytes succeeded Jobs report: written (serialize, reshard), checked (verify) or "
            "removed (delete), by kind.",
            ["kind"],
            registry=self.registry,
        )
        self._seconds = Histogram(
            DATAPLANE_DURATION,
            "Run time succeeded Jobs report for their command, by kind.",
            ["kind"],
            buckets=DATAPLANE_BUCKETS,
            registry=self.registry,
        )
        self._throughput = Histogram(
            DATAPLANE_THROUGHPUT,
            "Bytes per second of succeeded Jobs that write a shard set, by kind.",
            ["kind"],
            buckets=THROUGHPUT_BUCKETS,
            registry=self.registry,
        )

    @classmethod
    def for_process(cls) -> Metrics:
        """The operator's metrics with the process's own (CPU, memory, open files, garbage
        collection), without the `_created` series that double what a scrape returns."""
        disable_created_metrics()  # type: ignore[no-untyped-call] # untyped in the library
        registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        return cls(registry)

    def serve(self, port: int, address: str = "0.0.0.0") -> MetricsServer:  # noqa: S104
        """Serve the registry at `http://address:port/metrics`; `OSError` if the port is taken.
        Every address by default: Prometheus scrapes the pod's IP."""
        server, thread = start_http_server(port, addr=address, registry=self.registry)
        return MetricsServer(server, thread)

    @contextmanager
    def reconcile_pass(self) -> Iterator[ReconcilePass]:
        """Count and time one pass; one that raises is counted as an error by its reason."""
        started = time.monotonic()
        counted = ReconcilePass()
        try:
            yield counted
        except Exception as error:
            counted.error = error_reason(error)
            raise
        finally:
            self._passes.inc()
            self._duration.observe(time.monotonic() - started)
            if counted.error is not None:
                self._errors.labels(counted.error).inc()

    def shard_sets(self, namespace: str, name: str, stages: Iterable[str]) -> None:
        """Set a ShardedModel's shard sets by stage; stages it no longer has are removed."""
        counts = Tally(stages)
        key = (namespace, name)
        with self._lock:
            for stage in self._stages.get(key, frozenset()) - counts.keys():
                self._shard_sets.remove(namespace, name, stage)
            for stage, count in counts.items():
                self._shard_sets.labels(namespace, name, stage).set(count)
            if counts:
                self._stages[key] = frozenset(counts)
            else:
                self._stages.pop(key, None)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a ShardedModel's series: it is gone, or going."""
        self.shard_sets(namespace, name, ())

    def job_started(self, kind: str) -> None:
        """A Job was created."""
        self._jobs_started.labels(kind_label(kind)).inc()

    def job_finished(self, kind: str, outcome: Outcome) -> None:
        """A finished Job's result was read: count it, and what it reports moving. Call once
        per Job."""
        kind = kind_label(kind)
        if not outcome.ok:
            self._jobs_failed.labels(kind, reason_label(outcome.reason)).inc()
            return
        self._jobs_succeeded.labels(kind).inc()
        size, seconds = outcome.total_bytes, outcome.seconds
        if size is not None and size >= 0:
            self._bytes.labels(kind).inc(size)
        if seconds is not None and seconds >= 0:
            self._seconds.labels(kind).observe(seconds)
        if kind in MOVES_BYTES and size and seconds:
            self._throughput.labels(kind).observe(size / seconds)

    def verification(self, check: str, reason: str) -> None:
        """A verify Job's result was read: `check` says which, `reason` what it found."""
        self._verifications.labels(check if check in CHECKS else VERIFY, reason_label(reason)).inc()

    def deployment_patch(self, action: str, result: str) -> None:
        """A Deployment patch or restore was sent, and applied or refused."""
        self._patches.labels(action, result).inc()

    def ready(self, seconds: float) -> None:
        """A ShardedModel became Ready for the first time, `seconds` after its creation."""
        self._time_to_ready.observe(max(0.0, seconds))

    def sample_names(self) -> frozenset[str]:
        """Every sample name a scrape of this registry can return (without `_created`)."""
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count", ""),
        }
        return frozenset(
            family.name + suffix
            for family in self.registry.collect()
            for suffix in suffixes.get(family.type, ("",))
        )
