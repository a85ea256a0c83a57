"""The Dockerfile, read as text: Docker cannot run here, so its promises are checked by parsing."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def stages() -> dict[str, list[str]]:
    """Instructions of each build stage, by stage name, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    result: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = result.setdefault(match.group(2), [])
        current.append(line)
    return result


def instruction(stage: list[str], name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.split(None, 1)[0].upper() == name]


def test_two_targets() -> None:
    assert set(stages()) == {"operator", "serializer"}


@pytest.mark.parametrize("target", ["operator", "serializer"])
def test_runs_as_a_numeric_non_root_user_with_an_exec_form_entrypoint(target: str) -> None:
    stage = stages()[target]
    (user,) = instruction(stage, "USER")
    assert re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", user)
    (entrypoint,) = instruction(stage, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["preshard"]


def test_serializer_is_the_pinned_vllm_image() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = pyproject["project"]["optional-dependencies"]["vllm"]
    version = pin.split("==")[1]
    first = stages()["serializer"][0]
    assert first.split()[1] == f"vllm/vllm-openai:v{version}"
    install = " ".join(instruction(stages()["serializer"], "RUN"))
    assert "curl" in install
    assert "[dataplane]" in install


def test_operator_image_carries_the_s3_tools_but_not_the_data_plane() -> None:
    install = " ".join(instruction(stages()["operator"], "RUN"))
    assert '".[s3]"' in install
    assert "dataplane" not in install
    (command,) = instruction(stages()["operator"], "CMD")
    assert json.loads(command) == ["run"]


def test_tools_image_bundles_the_tensorizer_fetch_config_hands_to_vllm() -> None:
    stage = stages()["operator"]
    install = " ".join(" ".join(instruction(stage, "RUN")).split())
    (env,) = [e for e in instruction(stage, "ENV") if e.startswith("PRESHARD_TENSORIZER_BUNDLE=")]
    bundle = env.split("=", 1)[1]
    assert f"--no-deps --target {bundle} -r requirements/tensorizer-bundle.txt" in install
    pins = (ROOT / "requirements" / "tensorizer-bundle.txt").read_text()
    # The version vLLM's own `tensorizer` extra pins, which the serializer image installs.
    assert "tensorizer==2.10.1" in pins.splitlines()
