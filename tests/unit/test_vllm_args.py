"""The vLLM command-line rewriter, checked by exact equality for every form it accepts and a
precise refusal for every form it must not guess at.

The tables here are also parsed by vLLM's own argument parser in
`tests/vllm/test_vllm_args_parser.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from preshard.builders.vllm_args import (
    RewrittenCommand,
    TensorizerLoad,
    UnsupportedCommandError,
    is_vllm_command,
    is_vllm_openai_image,
    model_loader_extra_config,
    rewrite_vllm_command,
)
from preshard.contract import reasons

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deployments"
API_SERVER = "vllm.entrypoints.openai.api_server"
# The listen address the real-world manifests give vLLM; only compared here, never bound.
ANY_HOST = "0.0.0.0"  # noqa: S104

MODEL_DIR = "/var/run/preshard/model"
URI = "s3://models/shards/3f9a1c2e07b4d5a6/model-rank-%03d.tensors"
ENDPOINT = "https://s3.eu-central-1.example.com"
LOAD = TensorizerLoad(
    model_dir=MODEL_DIR,
    tensor_parallel_size=2,
    tensorizer_uri=URI,
    num_readers=8,
    s3_endpoint=ENDPOINT,
)
EXTRA = (
    '{"num_readers":8,"s3_endpoint":"https://s3.eu-central-1.example.com",'
    '"tensorizer_uri":"s3://models/shards/3f9a1c2e07b4d5a6/model-rank-%03d.tensors"}'
)
# What every rewrite adds or replaces, in the order it appends the missing ones.
TAIL = ["--tensor-parallel-size", "2", "--load-format", "tensorizer"]
TAIL += ["--model-loader-extra-config", EXTRA]
SHELL_TAIL = (
    f"--tensor-parallel-size 2 --load-format tensorizer --model-loader-extra-config '{EXTRA}'"
)

# Another shard set: another TP size, URI, reader count and model directory.
OTHER_LOAD = TensorizerLoad(
    model_dir="/models/preshard",
    tensor_parallel_size=4,
    tensorizer_uri="s3://other/prefix/9d8c7b6a/model-rank-%03d.tensors",
    num_readers=4,
    s3_endpoint="http://minio.storage:9000",
)


@dataclass(frozen=True)
class RewriteCase:
    """A container's command line and what rewriting it for `load` must give."""

    id: str
    command: list[str] | None
    args: list[str] | None
    expected_command: list[str] | None
    expected_args: list[str] | None
    served: str
    load: TensorizerLoad = LOAD
    overrides: tuple[str, ...] = ()
    """What the rewrite reports it replaced of the user's."""

    def rewrite(self, load: TensorizerLoad | None = None) -> RewrittenCommand:
        return rewrite_vllm_command(self.command, self.args, load or self.load)


def serve(*args: str) -> list[str]:
    return ["vllm", "serve", *args]


REWRITE_CASES: list[RewriteCase] = [
    RewriteCase(
        "serve-positional",
        serve("meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"),
        None,
        serve(
            MODEL_DIR, "--port", "8000", "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct"
        )
        + TAIL,
        None,
        "meta-llama/Llama-3.1-8B-Instruct",
    ),
    RewriteCase(
        "serve-full-path",
        ["/usr/local/bin/vllm", "serve", "Qwen/Qwen3-8B"],
        None,
        ["/usr/local/bin/vllm", "serve", MODEL_DIR, "--served-model-name", "Qwen/Qwen3-8B", *TAIL],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "serve-split-between-command-and-args",
        ["vllm", "serve"],
        ["meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"],
        ["vllm", "serve"],
        [
            MODEL_DIR,
            "--port",
            "8000",
            "--served-model-name",
            "meta-llama/Llama-3.1-8B-Instruct",
            *TAIL,
        ],
        "meta-llama/Llama-3.1-8B-Instruct",
    ),
    RewriteCase(
        "serve-program-in-command-subcommand-in-args",
        ["vllm"],
        ["serve", "Qwen/Qwen3-8B", "--enforce-eager"],
        ["vllm"],
        ["serve", MODEL_DIR, "--enforce-eager", "--served-model-name", "Qwen/Qwen3-8B", *TAIL],
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "serve-model-option",
        serve("--port", "8000", "--model", "Qwen/Qwen3-8B", "--enforce-eager"),
        None,
        [
            *serve("--port", "8000", "--model", MODEL_DIR, "--enforce-eager"),
            "--served-model-name",
            "Qwen/Qwen3-8B",
            *TAIL,
        ],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "serve-model-option-with-equals",
        serve("--model=Qwen/Qwen3-8B", "--max-model-len", "8192"),
        None,
        [
            *serve(f"--model={MODEL_DIR}", "--max-model-len", "8192"),
            "--served-model-name",
            "Qwen/Qwen3-8B",
            *TAIL,
        ],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "cli-main-module",
        ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-8B"],
        None,
        [
            "python3",
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            MODEL_DIR,
            "--served-model-name",
            "Qwen/Qwen3-8B",
            *TAIL,
        ],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "api-server-python3",
        ["python3", "-m", API_SERVER, "--model", "mistralai/Mistral-7B-Instruct-v0.3"],
        ["--host", ANY_HOST],
        ["python3", "-m", API_SERVER, "--model", MODEL_DIR],
        ["--host", ANY_HOST, "--served-model-name", "mistralai/Mistral-7B-Instruct-v0.3", *TAIL],
        "mistralai/Mistral-7B-Instruct-v0.3",
    ),
    RewriteCase(
        "api-server-python",
        ["python", "-m", API_SERVER],
        ["--model=/mnt/models", "--served-model-name=granite", "--port=8080"],
        ["python", "-m", API_SERVER],
        [f"--model={MODEL_DIR}", "--served-model-name=granite", "--port=8080", *TAIL],
        "granite",
    ),
    RewriteCase(
        "api-server-full-path-with-python-options",
        ["/usr/bin/python3", "-u", "-m", API_SERVER, "--model", "m"],
        None,
        [
            "/usr/bin/python3",
            "-u",
            "-m",
            API_SERVER,
            "--model",
            MODEL_DIR,
            "--served-model-name",
            "m",
            *TAIL,
        ],
        None,
        "m",
    ),
    RewriteCase(
        "image-entrypoint-positional-model",
        None,
        ["Qwen/Qwen3-8B", "--max-model-len", "8192"],
        None,
        [MODEL_DIR, "--max-model-len", "8192", "--served-model-name", "Qwen/Qwen3-8B", *TAIL],
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "image-entrypoint-model-option",
        None,
        ["--model", "Qwen/Qwen3-0.6B", "--gpu-memory-utilization", "0.95"],
        None,
        [
            "--model",
            MODEL_DIR,
            "--gpu-memory-utilization",
            "0.95",
            "--served-model-name",
            "Qwen/Qwen3-0.6B",
            *TAIL,
        ],
        "Qwen/Qwen3-0.6B",
    ),
    RewriteCase(
        "shell-string-in-command",
        ["/bin/sh", "-c", "vllm serve Qwen/Qwen3-8B --port 8000"],
        None,
        [
            "/bin/sh",
            "-c",
            f"vllm serve {MODEL_DIR} --port 8000 --served-model-name Qwen/Qwen3-8B {SHELL_TAIL}",
        ],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "shell-string-in-args",
        ["/bin/sh", "-c"],
        ["vllm serve Qwen/Qwen3-8B"],
        ["/bin/sh", "-c"],
        [f"vllm serve {MODEL_DIR} --served-model-name Qwen/Qwen3-8B {SHELL_TAIL}"],
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "shell-with-option-in-args",
        ["sh"],
        ["-c", "vllm serve Qwen/Qwen3-8B"],
        ["sh"],
        ["-c", f"vllm serve {MODEL_DIR} --served-model-name Qwen/Qwen3-8B {SHELL_TAIL}"],
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "bash-with-single-leading-exec",
        ["bash", "-c", "exec vllm serve Qwen/Qwen3-8B --max-model-len 4096"],
        None,
        [
            "bash",
            "-c",
            f"exec vllm serve {MODEL_DIR} --max-model-len 4096 "
            f"--served-model-name Qwen/Qwen3-8B {SHELL_TAIL}",
        ],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "bash-login-api-server",
        ["/bin/bash", "-lc"],
        ["python3 -m vllm.entrypoints.openai.api_server --model m --port 8080"],
        ["/bin/bash", "-lc"],
        [
            f"python3 -m vllm.entrypoints.openai.api_server --model {MODEL_DIR} --port 8080 "
            f"--served-model-name m {SHELL_TAIL}"
        ],
        "m",
    ),
    RewriteCase(
        "shell-quoting-continuations-and-assignments",
        ["/bin/sh", "-c"],
        [
            "HF_HUB_OFFLINE=1 VLLM_LOGGING_PREFIX=\"[vllm] \" vllm serve 'my org/model' \\\n"
            "  --chat-template '/templates/{chat}.jinja' \\\n"
            '  --served-model-name "my model"\n'
        ],
        ["/bin/sh", "-c"],
        [
            f"HF_HUB_OFFLINE=1 VLLM_LOGGING_PREFIX='[vllm] ' vllm serve {MODEL_DIR} "
            "--chat-template '/templates/{chat}.jinja' --served-model-name 'my model' "
            f"{SHELL_TAIL}"
        ],
        "my model",
    ),
    RewriteCase(
        "shell-arguments-after-the-string-are-kept",
        ["bash", "-c", "vllm serve Qwen/Qwen3-8B", "bash"],
        None,
        [
            "bash",
            "-c",
            f"vllm serve {MODEL_DIR} --served-model-name Qwen/Qwen3-8B {SHELL_TAIL}",
            "bash",
        ],
        None,
        "Qwen/Qwen3-8B",
    ),
    RewriteCase(
        "versioned-python",
        ["python3.12", "-m", API_SERVER, "--model", "m"],
        None,
        ["python3.12", "-m", API_SERVER, "--model", MODEL_DIR, "--served-model-name", "m", *TAIL],
        None,
        "m",
    ),
    RewriteCase(
        "flag-and-value-split-across-command-and-args",
        serve("Qwen/Qwen3-8B", "--tensor-parallel-size"),
        ["8", "--port", "8000"],
        serve(MODEL_DIR, "--tensor-parallel-size"),
        ["2", "--port", "8000", "--served-model-name", "Qwen/Qwen3-8B", *TAIL[2:]],
        "Qwen/Qwen3-8B",
        overrides=("replaced --tensor-parallel-size 8 with 2 (the shard set's TP size)",),
    ),
    RewriteCase(
        "kubernetes-variable-references-are-kept",
        serve("$(MODEL_ID)", "--port", "$(PORT)"),
        None,
        serve(MODEL_DIR, "--port", "$(PORT)", "--served-model-name", "$(MODEL_ID)", *TAIL),
        None,
        "$(MODEL_ID)",
    ),
    RewriteCase(
        "served-model-name-kept",
        serve("Qwen/Qwen3-8B", "--served-model-name", "qwen", "--port", "8000"),
        None,
        serve(MODEL_DIR, "--served-model-name", "qwen", "--port", "8000", *TAIL),
        None,
        "qwen",
    ),
    RewriteCase(
        "served-model-name-with-several-names",
        serve("Qwen/Qwen3-8B", "--served_model_name", "qwen", "qwen3", "--port", "8000"),
        None,
        serve(MODEL_DIR, "--served_model_name", "qwen", "qwen3", "--port", "8000", *TAIL),
        None,
        "qwen",
    ),
    RewriteCase(
        "every-tensor-parallel-spelling-collapses-to-one",
        serve("m", "-tp", "8", "--enforce-eager", "--tensor_parallel_size=4", "-tp=1"),
        None,
        [
            *serve(MODEL_DIR, "--tensor-parallel-size", "2", "--enforce-eager"),
            "--served-model-name",
            "m",
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            EXTRA,
        ],
        None,
        "m",
        overrides=("replaced -tp 1 with 2 (the shard set's TP size)",),
    ),
    RewriteCase(
        "existing-load-format-and-extra-config-are-replaced-in-place",
        serve(
            "m", "--load_format=runai_streamer", "--model-loader-extra-config", '{"num_readers": 1}'
        ),
        ["--port", "8000"],
        serve(MODEL_DIR, "--load-format", "tensorizer", "--model-loader-extra-config", EXTRA),
        ["--port", "8000", "--served-model-name", "m", "--tensor-parallel-size", "2"],
        "m",
        overrides=(
            "replaced --load_format runai_streamer with tensorizer",
            "--model-loader-extra-config: replaced your num_readers with preshard's settings",
        ),
    ),
    RewriteCase(
        "dotted-extra-config-keys-are-replaced",
        serve("m", "--model-loader-extra-config.num_readers", "2", "--dtype", "bfloat16"),
        ["--model_loader_extra_config.tensorizer_uri=s3://old/model-rank-%03d.tensors"],
        serve(MODEL_DIR, "--model-loader-extra-config", EXTRA, "--dtype", "bfloat16"),
        ["--served-model-name", "m", "--tensor-parallel-size", "2", "--load-format", "tensorizer"],
        "m",
        overrides=(
            "--model-loader-extra-config: replaced your num_readers, tensorizer_uri with "
            "preshard's settings",
        ),
    ),
    RewriteCase(
        "single-parallelism-and-disabled-expert-parallel-are-accepted",
        serve("m", "-pp", "1", "--data-parallel-size=1", "--nnodes", "1", "-pcp", "1"),
        ["--disable-expert-parallel", "--seed", "-1"],
        serve(MODEL_DIR, "-pp", "1", "--data-parallel-size=1", "--nnodes", "1", "-pcp", "1"),
        ["--disable-expert-parallel", "--seed", "-1", "--served-model-name", "m", *TAIL],
        "m",
    ),
    RewriteCase(
        "plain-http-endpoint-stays-out-of-the-json",
        serve("m"),
        None,
        [
            *serve(MODEL_DIR, "--served-model-name", "m", "--tensor-parallel-size", "4"),
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            '{"num_readers":4,'
            '"tensorizer_uri":"s3://other/prefix/9d8c7b6a/model-rank-%03d.tensors"}',
        ],
        None,
        "m",
        load=dataclasses.replace(OTHER_LOAD, model_dir=MODEL_DIR),
    ),
    RewriteCase(
        "encrypted-shard-set-with-hash-checks",
        serve("m"),
        None,
        [
            *serve(MODEL_DIR, "--served-model-name", "m", "--tensor-parallel-size", "1"),
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            '{"encryption_keyfile":"/var/run/preshard/key/encryption.key","num_readers":8,'
            '"tensorizer_uri":"s3://models/shards/k/model.tensors","verify_hash":true}',
        ],
        None,
        "m",
        load=TensorizerLoad(
            model_dir=MODEL_DIR,
            tensor_parallel_size=1,
            tensorizer_uri="s3://models/shards/k/model.tensors",
            num_readers=8,
            encryption_keyfile="/var/run/preshard/key/encryption.key",
            verify_hash=True,
        ),
    ),
]


@dataclass(frozen=True)
class FixtureCase:
    """A real-world manifest, the container to rewrite, and the expected result."""

    file: str
    container: str
    expected_command: list[str] | None
    expected_args: list[str] | None
    served: str
    overrides: tuple[str, ...] = ()

    def container_spec(self) -> dict[str, Any]:
        return fixture_container(self.file, self.container)

    def rewrite(self, load: TensorizerLoad = LOAD) -> RewrittenCommand:
        spec = self.container_spec()
        return rewrite_vllm_command(spec.get("command"), spec.get("args"), load)


def fixture_container(file: str, name: str) -> dict[str, Any]:
    """One container of a fixture manifest (Deployment, Pod or LeaderWorkerSet leader)."""
    manifest = yaml.safe_load((FIXTURES / file).read_text())
    spec = manifest["spec"]
    if manifest["kind"] == "LeaderWorkerSet":
        pod_spec = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    else:
        pod_spec = spec["template"]["spec"] if "template" in spec else spec
    containers: list[dict[str, Any]] = pod_spec["containers"]
    return next(c for c in containers if c["name"] == name)


FIXTURE_CASES: list[FixtureCase] = [
    FixtureCase(
        "vllm-docs-k8s-cpu.yaml",
        "vllm",
        ["/bin/sh", "-c"],
        [
            f"vllm serve {MODEL_DIR} --served-model-name meta-llama/Llama-3.2-1B-Instruct "
            f"{SHELL_TAIL}"
        ],
        "meta-llama/Llama-3.2-1B-Instruct",
    ),
    FixtureCase(
        "vllm-docs-k8s-nvidia.yaml",
        "mistral-7b",
        ["/bin/sh", "-c"],
        [
            f"vllm serve {MODEL_DIR} --trust-remote-code --enable-chunked-prefill "
            "--max_num_batched_tokens 1024 --served-model-name mistralai/Mistral-7B-Instruct-v0.3 "
            f"{SHELL_TAIL}"
        ],
        "mistralai/Mistral-7B-Instruct-v0.3",
    ),
    FixtureCase(
        "vllm-docs-k8s-amd.yaml",
        "mistral-7b",
        ["/bin/sh", "-c"],
        [
            f"vllm serve {MODEL_DIR} --port 8000 --trust-remote-code --enable-chunked-prefill "
            "--max_num_batched_tokens 1024 --served-model-name mistralai/Mistral-7B-v0.3 "
            f"{SHELL_TAIL}"
        ],
        "mistralai/Mistral-7B-v0.3",
    ),
    FixtureCase(
        "production-stack-vllm.yaml",
        "vllm",
        [
            *serve(MODEL_DIR, "--host", ANY_HOST, "--port", "8000", "--no-enable-prefix-caching"),
            *["--max-model-len", "8192", "--dtype", "bfloat16", "--tensor-parallel-size", "2"],
            *["--gpu_memory_utilization", "0.9", "--enforce-eager"],
            *["--served-model-name", "Qwen/Qwen2.5-7B-Instruct", "--load-format", "tensorizer"],
            *["--model-loader-extra-config", EXTRA],
        ],
        None,
        "Qwen/Qwen2.5-7B-Instruct",
    ),
    FixtureCase(
        "kserve-odh-vllm-cuda.yaml",
        "kserve-container",
        ["python", "-m", API_SERVER],
        ["--port=8080", f"--model={MODEL_DIR}", "--served-model-name=granite-8b-instruct", *TAIL],
        "granite-8b-instruct",
    ),
    FixtureCase(
        "kubeai-vllm-pod.yaml",
        "server",
        ["python3", "-m", API_SERVER],
        [
            f"--model={MODEL_DIR}",
            "--served-model-name=llama-3.1-70b-instruct-fp8-h100",
            "--max-model-len=65536",
            "--max-num-batched-token=65536",
            "--max-num-seqs=1024",
            "--gpu-memory-utilization=0.9",
            "--tensor-parallel-size",
            "2",
            "--enable-prefix-caching",
            "--disable-log-requests",
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            EXTRA,
        ],
        "llama-3.1-70b-instruct-fp8-h100",
    ),
    FixtureCase(
        "vllm-openai-args-only.yaml",
        "vllm",
        None,
        ["--model", MODEL_DIR, "--served-model-name", "Qwen/Qwen3-0.6B", *TAIL],
        "Qwen/Qwen3-0.6B",
    ),
]


@pytest.mark.parametrize("case", REWRITE_CASES, ids=lambda c: c.id)
def test_rewrite(case: RewriteCase) -> None:
    assert case.rewrite() == RewrittenCommand(
        command=case.expected_command,
        args=case.expected_args,
        served_model_name=case.served,
        overrides=case.overrides,
    )


@pytest.mark.parametrize("case", FIXTURE_CASES, ids=lambda c: c.file)
def test_rewrite_real_world_manifests(case: FixtureCase) -> None:
    assert case.rewrite() == RewrittenCommand(
        command=case.expected_command,
        args=case.expected_args,
        served_model_name=case.served,
        overrides=case.overrides,
    )


def command_line(rewritten: RewrittenCommand) -> tuple[Any, ...]:
    """What a rewrite writes, without what it reports."""
    return rewritten.command, rewritten.args, rewritten.served_model_name


ALL_ACCEPTED: list[tuple[str, list[str] | None, list[str] | None, TensorizerLoad]] = [
    (c.id, c.command, c.args, c.load) for c in REWRITE_CASES
] + [
    (c.file, c.container_spec().get("command"), c.container_spec().get("args"), LOAD)
    for c in FIXTURE_CASES
]


@pytest.mark.parametrize(("command", "args", "load"), [c[1:] for c in ALL_ACCEPTED])
def test_rewriting_twice_with_the_same_load_changes_nothing(
    command: list[str] | None, args: list[str] | None, load: TensorizerLoad
) -> None:
    once = rewrite_vllm_command(command, args, load)
    assert command_line(rewrite_vllm_command(once.command, once.args, load)) == command_line(once)


@pytest.mark.parametrize(("command", "args", "load"), [c[1:] for c in ALL_ACCEPTED])
def test_rewriting_for_another_shard_set_equals_rewriting_the_original(
    command: list[str] | None, args: list[str] | None, load: TensorizerLoad
) -> None:
    once = rewrite_vllm_command(command, args, load)
    again = rewrite_vllm_command(once.command, once.args, OTHER_LOAD)
    assert command_line(again) == command_line(rewrite_vllm_command(command, args, OTHER_LOAD))
    assert command_line(again) != command_line(once)


SPELLINGS: list[tuple[list[str], list[str]]] = [
    (["--tensor-parallel-size", "8"], ["--tensor-parallel-size", "2"]),
    (["--tensor-parallel-size=8"], ["--tensor-parallel-size", "2"]),
    (["-tp", "8"], ["--tensor-parallel-size", "2"]),
    (["-tp=8"], ["--tensor-parallel-size", "2"]),
    (["--tensor_parallel_size", "8"], ["--tensor-parallel-size", "2"]),
    (["--tensor-parallel_size=8"], ["--tensor-parallel-size", "2"]),
    (["--load-format", "safetensors"], ["--load-format", "tensorizer"]),
    (["--load_format=auto"], ["--load-format", "tensorizer"]),
    (["--model-loader-extra-config", "{}"], ["--model-loader-extra-config", EXTRA]),
    (["--model_loader_extra_config={}"], ["--model-loader-extra-config", EXTRA]),
    (["--model-loader-extra-config.num_readers", "4"], ["--model-loader-extra-config", EXTRA]),
    (["--model-loader-extra-config.num_readers=4"], ["--model-loader-extra-config", EXTRA]),
]


@pytest.mark.parametrize(("written", "rewritten"), SPELLINGS, ids=" ".join)
def test_every_spelling_vllm_accepts_is_replaced_where_it_stands(
    written: list[str], rewritten: list[str]
) -> None:
    result = rewrite_vllm_command(
        serve("Qwen/Qwen3-8B", "--dtype", "bfloat16", *written, "--port", "8000"), None, LOAD
    )
    assert result.command is not None
    assert result.command[:7] == serve(MODEL_DIR, "--dtype", "bfloat16", *rewritten)
    assert result.command[7:9] == ["--port", "8000"]
    flags = [word for word in result.command if word.startswith("-")]
    assert len(flags) == len(set(flags)), "a flag was duplicated"


def test_expert_parallelism_is_accepted_without_tensor_parallelism() -> None:
    load = TensorizerLoad(MODEL_DIR, 1, "s3://b/p/model.tensors", 8)
    result = rewrite_vllm_command(serve("m", "--enable-expert-parallel"), None, load)
    assert result.command is not None
    assert result.command[:4] == serve(MODEL_DIR, "--enable-expert-parallel")


@dataclass(frozen=True)
class Refusal:
    """A command line that must be refused, and the words the reason must contain."""

    id: str
    command: list[str] | None
    args: list[str] | None
    says: str


def shell(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


REFUSALS: list[Refusal] = [
    Refusal("nothing-to-run", None, None, "no model found"),
    Refusal("other-program", ["text-generation-launcher", "--model-id", "m"], None, "does not"),
    Refusal("python-script", ["python3", "serve.py", "--model", "m"], None, "does not start"),
    Refusal("other-vllm-subcommand", ["vllm", "bench", "serve", "--model", "m"], None, "does not"),
    Refusal("other-python-module", ["python", "-m", "vllm.entrypoints.api_server"], None, "not"),
    Refusal("shell-script-file", ["bash", "/scripts/start.sh"], None, "without -c"),
    Refusal("shell-without-string", ["/bin/sh", "-c"], None, "no command string"),
    Refusal("shell-other-program", shell("python3 app.py"), None, "does not start"),
    Refusal("semicolon", shell("pip install foo; vllm serve m"), None, "`;`"),
    Refusal("and", shell("nvidia-smi && vllm serve m"), None, "`&&`"),
    Refusal("or", shell("vllm serve m || sleep 3600"), None, "`||`"),
    Refusal("pipe", shell("vllm serve m | tee /tmp/log"), None, "pipe"),
    Refusal("command-substitution", shell("vllm serve $(cat /model-id)"), None, "`$(`"),
    Refusal("kubernetes-reference-in-shell", shell("vllm serve $(MODEL)"), None, "`$(`"),
    Refusal("backticks", shell("vllm serve `cat /model-id`"), None, "backticks"),
    Refusal("parameter-expansion", shell("vllm serve $MODEL"), None, "parameter expansion"),
    Refusal("braced-expansion", shell('vllm serve "${MODEL}"'), None, "parameter expansion"),
    Refusal("escaped-dollar", shell('vllm serve "\\$MODEL"'), None, "escaped expansion"),
    Refusal("redirect-out", shell("vllm serve m > /tmp/log"), None, "redirection `>`"),
    Refusal("redirect-in", shell("vllm serve m < /dev/null"), None, "redirection `<`"),
    Refusal("background", shell("vllm serve m &"), None, "`&`"),
    Refusal("here-doc", shell("cat <<EOF\nx\nEOF"), None, "here-document"),
    Refusal("two-lines", shell("cd /models\nvllm serve m"), None, "several lines"),
    Refusal("subshell", shell("(vllm serve m)"), None, "subshell"),
    Refusal("glob", shell("vllm serve /models/*"), None, "glob"),
    Refusal("brace-expansion", shell("vllm serve m --port {8000,8001}"), None, "brace"),
    Refusal("tilde", shell("vllm serve ~/models/m"), None, "tilde"),
    Refusal("comment", shell("vllm serve m # the model"), None, "comment"),
    Refusal("unterminated-quote", shell("vllm serve 'm"), None, "unterminated quote"),
    Refusal("trailing-backslash", shell("vllm serve m \\"), None, "trailing backslash"),
    Refusal("exec-chain", shell("exec exec vllm serve m"), None, "exec exec"),
    Refusal("empty-shell-string", shell("  \n "), None, "empty"),
    Refusal("pipeline-parallel", serve("m", "--pipeline-parallel-size", "2"), None, "is 2"),
    Refusal("pipeline-parallel-short", serve("m", "-pp=4"), None, "-pp is 4"),
    Refusal(
        "pipeline-parallel-underscores", serve("m", "--pipeline_parallel_size", "2"), None, "2"
    ),
    Refusal("pipeline-parallel-variable", serve("m", "-pp", "$(PP)"), None, "not a number"),
    Refusal("data-parallel", serve("m", "--data-parallel-size", "2"), None, "data parallelism"),
    Refusal("data-parallel-short", serve("m", "-dp", "4"), None, "Deployment replicas"),
    Refusal("context-parallel", serve("m", "-pcp", "2"), None, "context parallelism"),
    Refusal("several-nodes", serve("m", "--nnodes", "2"), None, "across nodes"),
    Refusal("headless", serve("m", "--headless"), None, "--headless"),
    Refusal("expert-parallel", serve("m", "--enable-expert-parallel"), None, "whole experts"),
    Refusal("expert-parallel-short", serve("m", "-ep"), None, "whole experts"),
    Refusal("config-file", serve("m", "--config", "/etc/vllm/config.yaml"), None, "--config"),
    Refusal("config-file-equals", serve("--config=/etc/vllm.yaml"), None, "cannot see"),
    Refusal("abbreviated-tp", serve("m", "--tensor-parallel", "4"), None, "abbreviation"),
    Refusal("abbreviated-short-tp", serve("m", "-t", "4"), None, "-t is an abbreviation"),
    Refusal("abbreviated-load-format", serve("m", "--load-form", "auto"), None, "abbreviation"),
    Refusal("abbreviated-served-name", serve("m", "--served", "x"), None, "abbreviation"),
    Refusal("abbreviated-extra-config", serve("m", "--model-loader", "{}"), None, "abbreviation"),
    Refusal("abbreviated-model", serve("--mod", "m"), None, "--mod is an abbreviation"),
    Refusal("abbreviated-underscores", serve("m", "--tensor_parallel", "4"), None, "abbreviation"),
    Refusal("dotted-tp", serve("m", "--tensor-parallel-size.x", "2"), None, "`.key`"),
    Refusal(
        "dotted-extra-config-without-value",
        serve("m", "--model-loader-extra-config.a"),
        None,
        "no value",
    ),
    Refusal("model-twice", serve("a", "--model", "b"), None, "both"),
    Refusal("model-option-twice", serve("--model", "a", "--model", "b"), None, "more than once"),
    Refusal("empty-model", serve("--model="), None, "--model is empty"),
    Refusal("serve-without-model", serve("--port", "8000"), None, "first argument after"),
    Refusal(
        "api-server-without-model",
        ["python3", "-m", API_SERVER],
        ["--port", "8000"],
        "with --model",
    ),
    Refusal("api-server-positional", ["python3", "-m", API_SERVER, "m"], None, "ignores"),
    Refusal("args-repeat-serve", None, ["serve", "m"], "repeat `serve`"),
    Refusal("flag-without-value", serve("m", "--tensor-parallel-size"), None, "has no value"),
    Refusal("flag-followed-by-flag", serve("m", "--load-format", "--port", "1"), None, "no value"),
    Refusal(
        "served-name-without-value", serve("m", "--served-model-name", "-tp", "2"), None, "no value"
    ),
    Refusal("empty-served-name", serve("m", "--served-model-name="), None, "empty"),
    Refusal("flag-with-value-that-takes-none", serve("m", "--headless=1"), None, "takes no value"),
    Refusal("end-of-options", serve("m", "--", "--port"), None, "`--`"),
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.id)
def test_refusals(refusal: Refusal) -> None:
    with pytest.raises(UnsupportedCommandError) as caught:
        rewrite_vllm_command(refusal.command, refusal.args, LOAD)
    error = caught.value
    assert error.reason == reasons.UNSUPPORTED_COMMAND
    assert refusal.says in error.message
    assert str(error) == error.message
    assert "\n" not in error.message


@dataclass(frozen=True)
class FixtureRefusal:
    file: str
    container: str
    says: str


FIXTURE_REFUSALS = [
    FixtureRefusal("kserve-vllmserver.yaml", "kserve-container", "parameter expansion"),
    FixtureRefusal("lws-vllm-leader.yaml", "vllm-leader", "command substitution"),
]


@pytest.mark.parametrize("refusal", FIXTURE_REFUSALS, ids=lambda r: r.file)
def test_refusals_of_real_world_manifests(refusal: FixtureRefusal) -> None:
    container = fixture_container(refusal.file, refusal.container)
    with pytest.raises(UnsupportedCommandError, match=refusal.says):
        rewrite_vllm_command(container.get("command"), container.get("args"), LOAD)


@pytest.mark.parametrize(
    ("image", "args"),
    [
        ("busybox", ["sleep", "infinity"]),
        ("docker.io/library/busybox:1.37", ["sleep", "infinity"]),
        ("envoyproxy/envoy:v1.31", ["-c", "/etc/envoy/envoy.yaml"]),
        ("rocm/vllm:rocm6.2_mi300_ubuntu20.04_py3.9_vllm_0.6.4", ["mistralai/Mistral-7B-v0.3"]),
        ("vllm/vllm-openai-rocm:v0.34.0", ["--model", "m"]),
        ("", ["--model", "m"]),
    ],
)
def test_args_alone_are_refused_on_images_whose_entrypoint_is_unknown(
    image: str, args: list[str]
) -> None:
    no_command: tuple[list[str] | None, ...] = (None, [])
    for command in no_command:
        with pytest.raises(UnsupportedCommandError) as caught:
            rewrite_vllm_command(command, args, LOAD, image=image)
        assert caught.value.reason == reasons.UNSUPPORTED_COMMAND
        assert caught.value.message == (
            f"the container sets only args, so it runs the entrypoint of its image {image!r}, "
            "which preshard cannot see (it knows only the vllm-openai image's, `vllm serve`); "
            "set command, e.g. [vllm, serve], if it starts the vLLM server"
        )


@pytest.mark.parametrize(
    "image",
    [None, "vllm/vllm-openai:v0.34.0", "registry.example.com/mirror/vllm/vllm-openai:latest"],
)
def test_args_alone_on_the_vllm_openai_image_run_vllm_serve(image: str | None) -> None:
    rewritten = rewrite_vllm_command(None, ["m", "--port", "8000"], LOAD, image=image)
    assert rewritten == RewrittenCommand(
        command=None,
        args=[MODEL_DIR, "--port", "8000", "--served-model-name", "m", *TAIL],
        served_model_name="m",
    )


def test_a_command_makes_the_image_irrelevant() -> None:
    rewritten = rewrite_vllm_command(["vllm", "serve"], ["m"], LOAD, image="rocm/vllm:latest")
    assert rewritten.args == [MODEL_DIR, "--served-model-name", "m", *TAIL]


def test_refusals_never_repeat_the_command_line() -> None:
    secret = "sk-0123456789abcdef"
    for command in (
        shell(f"HF_TOKEN={secret} vllm serve m --api-key {secret}; sleep 1"),
        serve("m", "--api-key", secret, "-pp", "2"),
        serve("m", "--api-key", secret, "--config", "c.yaml"),
        ["python3", "serve.py", "--api-key", secret],
    ):
        with pytest.raises(UnsupportedCommandError) as caught:
            rewrite_vllm_command(command, None, LOAD)
        assert secret not in caught.value.message
        assert secret not in str(caught.value)


@pytest.mark.parametrize(("command", "args", "load"), [c[1:] for c in ALL_ACCEPTED])
def test_every_rewritable_command_is_recognised(
    command: list[str] | None, args: list[str] | None, load: TensorizerLoad
) -> None:
    assert is_vllm_command(command, args, image="docker.io/vllm/vllm-openai:v0.34.0")


@pytest.mark.parametrize("refusal", FIXTURE_REFUSALS, ids=lambda r: r.file)
def test_vllm_in_a_complex_shell_string_is_recognised(refusal: FixtureRefusal) -> None:
    container = fixture_container(refusal.file, refusal.container)
    assert is_vllm_command(container.get("command"), container.get("args"))


@pytest.mark.parametrize(
    ("command", "args", "image"),
    [
        (["envoy", "-c", "/etc/envoy/envoy.yaml"], None, "envoyproxy/envoy:v1.31"),
        (["python3", "proxy.py"], ["--port", "8080"], "python:3.12"),
        (["/bin/sh", "-c", "sleep infinity"], None, "busybox"),
        (["bash", "/start.sh"], None, "vllm/vllm-openai:v0.34.0"),
        (["vllm", "bench", "serve"], None, "vllm/vllm-openai:v0.34.0"),
        (None, ["--model", "m"], "ghcr.io/example/sidecar:1"),
        (None, ["--model", "m"], None),
    ],
)
def test_other_containers_are_not_taken_for_vllm(
    command: list[str] | None, args: list[str] | None, image: str | None
) -> None:
    assert not is_vllm_command(command, args, image=image)


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("vllm/vllm-openai", True),
        ("vllm/vllm-openai:v0.34.0", True),
        ("docker.io/vllm/vllm-openai:latest", True),
        ("registry.example.com:5000/mirror/vllm/vllm-openai@sha256:" + "0" * 64, True),
        ("rocm/vllm:rocm6.2_mi300_ubuntu20.04_py3.9_vllm_0.6.4", False),
        ("vllm/vllm-openai-rocm:v0.34.0", False),
        ("quay.io/modh/vllm:rhoai-2.24-cuda", False),
    ],
)
def test_vllm_openai_image_names(image: str, expected: bool) -> None:
    assert is_vllm_openai_image(image) is expected


@pytest.mark.parametrize(
    ("endpoint", "in_json"),
    [
        ("https://s3.example.com", True),
        ("HTTPS://s3.example.com", True),
        ("http://minio.storage:9000", False),
        ("s3.example.com", False),
        (None, False),
    ],
)
def test_only_https_endpoints_go_into_the_json(endpoint: str | None, in_json: bool) -> None:
    load = dataclasses.replace(LOAD, s3_endpoint=endpoint)
    assert ('"s3_endpoint"' in model_loader_extra_config(load)) is in_json


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"model_dir": "model"}, "absolute"),
        ({"tensor_parallel_size": 0}, "at least 1"),
        ({"num_readers": 0}, "at least 1"),
        ({"tensorizer_uri": "s3://models/shards/k/model.tensors"}, "rank template"),
        ({"tensorizer_uri": "s3://models/shards/k/model-rank-%d.tensors"}, "rank template"),
        ({"tensor_parallel_size": 1}, "opens tensorizer_uri as written"),
    ],
)
def test_invalid_loads_are_rejected(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        dataclasses.replace(LOAD, **changes)


def test_fixtures_name_their_source() -> None:
    files = sorted(FIXTURES.glob("*.yaml"))
    assert len(files) >= 8
    for file in files:
        first = file.read_text().splitlines()[0]
        assert first.startswith("# Source: "), file.name


def rewritten_cases() -> Sequence[tuple[str, RewrittenCommand, TensorizerLoad]]:
    """Every accepted command line rewritten, by id: what vLLM's parser must accept."""
    return [(c.id, c.rewrite(), c.load) for c in REWRITE_CASES] + [
        (c.file, c.rewrite(), LOAD) for c in FIXTURE_CASES
    ]
