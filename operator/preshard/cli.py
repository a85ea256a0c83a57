"""The one entrypoint: `preshard <subcommand>`.

The operator image runs `preshard run`; Jobs and init containers run the data-plane
subcommands. Heavy dependencies (boto3, torch, tensorizer, vLLM) are imported by the
subcommands that need them, so the operator image does not carry them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn, cast

from preshard import __version__
from preshard.contract.outcome import Command
from preshard.controller import cli as controller_cli
from preshard.dataplane import cli as dataplane_cli


class UsageError(Exception):
    """The command line does not parse."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises instead of exiting, so a data-plane run can still end
    with its outcome (a Job's pod reports bad flags like any other failure)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser: argparse.ArgumentParser = _Parser(
        prog="preshard",
        description=(
            "Pre-shard large language models for vLLM: a Kubernetes operator (`run`), "
            "the data-plane commands its Jobs run, and an offline preview (`render`)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"preshard {__version__}")
    subcommands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    controller_cli.register(subcommands)
    dataplane_cli.register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand; returns the process exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(words)
    except UsageError as error:
        command = words[0] if words else ""
        if command in dataplane_cli.DATAPLANE_COMMANDS:
            return dataplane_cli.report_usage_error(cast("Command", command), str(error))
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{error}\n")
        return 2
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
