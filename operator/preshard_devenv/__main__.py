"""`python -m preshard_devenv up|down|status|build|tool-path|check-install`: the local environment.

    up [--state-dir DIR]     start a cluster and an S3 server (bucket `preshard`) in the
                             background, building the binaries first if needed
    down [--state-dir DIR]   stop what `up` started
    status [--state-dir DIR] show what runs
    build                    build and cache every binary; print their paths
    tool-path NAME           print one cached binary's path (kubectl, helm, ...), building it
    run-operator [--fast]    run the operator against the current kube context; without one,
                             start the local environment first, install the CRD, and run it
                             there with the test kubelet running the Jobs and the patched vLLM
                             for real (`make run`); `--fast` lets kwok complete the Jobs
                             instead (`make run-fast`)
    check-install [--site-packages DIR]
                             fail if two installed distributions claim the same file (what
                             `make install` ends with)

The state directory defaults to `.devenv/` in the current directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from preshard_devenv import background, binaries, demo, installcheck, realrun
from preshard_devenv.kubeconfig import api_client
from preshard_devenv.procs import DevEnvError


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _up(args: argparse.Namespace) -> int:
    state, started = background.up(args.state_dir, log=_err)
    if not started:
        print(f"the environment in {args.state_dir} is already up; reusing it")
    print("\n".join(background.status_lines(state)))
    print("\nPoint a shell at it:")
    print("\n".join(f"  {line}" for line in background.exports(state)))
    print(f"\nStop it with: python -m preshard_devenv down --state-dir {args.state_dir}")
    return 0


def _down(args: argparse.Namespace) -> int:
    if not background.down(args.state_dir, log=_err):
        print(f"nothing is running from {args.state_dir}")
        return 0
    print("stopped")
    return 0


def _status(args: argparse.Namespace) -> int:
    state = background.read_state(args.state_dir.resolve())
    if state is None:
        print(f"down (no state in {args.state_dir})")
        return 1
    print("\n".join(background.status_lines(state)))
    return 0 if all(p.alive() for p in state.processes) else 1


def _build(_: argparse.Namespace) -> int:
    for tool, path in sorted(binaries.ensure_all(log=_err).items()):
        print(f"{tool} {path}")
    return 0


def _run_operator(args: argparse.Namespace) -> int:
    if demo.has_kube_context():
        _err("using the current kube context (unset KUBECONFIG to run on a local cluster)")
        demo.require_crd(None)
        demo.exec_operator(None)
    if not args.fast:
        return realrun.run(args.state_dir.resolve(), log=_err)
    state, _ = background.up(args.state_dir, log=_err)
    kubeconfig = Path(state.kubeconfig)
    with api_client(kubeconfig) as api:
        demo.install_crd(api)
    example = demo.write_example(args.state_dir.resolve(), state)
    print("A local cluster with fake GPU nodes and an S3 server is running:")
    print("\n".join(f"  {line}" for line in background.status_lines(state)))
    print("\nIn another terminal, create a ShardedModel and watch it become Ready:")
    print("\n".join(f"  {line}" for line in background.exports(state)))
    print(f"  kubectl apply -f {example}")
    print("  kubectl get shm -w")
    print(
        "\nkwok plays the kubelet there: the Jobs complete without running, so this shows the"
        "\ncontroller's side. Stop the environment with `make dev-cluster-down`.\n",
        flush=True,
    )
    demo.exec_operator(kubeconfig)


def _tool_path(args: argparse.Namespace) -> int:
    print(binaries.tool_path(args.tool, log=_err))
    return 0


def _check_install(args: argparse.Namespace) -> int:
    ok, lines = installcheck.check(args.site_packages)
    print("\n".join(lines), file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the local environment's commands."""
    parser = argparse.ArgumentParser(
        prog="python -m preshard_devenv",
        description="A local Kubernetes control plane with fake GPU nodes, and an S3 server.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, handler, text in (
        ("up", _up, "start the cluster and the S3 server in the background"),
        ("down", _down, "stop what `up` started"),
        ("status", _status, "show what runs (exit code 1 if anything is down)"),
        (
            "run-operator",
            _run_operator,
            "run the operator on the current kube context, or on a local one started first",
        ),
    ):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument(
            "--state-dir",
            type=Path,
            default=Path(".devenv"),
            help="where state, logs and data live (default: .devenv)",
        )
        command.set_defaults(handler=handler)
        if name == "run-operator":
            command.add_argument(
                "--fast",
                action="store_true",
                help="on the local cluster, let kwok complete the Jobs (the controller's side "
                "only) instead of running vLLM for real",
            )
    build = commands.add_parser("build", help="build and cache every binary; print their paths")
    build.set_defaults(handler=_build)
    tool = commands.add_parser("tool-path", help="print a cached binary's path, building it")
    tool.add_argument("tool", choices=sorted(binaries.TOOLS), metavar="TOOL")
    tool.set_defaults(handler=_tool_path)
    text = "fail if two installed distributions claim the same file"
    check = commands.add_parser("check-install", help=text, description=text)
    check.add_argument(
        "--site-packages",
        type=Path,
        action="append",
        metavar="DIR",
        help="a site-packages directory to read (repeatable; default: this interpreter's)",
    )
    check.set_defaults(handler=_check_install)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a failed step prints its explanation, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except DevEnvError as error:
        _err(f"error: {error}")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
