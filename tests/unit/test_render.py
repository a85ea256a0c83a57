"""`preshard render`: what the operator would create, printed without a cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from preshard.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = [
    str(ROOT / "examples" / "shardedmodel.yaml"),
    str(ROOT / "examples" / "vllm-deployment.yaml"),
]


def render(
    capsys: pytest.CaptureFixture[str], *files: str
) -> tuple[int, list[dict[str, Any]], str]:
    code = main(["render", *[arg for path in files for arg in ("-f", path)]])
    out, err = capsys.readouterr()
    return code, [doc for doc in yaml.safe_load_all(out) if doc], err


def test_the_readme_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, documents, err = render(capsys, *EXAMPLE)
    assert (code, err) == (0, "")
    kinds = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert [k for k, _ in kinds] == ["Job", "Job", "Deployment"]
    assert kinds[0][1].endswith("-verify-1")
    assert kinds[1][1].endswith("-serialize-1")
    deployment = documents[2]
    vllm = deployment["spec"]["template"]["spec"]["containers"][0]
    args = vllm["args"]
    assert args[0] == "/var/run/preshard/model"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--served-model-name") + 1] == "meta-llama/Llama-3.1-8B-Instruct"
    extra = json.loads(args[args.index("--model-loader-extra-config") + 1])
    assert extra["tensorizer_uri"].endswith("/model-rank-%03d.tensors")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert deployment["spec"]["replicas"] == 2
    readme = (ROOT / "README.md").read_text()
    assert json.dumps(extra, sort_keys=True, separators=(",", ":")) in readme, (
        "README shows another render output: update it"
    )


def test_a_target_that_cannot_be_patched_is_named_with_its_reason(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    deployment = yaml.safe_load((ROOT / "examples" / "vllm-deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["/bin/sh", "-c"]
    container["args"] = ["pip install foo && vllm serve meta-llama/Llama-3.1-8B-Instruct"]
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment))
    code, documents, err = render(capsys, EXAMPLE[0], str(path))
    assert code == 1
    assert err.startswith("Deployment llama-vllm: UnsupportedCommand: container vllm: ")
    assert [d["kind"] for d in documents] == ["Job", "Job"]


def test_an_invalid_spec_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    resource = yaml.safe_load((ROOT / "examples" / "shardedmodel.yaml").read_text())
    resource["spec"]["tensorParallelSizes"] = [3]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(resource))
    code, documents, err = render(capsys, str(path))
    assert (code, documents) == (1, [])
    assert "InvalidSpec: spec.tensorParallelSizes.0" in err


def test_input_without_a_sharded_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = render(capsys, EXAMPLE[1])
    assert code == 2
    assert "no ShardedModel" in err
