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


def example_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    """The README example's ShardedModel and Deployment, to change and write back."""
    resource = yaml.safe_load((ROOT / "examples" / "shardedmodel.yaml").read_text())
    deployment = yaml.safe_load((ROOT / "examples" / "vllm-deployment.yaml").read_text())
    return resource, deployment


def written(tmp_path: Path, *documents: dict[str, Any]) -> str:
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    return str(path)


def test_a_tp_size_larger_than_a_job_may_request_is_the_operators_refusal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PRESHARD_MAX_GPUS_PER_JOB", raising=False)
    resource, deployment = example_documents()
    resource["spec"]["tensorParallelSizes"] = [16, 2]
    resource["spec"]["targets"] = [
        {"name": "llama-vllm", "tensorParallelSize": 16},
    ]
    code, documents, err = render(capsys, written(tmp_path, resource, deployment))
    assert code == 1
    assert err == (
        "ShardedModel llama-3-1-8b: TPExceedsGPUs: tensor-parallel size 16 needs more GPUs than "
        "one serialization Job may request (8)\n"
    )
    # No Job for TP 16 and no patch to load it; TP 2 is made as usual.
    assert [
        (d["kind"], d["metadata"]["annotations"]["preshard.dev/tensor-parallel-size"])
        for d in documents
    ] == [
        ("Job", "2"),
        ("Job", "2"),
    ]


def test_a_target_missing_from_the_input_is_not_found(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, documents, err = render(capsys, EXAMPLE[0])
    assert code == 1
    assert err == (
        "ShardedModel llama-3-1-8b: TargetNotFound: Deployment llama-vllm not found in the input\n"
    )
    assert [d["kind"] for d in documents] == ["Job", "Job"]


def test_a_target_that_is_not_a_deployment_is_not_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    resource, deployment = example_documents()
    deployment["kind"] = "StatefulSet"
    code, documents, err = render(capsys, written(tmp_path, resource, deployment))
    assert code == 1
    assert err == (
        "ShardedModel llama-3-1-8b: TargetNotFound: Deployment llama-vllm not found in the "
        "input: StatefulSet llama-vllm is not a Deployment, and preshard patches Deployments "
        "only\n"
    )
    assert [d["kind"] for d in documents] == ["Job", "Job"]


def test_a_selector_that_matches_no_deployment_is_not_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    resource, deployment = example_documents()
    resource["spec"]["targets"] = [{"selector": {"matchLabels": {"tier": "serving"}}}]
    code, _, err = render(capsys, written(tmp_path, resource, deployment))
    assert code == 1
    assert err == (
        'ShardedModel llama-3-1-8b: TargetNotFound: Deployments selected by {"matchLabels":'
        '{"tier":"serving"}} not found in the input\n'
    )


def test_what_the_patch_replaces_of_the_users_is_printed_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    resource, deployment = example_documents()
    deployment["spec"]["template"]["spec"]["containers"][0]["args"] += [
        "--tensor-parallel-size",
        "1",
    ]
    code, documents, err = render(capsys, written(tmp_path, resource, deployment))
    assert code == 0
    assert err == (
        "Deployment llama-vllm: ArgsOverridden: changed in the vLLM command line: replaced "
        "--tensor-parallel-size 1 with 2 (the shard set's TP size)\n"
    )
    assert [d["kind"] for d in documents] == ["Job", "Job", "Deployment"]


def test_a_dtype_the_shards_do_not_hold_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    resource, deployment = example_documents()
    deployment["spec"]["template"]["spec"]["containers"][0]["args"] += ["--dtype", "half"]
    code, documents, err = render(capsys, written(tmp_path, resource, deployment))
    assert code == 1
    assert err.startswith(
        "Deployment llama-vllm: DtypeConflict: container vllm: --dtype half conflicts with the "
        "shards, which hold bfloat16 weights"
    )
    assert [d["kind"] for d in documents] == ["Job", "Job"]


def test_a_deployment_another_controller_owns_is_refused_unless_allowed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    resource, deployment = example_documents()
    deployment["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "serving.kserve.io/v1beta1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": "u",
            "controller": True,
        }
    ]
    code, _, err = render(capsys, written(tmp_path, resource, deployment))
    assert code == 1
    assert err.startswith(
        "Deployment llama-vllm: TargetManagedByController: Deployment llama-vllm is controlled "
        "by InferenceService llama"
    )
    resource["spec"]["targets"] = [{"name": "llama-vllm", "allowControllerOwned": True}]
    code, documents, err = render(capsys, written(tmp_path, resource, deployment))
    assert (code, err) == (0, "")
    assert [d["kind"] for d in documents] == ["Job", "Job", "Deployment"]
