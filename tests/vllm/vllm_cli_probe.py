"""Parse command lines with vLLM's own `serve` argument parser, in one process.

Importing vLLM takes 15-30 s, so the tests start this module once with every question as JSON
on stdin and read every answer as JSON from stdout:

- `parse`: `[{"id", "entrypoint": "serve" | "api_server", "argv": [...]}]`, the arguments
  after the program. Each is parsed as `vllm serve` or the api_server module parses it, then
  turned into `EngineArgs` and a `LoadConfig`; the answer holds what decides the load.
- `prefixes`: option strings to resolve as argparse would (its abbreviation matching), each
  answered with the destination it selects, "unknown", "positional" or "ambiguous".

The serve parser's option strings come back too, by destination, for comparison with
preshard's table of the flags it reads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any

# vLLM picks its platform at import time; without this it cannot build EngineArgs on a host
# without a GPU ("Failed to infer device type").
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.common.cli_args import (
    make_arg_parser,
    validate_parsed_serve_args,
)
from vllm.utils.argparse_utils import FlexibleArgumentParser


def serve_parsers() -> tuple[FlexibleArgumentParser, FlexibleArgumentParser]:
    """The `vllm` parser with its `serve` subcommand, built as `vllm` builds it."""
    # vLLM leaves FlexibleArgumentParser.__init__ unannotated.
    top = FlexibleArgumentParser(description="vLLM CLI")  # type: ignore[no-untyped-call]
    subparsers = top.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve_parser = serve.subparser_init(subparsers)
    serve_parser.set_defaults(dispatch_function=serve.cmd)
    return top, serve_parser


def parse(entrypoint: str, argv: list[str]) -> argparse.Namespace:
    """The namespace `vllm serve` or `python -m vllm.entrypoints.openai.api_server` gets."""
    if entrypoint == "serve":
        top, _ = serve_parsers()
        namespace: argparse.Namespace = top.parse_args(["serve", *argv])
        ServeSubcommand().validate(namespace)
        # ServeSubcommand.cmd: a positional model takes precedence over --model.
        if getattr(namespace, "model_tag", None) is not None:
            namespace.model = namespace.model_tag
        return namespace
    plain = FlexibleArgumentParser(description="vLLM API server")  # type: ignore[no-untyped-call]
    parsed: argparse.Namespace = make_arg_parser(plain).parse_args(argv)
    validate_parsed_serve_args(parsed)
    return parsed


def load_settings(entrypoint: str, argv: list[str]) -> dict[str, Any]:
    """What the command line makes vLLM load, or why vLLM rejects it."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            namespace = parse(entrypoint, argv)
            engine_args = EngineArgs.from_cli_args(namespace)
            load_config = engine_args.create_load_config()
    except SystemExit:
        return {"ok": False, "error": " ".join(errors.getvalue().strip().splitlines()[-1:])}
    except Exception as error:  # noqa: BLE001 - any rejection by vLLM is the answer
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {
        "ok": True,
        "model": engine_args.model,
        "served_model_name": engine_args.served_model_name,
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "pipeline_parallel_size": engine_args.pipeline_parallel_size,
        "data_parallel_size": engine_args.data_parallel_size,
        "load_format": str(load_config.load_format),
        "model_loader_extra_config": load_config.model_loader_extra_config,
    }


def resolve(parser: argparse.ArgumentParser, option: str) -> str:
    """The destination argparse selects for a flag as written, abbreviations included."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            found: Any = parser._parse_optional(option)  # argparse's own lookup
    except SystemExit:
        return "ambiguous"
    if found is None:
        return "positional"
    # Python 3.12.7+ answers with a list of candidates, earlier versions with one tuple.
    first = found[0] if isinstance(found, list) else found
    action = first[0]
    return "unknown" if action is None else str(action.dest)


def option_strings(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Every registered option string, by destination."""
    by_dest: dict[str, list[str]] = {}
    for option, action in parser._option_string_actions.items():
        by_dest.setdefault(action.dest, []).append(option)
    return {dest: sorted(options) for dest, options in by_dest.items()}


def main() -> None:
    """Answer the questions on stdin."""
    questions = json.load(sys.stdin)
    _, serve_parser = serve_parsers()
    answers = {
        "parsed": {
            item["id"]: load_settings(item["entrypoint"], item["argv"])
            for item in questions.get("parse", [])
        },
        "resolved": {option: resolve(serve_parser, option) for option in questions["prefixes"]},
        "options": option_strings(serve_parser),
    }
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
