"""vLLM's own argument parser accepts every rewritten command line and loads the shard set.

Each command line the rewriter produces in `tests/unit/test_vllm_args.py` is parsed the way
vLLM 0.34 parses it (`vllm serve`'s subcommand parser, or the api_server module's parser), then
turned into `EngineArgs` and a `LoadConfig`: the load format must be tensorizer, the TP size
and model directory the shard set's, and the nested tensorizer config built from the flat
JSON. The parser's option table is also compared with the flags the rewriter reads.

vLLM is imported once, in one subprocess (`vllm_cli_probe`), for all questions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from preshard.builders.vllm_args import (
    VLLM_OPTION_STRINGS,
    RewrittenCommand,
    TensorizerLoad,
    UnsupportedCommandError,
    model_loader_extra_config,
    rewrite_vllm_command,
)
from tests.unit.test_vllm_args import FIXTURE_CASES, FixtureCase, rewritten_cases

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
# What the kubelet substitutes for `$(VAR)` references before vLLM sees them.
CONTAINER_ENV = {"MODEL_ID": "Qwen/Qwen3-8B", "PORT": "8000"}
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(word: str) -> str:
    """A word as the kubelet passes it on: defined `$(VAR)` references replaced."""
    return _REFERENCE.sub(lambda m: CONTAINER_ENV.get(m.group(1), m.group(0)), word)


def vllm_argv(command: list[str] | None, args: list[str] | None) -> tuple[str, list[str]]:
    """Which parser reads the command line, and the arguments after the program.

    Derived here on its own, not with the rewriter's code, so the two cannot share a mistake.
    """
    # The vllm-openai image's ENTRYPOINT is `vllm serve`.
    words = [expand(word) for word in [*(command or ["vllm", "serve"]), *(args or [])]]
    if posixpath.basename(words[0]) in {"sh", "bash"}:
        script = next(word for word in words[1:] if not word.startswith("-"))
        words = shlex.split(script)
        while words[0] == "exec" or "=" in words[0]:
            words = words[1:]
    if posixpath.basename(words[0]) == "vllm":
        return "serve", words[2:]
    module = words.index("-m") + 1
    if words[module] == "vllm.entrypoints.openai.api_server":
        return "api_server", words[module + 1 :]
    return "serve", words[module + 2 :]


def abbreviations() -> list[str]:
    """Every strict prefix of the flags the rewriter reads that argparse could expand."""
    read = {option for options in VLLM_OPTION_STRINGS.values() for option in options}
    prefixes: set[str] = set()
    for option in read:
        shortest = 3 if option.startswith("--") else 2
        prefixes.update(option[:length] for length in range(shortest, len(option)))
    return sorted(prefixes - read)


@pytest.fixture(scope="module")
def vllm_answers() -> dict[str, Any]:
    """vLLM's answers to every question of this module, from one subprocess."""
    parse = []
    for case_id, rewritten, _ in rewritten_cases():
        entrypoint, argv = vllm_argv(rewritten.command, rewritten.args)
        parse.append({"id": case_id, "entrypoint": entrypoint, "argv": argv})
    for case in FIXTURE_CASES:
        container = case.container_spec()
        entrypoint, argv = vllm_argv(container.get("command"), container.get("args"))
        parse.append({"id": f"original {case.file}", "entrypoint": entrypoint, "argv": argv})
    questions = {"parse": parse, "prefixes": abbreviations()}
    result = subprocess.run(
        [sys.executable, "-m", "tests.vllm.vllm_cli_probe"],
        input=json.dumps(questions),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"the vLLM probe failed:\n{result.stderr[-4000:]}")
    answers: dict[str, Any] = json.loads(result.stdout)
    return answers


@pytest.mark.parametrize(
    ("case_id", "rewritten", "load"), rewritten_cases(), ids=[c[0] for c in rewritten_cases()]
)
def test_vllm_loads_the_shard_set(
    vllm_answers: dict[str, Any], case_id: str, rewritten: RewrittenCommand, load: TensorizerLoad
) -> None:
    parsed = vllm_answers["parsed"][case_id]
    assert parsed["ok"], parsed["error"]
    assert parsed["load_format"] == "tensorizer"
    assert parsed["model"] == load.model_dir
    assert parsed["tensor_parallel_size"] == load.tensor_parallel_size
    assert parsed["pipeline_parallel_size"] == 1
    assert parsed["data_parallel_size"] == 1
    assert rewritten.served_model_name is not None
    assert parsed["served_model_name"][0] == expand(rewritten.served_model_name)
    flat = json.loads(model_loader_extra_config(load))
    assert parsed["model_loader_extra_config"] == {
        **flat,
        "tensorizer_config": {"tensorizer_dir": load.model_dir, **flat},
    }


@pytest.mark.parametrize("case", FIXTURE_CASES, ids=lambda c: c.file)
def test_vllm_accepts_the_original_manifests(
    vllm_answers: dict[str, Any], case: FixtureCase
) -> None:
    parsed = vllm_answers["parsed"][f"original {case.file}"]
    assert parsed["ok"], parsed["error"]
    assert parsed["load_format"] != "tensorizer"


def test_the_flags_the_rewriter_reads_are_all_spellings_vllm_registers(
    vllm_answers: dict[str, Any],
) -> None:
    registered = vllm_answers["options"]
    for dest, options in VLLM_OPTION_STRINGS.items():
        assert sorted(options) == registered[dest], dest


def test_no_other_vllm_flag_is_a_prefix_of_a_flag_the_rewriter_reads(
    vllm_answers: dict[str, Any],
) -> None:
    read = {option for options in VLLM_OPTION_STRINGS.values() for option in options}
    every_flag = {option for options in vllm_answers["options"].values() for option in options}
    shadowing = {
        flag
        for flag in every_flag - read
        for option in read
        if option.startswith(flag) and flag.startswith("--") == option.startswith("--")
    }
    assert not shadowing


def test_every_abbreviation_vllm_expands_to_a_flag_the_rewriter_reads_is_refused(
    vllm_answers: dict[str, Any],
) -> None:
    expanded = {
        prefix: dest
        for prefix, dest in vllm_answers["resolved"].items()
        if dest in VLLM_OPTION_STRINGS
    }
    assert "-t" in expanded, "argparse no longer expands abbreviations: revisit this test"
    load = TensorizerLoad("/var/run/preshard/model", 1, "s3://b/p/model.tensors", 8)
    for prefix in expanded:
        with pytest.raises(UnsupportedCommandError, match="abbreviation"):
            rewrite_vllm_command(["vllm", "serve", "m", prefix, "1"], None, load)
