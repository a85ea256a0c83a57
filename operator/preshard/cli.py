"""The one entrypoint: `preshard <subcommand>`.

The operator image runs `preshard run`; Jobs and init containers run the data-plane
subcommands. Heavy dependencies (boto3, torch, tensorizer, vLLM) are imported by the
subcommands that need them, so the operator image does not carry them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from preshard import __version__
from preshard.controller import cli as controller_cli
from preshard.dataplane import cli as dataplane_cli


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
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
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
