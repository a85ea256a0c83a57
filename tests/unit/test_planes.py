"""The control plane stays light: the operator imports neither boto3 nor torch nor vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_operator_and_cli_import_no_data_plane_libraries() -> None:
    probe = (
        "import sys\n"
        "import preshard.cli, preshard.controller.handlers\n"
        "preshard.cli.build_parser()\n"
        "heavy = sorted(m for m in ('boto3', 'botocore', 'torch', 'tensorizer', 'vllm')"
        " if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ""


def test_the_data_plane_cli_imports_no_control_plane_library() -> None:
    """The serializer image (vLLM's) has neither kopf nor the Kubernetes client: `preshard
    serialize` there must not import them."""
    probe = (
        "import sys\n"
        "import preshard.cli\n"
        "preshard.cli.build_parser()\n"
        "control = ('kopf', 'kubernetes', 'prometheus_client')\n"
        "heavy = sorted(m for m in control if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ""
