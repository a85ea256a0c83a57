"""docs/performance.md quotes every benchmark figure as its result file holds it.

Each table of figures on that page is preceded by a paragraph that names its result files:

    Result file: `benchmarks/results/serialize.json`.
    Result files: run 1 `benchmarks/results/controller.json`, run 5 `benchmarks/results/...`.

(the second form where a column or a header names runs). The tests below read those tables,
look each figure up in the JSON the benchmark wrote (the schemas are those of
`benchmarks/*.py`) and compare it at the precision the page shows it: `12.4` stands for
anything from 12.35 to 12.45. A figure edited on the page, a table pasted into another
benchmark's section, a row or a table dropped, or a result file renamed fails here.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[2]
PAGE: Final = ROOT / "docs" / "performance.md"
MIB: Final = 1024 * 1024

CITATION: Final = re.compile(r"benchmarks/results/[\w.*-]+\.json")
CITED_PATTERN: Final = re.compile(r"`(benchmarks/results/[\w.*-]+\.json)`")
SOURCE: Final = re.compile(r"`(benchmarks/results/[\w.-]+\.json)`")
RUN_SOURCE: Final = re.compile(r"run (\d+) `(benchmarks/results/[\w.-]+\.json)`")
FIGURE: Final = re.compile(r"\d+(?:\.\d+)?")
SEPARATOR: Final = re.compile(r"\|(\s*:?-+:?\s*\|)+")

# The page's benchmark sections, and the `benchmark` their result files must name.
SECTIONS: Final = {
    "Making shards": "serialize",
    "Changing the TP size": "reshard",
    "Loading shards": "load",
    "Starting a model": "engine",
    "The controller at scale": "controller",
}
# Subsections whose every table must name its result file.
FIGURE_SUBSECTIONS: Final = ("Results", "Targets")


@dataclass(frozen=True)
class Table:
    """One Markdown table of the page, where it is, and the result files it names."""

    section: str
    subsection: str
    line: int
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    sources: tuple[str, ...] = ()
    runs: Mapping[int, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{PAGE.name} line {self.line} ({self.section})"

    @property
    def source(self) -> str:
        """The one result file of a table that names one."""
        assert len(self.sources) == 1, f"{self}: expected one result file, found {self.sources}"
        return self.sources[0]


def cells(line: str) -> tuple[str, ...]:
    """The cells of one Markdown table row."""
    return tuple(cell.strip() for cell in line.strip().strip("|").split("|"))


def blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """The page's blocks, each with the number of its first line: a heading, a fenced code
    block, or lines up to a blank one (a paragraph, a list, a table)."""
    block: list[str] = []
    start = 0
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and not line.startswith("```") and (not line.strip() or line.startswith("#")):
            if block:
                yield start, block
            block = []
            if line.startswith("#"):
                yield number, [line]
            continue
        if not block:
            start = number
        block.append(line)
    if block:
        yield start, block


def parse(text: str) -> tuple[list[Table], list[str]]:
    """Every table of the page with the result files named just above it, and what is wrong
    with those names (named but no table just below, a run without its file)."""
    tables: list[Table] = []
    problems: list[str] = []
    section = subsection = ""
    named: tuple[int, str] | None = None
    for number, block in blocks(text):
        first = block[0]
        is_table = len(block) > 1 and SEPARATOR.fullmatch(block[1].strip()) is not None
        if named is not None and not is_table:
            problems.append(f"line {named[0]}: result files named, but no table just below")
            named = None
        if first.startswith("## "):
            section, subsection = first[3:].strip(), ""
        elif first.startswith("### "):
            subsection = first[4:].strip()
        elif first.startswith(("Result file: ", "Result files: ")):
            named = (number, " ".join(block))
        elif is_table and first.startswith("|"):
            sources = tuple(SOURCE.findall(named[1])) if named else ()
            runs = {int(r): path for r, path in RUN_SOURCE.findall(named[1])} if named else {}
            if named and not sources:
                problems.append(f"line {named[0]}: no `benchmarks/results/...json` named")
            if named and runs and len(runs) != len(sources):
                problems.append(f"line {named[0]}: some result files lack their run")
            header, rows = cells(first), tuple(cells(line) for line in block[2:])
            tables.append(Table(section, subsection, number, header, rows, sources, runs))
            named = None
    if named is not None:
        problems.append(f"line {named[0]}: result files named, but no table just below")
    return tables, problems


@functools.cache
def page() -> tuple[list[Table], list[str]]:
    """The page, parsed once."""
    return parse(PAGE.read_text())


def figure_tables(section: str) -> list[Table]:
    """The tables of a section that name their result files, in the page's order."""
    return [t for t in page()[0] if t.section == section and t.sources]


@functools.cache
def document(path: str) -> dict[str, Any]:
    """A whole result file: `benchmark`, `machine`, `results`, ..."""
    loaded: dict[str, Any] = json.loads((ROOT / path).read_text())
    return loaded


def results(path: str) -> dict[str, Any]:
    """The `results` of a result file."""
    found: dict[str, Any] = document(path)["results"]
    return found


def agrees(shown: str, value: float) -> bool:
    """Whether `shown`, a figure as the page rounds it, is `value` rounded that way."""
    decimals = len(shown.partition(".")[2])
    return abs(float(shown) - value) <= 0.5 * 10.0**-decimals + 1e-9


def spread(values: Mapping[str, float]) -> tuple[float, ...]:
    """A median with its range; a constant shows as its median alone."""
    if values["min"] == values["max"] == values["median"]:
        return (values["median"],)
    return (values["median"], values["min"], values["max"])


def listing(numbers: Sequence[int]) -> str:
    """`1`, `1 and 2`, `1, 2 and 4`."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


class Check:
    """One table against its result files; collects every disagreement."""

    def __init__(self, table: Table, header: Sequence[str]) -> None:
        assert table.header == tuple(header), (
            f"{table}: the header is {list(table.header)}, the test knows {list(header)}"
        )
        self.table = table
        self.header = tuple(header)
        self.problems: list[str] = []
        self.shown: list[object] = []

    def rows(self) -> Iterator[dict[str, str]]:
        """Each row as its cells by column."""
        for row in self.table.rows:
            if len(row) != len(self.header):
                self.problems.append(f"{row[0]!r}: {len(row)} cells, not {len(self.header)}")
                continue
            yield dict(zip(self.header, row, strict=True))

    def figures(self, where: str, cell: str, values: Sequence[float]) -> None:
        """The figures of `cell` are `values`, in order, at the page's precision."""
        shown = FIGURE.findall(cell)
        if len(shown) != len(values) or not all(
            agrees(s, v) for s, v in zip(shown, values, strict=False)
        ):
            held = ", ".join(f"{v:g}" for v in values) or "nothing"
            self.problems.append(f"{where}: the page says {cell!r}, the result file {held}")

    def text(self, where: str, cell: str, expected: str) -> None:
        """A cell that is words, not figures."""
        if cell != expected:
            self.problems.append(f"{where}: the page says {cell!r}, the result file {expected!r}")

    def row(self, key: object, known: bool) -> bool:
        """Note a row the page shows; False (and a problem) for one no result file has."""
        if not known:
            self.problems.append(f"row {key!r}: no such entry in {', '.join(self.table.sources)}")
            return False
        self.shown.append(key)
        return True

    def done(self, expected: Iterable[object]) -> None:
        """Every entry of the result files has one row; then nothing may disagree."""
        repeated = [k for k, n in Counter(self.shown).items() if n > 1]
        missing = [k for k in expected if k not in self.shown]
        if repeated:
            self.problems.append(f"rows shown twice: {repeated}")
        if missing:
            self.problems.append(f"entries of the result file without a row: {missing}")
        assert self.problems == [], f"{self.table}:\n  " + "\n  ".join(self.problems)


# Making shards: benchmarks/serialize.py ---------------------------------------------------------

SERIALIZE_METHODS: Final = {
    "preshard": "preshard",
    "preshard, signed payloads": "preshard-signed",
    "A: boto3 `upload_file`": "boto3",
    "B: tensorizer to `s3://`": "tensorizer",
    "C: CRT transfer client": "crt",
}
TIMES: Final = "\N{MULTIPLICATION SIGN}"
LIMIT_LABEL: Final = re.compile(rf"limit \((\d+)(?: threads)? {TIMES} (\d+) MiB\)")
SERIALIZE_RATIOS: Final = {
    "preshard upload / limit": "preshard_upload_over_limit",
    "preshard / (engine + limit)": "preshard_over_engine_plus_limit",
    "preshard / B": "preshard_over_tensorizer",
    "preshard upload / A": "preshard_upload_over_boto3",
    "preshard upload / C": "preshard_upload_over_crt",
    "A / limit": "boto3_over_limit",
    "B upload / limit": "tensorizer_upload_over_limit",
    "C / limit": "crt_over_limit",
}


def serialize_methods(table: Table) -> None:
    """Medians and ranges per TP size and method (`results.methods`)."""
    check = Check(
        table,
        [
            "TP",
            "method",
            "engine s",
            "upload s (range)",
            "engine + upload s",
            "upload MB/s",
            "CPU s/GB here",
            "CPU s/GB server",
        ],
    )
    entries = {
        (e["tensor_parallel_size"], e["method"]): e for e in results(table.source)["methods"]
    }
    for row in check.rows():
        limit = LIMIT_LABEL.fullmatch(row["method"])
        key = (int(row["TP"]), "limit" if limit else SERIALIZE_METHODS.get(row["method"]))
        if not check.row(key, key in entries):
            continue
        entry, where = entries[key], f"TP {row['TP']}, {row['method']}"
        if limit:
            check.text(f"{where}, setting", f"{limit[1]}x{limit[2]}MiB", entry["setting"])
        engine = entry["engine_s"]["median"]
        check.figures(f"{where}, engine s", row["engine s"], [engine] if engine else [])
        check.figures(f"{where}, upload s", row["upload s (range)"], spread(entry["upload_s"]))
        check.figures(f"{where}, total", row["engine + upload s"], [entry["total_s"]["median"]])
        check.figures(f"{where}, MB/s", row["upload MB/s"], [entry["upload_mb_per_s"]])
        check.figures(f"{where}, CPU here", row["CPU s/GB here"], [entry["client_cpu_s_per_gb"]])
        check.figures(
            f"{where}, CPU server", row["CPU s/GB server"], [entry["server_cpu_s_per_gb"]]
        )
    check.done(set(entries))


def serialize_ratios(table: Table) -> None:
    """Ratios within each round (`results.ratios`)."""
    check = Check(table, ["TP", *SERIALIZE_RATIOS])
    entries = {e["tensor_parallel_size"]: e for e in results(table.source)["ratios"]}
    for row in check.rows():
        tp = int(row["TP"])
        if check.row(tp, tp in entries):
            for column, key in SERIALIZE_RATIOS.items():
                check.figures(f"TP {tp}, {column}", row[column], spread(entries[tp][key]))
    check.done(set(entries))


def serialize_targets(table: Table) -> None:
    """The targets, per TP size, and at which sizes they are met (`results.targets`)."""
    found = results(table.source)
    sizes = found["options"]["tensor_parallel_sizes"]
    goals = found["targets"]
    upload = goals["preshard_upload_within_limit"]
    boto3, faster = (
        goals["preshard_upload_faster_than_boto3"],
        goals["preshard_faster_than_tensorizer"],
    )
    labels: dict[str, tuple[dict[str, Any], Callable[[float], bool]]] = {
        f"preshard's upload within {upload['target']:g}{TIMES} of the limit": (
            upload,
            lambda value: value <= upload["target"],
        ),
        "preshard's upload faster than A (boto3 `upload_file`)": (
            boto3,
            lambda value: value < boto3["target"],
        ),
        "preshard's engine + upload faster than B (tensorizer to `s3://`)": (
            faster,
            lambda value: value < faster["target"],
        ),
    }
    check = Check(table, ["target", *(f"TP {tp}" for tp in sizes), "met"])
    for row in check.rows():
        if not check.row(row["target"], row["target"] in labels):
            continue
        goal, met = labels[row["target"]]
        values = {tp: goal["by_tensor_parallel_size"][str(tp)] for tp in sizes}
        for tp, value in values.items():
            check.figures(f"{row['target']}, TP {tp}", row[f"TP {tp}"], [value])
        yes = [tp for tp in sizes if met(values[tp])]
        no = [tp for tp in sizes if not met(values[tp])]
        expected = (
            "yes"
            if not no
            else "**no**"
            if not yes
            else f"at TP {listing(yes)}; **no** at TP {listing(no)}"
        )
        check.text(f"{row['target']}, met", row["met"], expected)
    check.done(set(labels))


# Changing the TP size: benchmarks/reshard.py ----------------------------------------------------

ReshardFigure = tuple[str, str, Callable[[dict[str, Any]], float], str]
RESHARD_ROWS: Final[tuple[ReshardFigure, ...]] = (
    ("`preshard reshard`, total", "reshard", lambda run: run["total_s"], "s"),
    ("of which the reshard", "reshard", lambda run: run["reshard_s"], "s"),
    ("its peak RSS", "reshard", lambda run: run["peak_rss_bytes"] / MIB, "MiB"),
    ("the reshard alone, peak RSS", "local", lambda run: run["peak_rss_bytes"] / MIB, "MiB"),
    ("`preshard serialize` at the target TP, total", "serialize", lambda run: run["total_s"], "s"),
    ("its peak RSS", "serialize", lambda run: run["peak_rss_bytes"] / MIB, "MiB"),
)


def reshard_pairs(table: Table) -> None:
    """Per pair N → M: the command, the reshard alone and a serialization (`results.runs`,
    the median over the rounds)."""
    found = results(table.source)
    pairs = [(n, m) for n, m in found["options"]["pairs"]]
    columns = [f"{n} → {m}" for n, m in pairs]
    check = Check(table, ["", *columns])

    def runs(method: str, source_tp: int, target_tp: int) -> list[dict[str, Any]]:
        return [
            run
            for run in found["runs"]
            if run["method"] == method
            and run["target_tp"] == target_tp
            and (method == "serialize" or run["source_tp"] == source_tp)
        ]

    for position, row in enumerate(check.rows()):
        if not check.row(position, position < len(RESHARD_ROWS)):
            continue
        label, method, figure, unit = RESHARD_ROWS[position]
        check.text(f"row {position + 1}", row[""], label)
        for column, (n, m) in zip(columns, pairs, strict=True):
            where, cell = f"{label}, {column}", row[column]
            value = statistics.median(figure(run) for run in runs(method, n, m))
            check.figures(where, cell, [value])
            if not cell.endswith(f" {unit}"):
                check.problems.append(f"{where}: {cell!r} is not in {unit}")
    check.done(range(len(RESHARD_ROWS)))


# Loading shards: benchmarks/load.py -------------------------------------------------------------


LOAD_SAME_STREAMS: Final = "speed / curl with as many streams"
LOAD_CPU: Final = {
    "CPU s/GB here": "here",
    "curl": "children",
    "server": "server",
    "total": "total",
}


def load_loads(table: Table) -> None:
    """Each load: seconds, GB/s, its ratio to the raw download, and then either its ratio to
    curl with as many streams (runs 1 and 2) or its CPU seconds per GB, by whom (run 3 on)
    (`results.loads`)."""
    extra = [LOAD_SAME_STREAMS] if LOAD_SAME_STREAMS in table.header else list(LOAD_CPU)
    check = Check(table, ["load", "seconds", "GB/s", "speed / raw download", *extra])
    entries = {e["load"]: e for e in results(table.source)["loads"]}
    for row in check.rows():
        # "raw download (1 stream)" is the load "raw download".
        name = re.sub(r" \([^)]*\)$", "", row["load"])
        if not check.row(name, name in entries):
            continue
        entry = entries[name]
        check.figures(f"{name}, seconds", row["seconds"], [entry["seconds"]["median"]])
        check.figures(f"{name}, GB/s", row["GB/s"], [entry["gb_per_s"]])
        raw = spread(entry["speed_over_raw"])
        check.figures(f"{name}, / raw", row["speed / raw download"], raw)
        if LOAD_SAME_STREAMS in extra:
            same = entry["speed_over_curl_same_streams"]
            check.figures(f"{name}, / curl", row[LOAD_SAME_STREAMS], spread(same) if same else [])
            continue
        for column, whom in LOAD_CPU.items():
            check.figures(f"{name}, {column}", row[column], [entry["cpu_s_per_gb"][whom]])
    check.done(set(entries))


# Starting a model: benchmarks/engine.py -------------------------------------------------------

ENGINE_FIGURES: Final = {
    "init container": "init_s",
    "/health": "health_s",
    "first completion": "first_completion_s",
    "pod to first completion": "pod_s",
    "vLLM weight load": "weights_s",
}
ENGINE_RATIOS: Final = {
    "raw download of the rank files, s": "raw_download_s",
    "to the first completion: patched / stock, local disk": "patched_pod_over_local_disk",
    "to the first completion: patched / stock, S3 download": "patched_pod_over_s3_download",
    "patched weight load speed / raw download": "patched_load_speed_over_raw_download",
}


def engine_starts(table: Table) -> None:
    """Medians of each start's figures (`results.starts`); `-` where a start has none."""
    check = Check(table, ["start", *ENGINE_FIGURES])
    starts = results(table.source)["starts"]
    for row in check.rows():
        if not check.row(row["start"], row["start"] in starts):
            continue
        start = starts[row["start"]]
        for column, key in ENGINE_FIGURES.items():
            medians = [start[key]["median"]] if key in start else []
            check.figures(f"{row['start']}, {column}", row[column], medians)
    check.done(set(starts))


def engine_ratios(table: Table) -> None:
    """The raw download and the two ratios, median (smallest-largest), paired within rounds."""
    check = Check(table, ["figure", "median (range)"])
    found = results(table.source)
    for row in check.rows():
        key = ENGINE_RATIOS.get(row["figure"])
        if check.row(row["figure"], key is not None) and key is not None:
            check.figures(row["figure"], row["median (range)"], spread(found[key]))
    check.done(ENGINE_RATIOS)


# The controller at scale: benchmarks/controller.py ----------------------------------------------

CONTROLLER_RUN_COLUMNS: Final[dict[str, Callable[[dict[str, Any]], float]]] = {
    "apply": lambda size: size["apply_s"],
    "Jobs created": lambda size: size["jobs_created_s"]["max"],
    "Jobs done": lambda size: size["jobs_complete_s"]["max"],
    "all Ready": lambda size: size["all_ready_s"],
    "settled": lambda size: size["settled_s"],
    "baseline": lambda size: size["baseline"]["all_complete_s"],
    "Ready/baseline": lambda size: size["ready_over_baseline"],
    "peak RSS MiB": lambda size: size["operator"]["peak_rss_mib"],
    "CPU s": lambda size: size["operator"]["cpu_s"]["converge"],
    "writes/SHM": lambda size: size["requests"]["operator_writes_per_shardedmodel"],
    "idle writes": lambda size: size["idle"]["operator_writes"],
}
# The two floors, from run 18 on: the Jobs alone, and the Jobs with the operator's patch of each
# Deployment until its rollout is done. A component's CPU seconds are shown for the baseline,
# the baseline with targets and the operator's run, in that order (`cluster_cpu_s`).
PHASES_CPU: Final[tuple[Callable[[dict[str, Any]], dict[str, float]], ...]] = (
    lambda size: size["baseline"]["cluster_cpu_s"],
    lambda size: size["baseline_with_targets"]["cluster_cpu_s"],
    lambda size: size["cluster_cpu_s"]["converge"],
)
CONTROLLER_FLOOR_COLUMNS: Final[dict[str, Callable[[dict[str, Any]], list[float]]]] = {
    "baseline": lambda size: [size["baseline"]["all_complete_s"]],
    "with targets": lambda size: [size["baseline_with_targets"]["all_complete_s"]],
    "all Ready": lambda size: [size["all_ready_s"]],
    "Ready/baseline": lambda size: [size["ready_over_baseline"]],
    "Ready/with targets": lambda size: [size["ready_over_baseline_with_targets"]],
    "operator CPU s": lambda size: [size["operator"]["cpu_s"]["converge"]],
    "kube-apiserver CPU s": lambda size: [cpu(size)["kube-apiserver"] for cpu in PHASES_CPU],
    "kube-controller-manager CPU s": lambda size: [
        cpu(size)["kube-controller-manager"] for cpu in PHASES_CPU
    ],
}
# The page's names of the operator's requests, and the audit log's.
CONTROLLER_REQUESTS: Final = {
    "PATCH `shardedmodels/status`": "PATCH shardedmodels.preshard.dev/status",
    "POST `events`": "POST events",
    "PATCH `shardedmodels` (kopf: finalizer; before run 7 also the last-handled configuration)": (
        "PATCH shardedmodels.preshard.dev"
    ),
    "POST `jobs`": "POST jobs.batch",
    "PATCH `deployments`": "PATCH deployments.apps",
}
WRITE_VERBS: Final = ("POST ", "PUT ", "PATCH ", "DELETE ")
REFUSED: Final = re.compile(r"(\d{3})(?: [A-Za-z]+)?: (\S+) / (\S+)")
# Target rows: the result file's `targets` key and the figure it judges.
CONTROLLER_TARGETS: Final[dict[str, tuple[str, Callable[[dict[str, Any]], float]]]] = {
    "1000 ShardedModels Ready within 5 minutes of apply": (
        "all_ready_s",
        lambda size: size["all_ready_s"],
    ),
    "operator peak RSS under 300 MiB": (
        "peak_rss_mib",
        lambda size: size["operator"]["peak_rss_mib"],
    ),
    "no writes once Ready (two idle minutes)": (
        "idle_writes",
        lambda size: size["idle"]["operator_writes"],
    ),
    "a handful (5) of writes per ShardedModel until Ready (our stricter reading)": (
        "writes_per_shardedmodel",
        lambda size: size["requests"]["operator_writes_per_shardedmodel"],
    ),
}


def controller_sizes(table: Table, run: int) -> dict[int, dict[str, Any]]:
    """One run's measurements by N."""
    return {size["size"]: size for size in results(table.runs[run])["sizes"]}


def controller_columns(
    table: Table, columns: Mapping[str, Callable[[dict[str, Any]], float | list[float]]]
) -> None:
    """A row per run and N, each column's figures from that run's measurements at that N."""
    check = Check(table, ["run", "N", *columns])
    expected = {(run, n) for run in table.runs for n in controller_sizes(table, run)}
    for row in check.rows():
        key = (int(row["run"]), int(row["N"]))
        if not check.row(key, key in expected):
            continue
        size = controller_sizes(table, key[0])[key[1]]
        for column, figure in columns.items():
            values = figure(size)
            shown = values if isinstance(values, list) else [values]
            check.figures(f"run {key[0]}, N={key[1]}, {column}", row[column], shown)
    check.done(expected)


def controller_runs(table: Table) -> None:
    """Every run at every N: times, memory, CPU and writes (`results.sizes`)."""
    controller_columns(table, CONTROLLER_RUN_COLUMNS)


def controller_requests(table: Table) -> None:
    """The operator's writes per ShardedModel, and those refused, by run and N
    (`requests.operator_per_shardedmodel`, `requests.operator_refused_per_shardedmodel`)."""
    sizes = {run: controller_sizes(table, run) for run in sorted(table.runs)}
    counted = [f"run {run}, N={n}" for run, by_n in sizes.items() for n in by_n]
    refused = {
        run: f"refused, run {run} ({' / '.join(f'N={n}' for n in by_n)})"
        for run, by_n in sizes.items()
    }
    check = Check(table, ["request", *counted, *refused.values()])
    writes = {
        request
        for by_n in sizes.values()
        for size in by_n.values()
        for request in size["requests"]["operator_per_shardedmodel"]
        if request.startswith(WRITE_VERBS)
    }
    for row in check.rows():
        request = CONTROLLER_REQUESTS.get(row["request"], row["request"])
        if not check.row(request, request in writes):
            continue
        for run, by_n in sizes.items():
            for n, size in by_n.items():
                sent = size["requests"]["operator_per_shardedmodel"].get(request, 0.0)
                check.figures(f"{request}, run {run}, N={n}", row[f"run {run}, N={n}"], [sent])
            codes = sorted(
                {
                    key.rpartition("(")[2].rstrip(")")
                    for size in by_n.values()
                    for key in size["requests"]["operator_refused_per_shardedmodel"]
                    if key.startswith(f"{request} (")
                }
            )
            where, cell = f"{request}, refused in run {run}", row[refused[run]]
            if not codes:
                if cell not in ("", "none"):
                    check.problems.append(f"{where}: the page says {cell!r}, none were refused")
                continue
            match = REFUSED.fullmatch(cell)
            if len(codes) > 1 or match is None:
                check.problems.append(f"{where}: {cell!r}, but refused with {codes}")
                continue
            check.text(f"{where}, status", match[1], codes[0])
            values = [
                size["requests"]["operator_refused_per_shardedmodel"].get(
                    f"{request} ({codes[0]})", 0.0
                )
                for size in by_n.values()
            ]
            check.figures(where, f"{match[2]} / {match[3]}", values)
    check.done(writes)


def controller_floors(table: Table) -> None:
    """The two floors of every run, Ready against each, and the CPU behind them."""
    controller_columns(table, CONTROLLER_FLOOR_COLUMNS)


CONTROLLER_APPLY_COLUMNS: Final[dict[str, Callable[[dict[str, Any]], float]]] = {
    "apply": lambda size: size["apply_s"],
    "apply alone": lambda size: size["apply_alone_s"],
    "peak RSS MiB": lambda size: size["operator"]["peak_rss_mib"],
    "Ready/baseline": lambda size: size["ready_over_baseline"],
    "Ready/with targets": lambda size: size["ready_over_baseline_with_targets"],
}


def controller_apply(table: Table) -> None:
    """The apply with the operator running and alone (`apply_alone_s`, from run 23 on)."""
    controller_columns(table, CONTROLLER_APPLY_COLUMNS)


CONTROLLER_RESTART_COLUMNS: Final[dict[str, Callable[[dict[str, Any]], float]]] = {
    "passed over all": lambda size: size["restart"]["caught_up_s"],
    "quiet after": lambda size: size["restart"]["settled_s"],
    "peak RSS MiB": lambda size: size["restart"]["peak_rss_mib"],
    "CPU s": lambda size: size["restart"]["cpu_s"],
    "passes/SHM": lambda size: size["restart"]["reconcile_passes_per_shardedmodel"],
    "requests": lambda size: size["restart"]["requests_total"],
    "writes": lambda size: size["restart"]["writes"],
    "Ready lost": lambda size: size["restart"]["ready_lost"],
}


def controller_restart(table: Table) -> None:
    """The operator started again over N Ready ShardedModels (`restart`, from run 24 on)."""
    controller_columns(table, CONTROLLER_RESTART_COLUMNS)


def controller_profile(table: Table) -> None:
    """The operator's CPU in Python by whose code ran (`operator_profile`): each owner's
    seconds and share of the samples, and all of them, in every profiled run."""
    owners = table.header[2:-1]
    for run in table.runs:
        for size in controller_sizes(table, run).values():
            recorded = list(size["operator_profile"]["by_owner"])
            assert list(owners) == recorded, f"{table}: the owners are {recorded}"

    def owner_figures(owner: str) -> Callable[[dict[str, Any]], list[float]]:
        def figures(size: dict[str, Any]) -> list[float]:
            held = size["operator_profile"]["by_owner"][owner]
            return [held["seconds"], 100 * held["share"]]

        return figures

    columns: dict[str, Callable[[dict[str, Any]], list[float]]] = {
        owner: owner_figures(owner) for owner in owners
    }
    columns["all"] = lambda size: [size["operator_profile"]["seconds"]]
    controller_columns(table, columns)


def target_column(header: str) -> tuple[int, list[int]]:
    """`N=1000 (run 6; runs 1 to 5)`: the N and the runs, in the order of the cells."""
    match = re.fullmatch(r"N=(\d+) \((.*)\)", header)
    assert match is not None, f"not a target column: {header!r}"
    runs: list[int] = []
    for part in re.split(r"[;,] ", match[2]):
        span = re.fullmatch(r"runs? (\d+)(?: to (\d+))?", part)
        assert span is not None, f"not a run or runs: {part!r} in {header!r}"
        runs.extend(range(int(span[1]), int(span[2] or span[1]) + 1))
    return int(match[1]), runs


def controller_targets(table: Table) -> None:
    """Each target's figure in every run it names, and whether every one of them meets it
    (`results.sizes[].targets`)."""
    columns = table.header[1:-1]
    check = Check(table, ["target", *columns, "met"])
    for row in check.rows():
        if not check.row(row["target"], row["target"] in CONTROLLER_TARGETS):
            continue
        key, figure = CONTROLLER_TARGETS[row["target"]]
        met: list[bool] = []
        for column in columns:
            n, runs = target_column(column)
            unnamed = [run for run in runs if run not in table.runs]
            assert unnamed == [], f"{table}: {column!r} names runs without a result file"
            shown = [controller_sizes(table, run)[n] for run in runs]
            values = [figure(size) for size in shown]
            met.extend(size["targets"][key]["met"] for size in shown)
            cell, where = row[column], f"{row['target']}, {column}"
            every = re.fullmatch(r"(\S+) in every run", cell)
            if every:
                for value in sorted(set(values)):
                    check.figures(f"{where}, every run", every[1], [value])
            else:
                check.figures(where, cell, values)
        verdict = "yes" if all(met) else "**no**"
        if not row["met"].startswith(verdict):
            check.problems.append(f"{row['target']}: met says {row['met']!r}, not {verdict}")
    check.done(set(CONTROLLER_TARGETS))


# The tables of each section, in the page's order -----------------------------------------------

EXPECTED: Final[dict[str, tuple[Callable[[Table], None], ...]]] = {
    "Making shards": (serialize_methods, serialize_ratios, serialize_targets),
    "Changing the TP size": (reshard_pairs, reshard_pairs),
    "Loading shards": (load_loads, load_loads, load_loads),
    "Starting a model": (engine_starts, engine_ratios, engine_starts, engine_ratios),
    "The controller at scale": (
        controller_runs,
        controller_requests,
        controller_targets,
        controller_floors,
        controller_floors,
        controller_profile,
        controller_apply,
        controller_restart,
        controller_restart,
        controller_restart,
    ),
}
CASES: Final = [
    pytest.param(section, position, checker, id=f"{SECTIONS[section]}-{checker.__name__}")
    for section, checkers in EXPECTED.items()
    for position, checker in enumerate(checkers)
]


@pytest.mark.parametrize(("section", "position", "checker"), CASES)
def test_table_figures_are_the_result_files(
    section: str, position: int, checker: Callable[[Table], None]
) -> None:
    tables = figure_tables(section)
    assert position < len(tables), (
        f"{section}: table {position + 1} or its result-file line is gone"
    )

    checker(tables[position])


def test_every_cited_result_file_exists() -> None:
    cited = sorted(set(CITATION.findall(PAGE.read_text())))
    missing = [path for path in cited if not list(ROOT.glob(path))]

    assert cited
    assert missing == [], f"{PAGE.name} cites result files that do not exist: {missing}"


def test_result_file_lines_are_each_followed_by_a_table() -> None:
    assert page()[1] == []


def test_each_section_has_its_tables_and_only_its_benchmarks_results() -> None:
    tables, _ = page()
    outside = [str(t) for t in tables if t.sources and t.section not in SECTIONS]
    assert outside == [], f"figure tables outside a benchmark's section: {outside}"
    for section, benchmark in SECTIONS.items():
        mine = figure_tables(section)
        assert len(mine) == len(EXPECTED[section]), (
            f"{section}: {len(mine)} tables name a result file, the test knows "
            f"{len(EXPECTED[section])}"
        )
        runs: dict[int, str] = {}
        for table in mine:
            for path in table.sources:
                named = document(path)["benchmark"]
                assert named == benchmark, f"{table}: {path} is a {named} result, not {benchmark}"
            for run, path in table.runs.items():
                assert runs.setdefault(run, path) == path, f"{table}: run {run} is {runs[run]}"


def test_every_table_of_results_and_targets_names_its_result_file() -> None:
    unnamed = [
        str(t)
        for t in page()[0]
        if t.section in SECTIONS and t.subsection in FIGURE_SUBSECTIONS and not t.sources
    ]

    assert unnamed == [], f"tables of figures with no `Result file:` line: {unnamed}"


def test_the_overview_names_each_sections_result_files() -> None:
    (overview,) = [t for t in page()[0] if t.header[:1] == ("benchmark",)]
    assert overview.header[-1] == "result file"
    patterns: dict[str, str] = {}
    for row in overview.rows:
        link = re.fullmatch(r"\[([^\]]+)\]\(#[^)]+\)", row[0])
        assert link is not None, f"an overview row without its section's link: {row}"
        match = CITED_PATTERN.fullmatch(row[-1])
        if match is not None:
            patterns[link[1]] = match[1]
    for section in SECTIONS:
        assert section in patterns, f"the overview names no result file for {section}"
        for table in figure_tables(section):
            stray = [p for p in table.sources if not fnmatch.fnmatch(p, patterns[section])]
            assert stray == [], f"{table}: {stray} do not match the overview's {patterns[section]}"


# The comparison itself --------------------------------------------------------------------------


def test_a_figure_agrees_at_the_precision_the_page_shows() -> None:
    assert agrees("12.4", 12.43)
    assert agrees("1.70", 1.695)
    assert agrees("123", 123.49)
    assert agrees("0", 0)
    assert not agrees("12.5", 12.43)
    assert not agrees("12.43", 12.4)
    assert not agrees("124", 123.4)


def test_an_edited_figure_or_a_pasted_table_fails() -> None:
    methods, *_ = figure_tables("Making shards")
    first, *rest = methods.rows
    edited = replace(methods, rows=((*first[:3], "99.9 (11.0 to 14.3)", *first[4:]), *rest))
    with pytest.raises(AssertionError, match=r"99\.9"):
        serialize_methods(edited)

    runs, *_ = figure_tables("The controller at scale")
    pasted = replace(runs, section="Making shards", sources=methods.sources, runs={})
    with pytest.raises(AssertionError, match="header"):
        serialize_methods(pasted)
