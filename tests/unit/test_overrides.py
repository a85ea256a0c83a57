"""Nothing of the user's is replaced without a word: the reported overrides, the merged
tensorizer JSON, the refused dtypes and quantizations, and Deployments another controller owns.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from preshard.builders.patching import (
    PatchedDeployment,
    Refusal,
    TargetInput,
    overrides_line,
    patch_deployment,
    tensorizer_load,
)
from preshard.builders.vllm_args import (
    RewrittenCommand,
    TensorizerLoad,
    UnsupportedCommandError,
    rewrite_vllm_command,
)
from preshard.contract import reasons
from tests.unit.test_patching import deployment, target_input

MODEL_DIR = "/var/run/preshard/model"
URI = "s3://models/shards/k/model-rank-%03d.tensors"
LOAD = TensorizerLoad(MODEL_DIR, 2, URI, 8, dtype="bfloat16")
OURS = {"num_readers": 8, "tensorizer_uri": URI}


def serve(*args: str) -> list[str]:
    return ["vllm", "serve", "m", *args]


def rewrite(*args: str, load: TensorizerLoad = LOAD) -> RewrittenCommand:
    return rewrite_vllm_command(serve(*args), None, load)


def extra_config(rewritten: RewrittenCommand) -> Any:
    words = rewritten.command or []
    return json.loads(words[words.index("--model-loader-extra-config") + 1])


def refusal(*args: str, load: TensorizerLoad = LOAD) -> UnsupportedCommandError:
    with pytest.raises(UnsupportedCommandError) as raised:
        rewrite(*args, load=load)
    return raised.value


def test_nothing_is_reported_when_nothing_of_the_users_is_replaced() -> None:
    same = rewrite("--tensor-parallel-size", "2", "--load-format", "tensorizer")
    assert same.overrides == ()
    kept = rewrite("--served-model-name", "chat", "--model-loader-extra-config", json.dumps(OURS))
    assert kept.overrides == ()
    assert kept.served_model_name == "chat"


def test_the_tp_size_and_load_format_the_rewrite_replaces_are_reported() -> None:
    rewritten = rewrite("--tensor_parallel_size=8", "--load-format", "runai_streamer")
    assert rewritten.overrides == (
        "replaced --tensor_parallel_size 8 with 2 (the shard set's TP size)",
        "replaced --load-format runai_streamer with tensorizer",
    )


def test_tensorizer_keys_of_the_user_are_merged_and_preshards_win() -> None:
    user = {
        "num_readers": 2,
        "vllm_tensorized": True,
        "deserialization_kwargs": {"lazy_load": True, "num_readers": 1},
        "s3_secret_access_key": "do-not-show",
    }
    rewritten = rewrite("--model-loader-extra-config", json.dumps(user))
    assert extra_config(rewritten) == {
        **OURS,
        "vllm_tensorized": True,
        "deserialization_kwargs": {"lazy_load": True},
    }
    assert rewritten.overrides == (
        "--model-loader-extra-config: kept your deserialization_kwargs, vllm_tensorized; "
        "replaced your deserialization_kwargs.num_readers, num_readers, s3_secret_access_key "
        "with preshard's settings",
    )
    assert "do-not-show" not in " ".join(rewritten.overrides)


def test_dotted_keys_are_gathered_as_vllms_parser_gathers_them() -> None:
    rewritten = rewrite(
        "--model-loader-extra-config",
        '{"vllm_tensorized": false}',
        "--model-loader-extra-config.deserialization_kwargs.lazy_load",
        "true",
        "--model_loader_extra_config.stream_kwargs.s3_endpoint=https://other",
    )
    # With a dotted key, vLLM ignores the plain JSON flag: its dotted JSON comes last.
    assert extra_config(rewritten) == {
        **OURS,
        "deserialization_kwargs": {"lazy_load": True},
        "stream_kwargs": {},
    }
    assert rewritten.command is not None
    assert rewritten.command.count("--model-loader-extra-config") == 1
    assert rewritten.overrides == (
        "--model-loader-extra-config: kept your deserialization_kwargs, stream_kwargs; "
        "replaced your stream_kwargs.s3_endpoint with preshard's settings",
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--model-loader-extra-config", '{"concurrency": 16, "memory_limit": 1}'],
            "--model-loader-extra-config has keys vLLM's tensorizer loader does not accept "
            "(concurrency, memory_limit): they are probably for the load format the container "
            "used before. Remove them; the keys it accepts are deserialization_kwargs, "
            "encryption_keyfile, num_readers, s3_access_key_id, s3_endpoint, "
            "s3_secret_access_key, serialization_kwargs, stream_kwargs, tensorizer_dir, "
            "tensorizer_uri, verify_hash, vllm_tensorized",
        ),
        (["--model-loader-extra-config", "[1]"], "--model-loader-extra-config is not a JSON"),
        (["--model-loader-extra-config", "{oops"], "--model-loader-extra-config is not a JSON"),
        (
            ["--model-loader-extra-config", '{"stream_kwargs": 1}'],
            "--model-loader-extra-config key stream_kwargs must be a JSON object",
        ),
        (
            ["--model-loader-extra-config", '{"vllm_tensorized": "yes"}'],
            "--model-loader-extra-config key vllm_tensorized must be a JSON boolean",
        ),
        (
            ["--model-loader-extra-config", '{"deserialization_kwargs": {"dtype": "float16"}}'],
            "--model-loader-extra-config key deserialization_kwargs sets dtype, which vLLM "
            "passes to tensorizer itself, so loading would fail",
        ),
        (
            ["--model-loader-extra-config.dtype", "float16"],
            "does not accept (dtype)",
        ),
        (
            ["--model-loader-extra-config.stream_kwargs.tags+", "a,b"],
            "appends to a list in vLLM's JSON",
        ),
    ],
)
def test_loader_settings_tensorizer_does_not_take_are_refused(args: list[str], says: str) -> None:
    refused = refusal(*args)
    assert refused.reason == reasons.UNSUPPORTED_LOADER_CONFIG
    assert says in refused.message


@pytest.mark.parametrize(
    ("written", "shards"),
    [
        ("bfloat16", "bfloat16"),
        ("half", "float16"),
        ("float16", "float16"),
        ("float", "float32"),
        ("auto", "bfloat16"),
        ("float16", "auto"),
    ],
)
def test_a_dtype_the_shards_hold_is_accepted(written: str, shards: str) -> None:
    load = dataclasses.replace(LOAD, dtype=shards)
    assert rewrite("--dtype", written, load=load).command == [
        "vllm",
        "serve",
        MODEL_DIR,
        "--dtype",
        written,
        "--served-model-name",
        "m",
        "--tensor-parallel-size",
        "2",
        "--load-format",
        "tensorizer",
        "--model-loader-extra-config",
        json.dumps(OURS, sort_keys=True, separators=(",", ":")),
    ]


def test_another_dtype_than_the_shards_is_refused() -> None:
    refused = refusal("--dtype", "bfloat16", "--dtype=half")
    assert (refused.reason, refused.message) == (
        reasons.DTYPE_CONFLICT,
        "--dtype half conflicts with the shards, which hold bfloat16 weights "
        "(serialization.dtype): vLLM would convert them. Use --dtype bfloat16 or auto, or set "
        "serialization.dtype (a new shard set)",
    )


def test_a_quantization_of_unquantized_shards_is_refused() -> None:
    refused = refusal("-q", "fp8")
    assert (refused.reason, refused.message) == (
        reasons.QUANTIZATION_CONFLICT,
        "-q fp8 conflicts with the shards, which are unquantized: remove it, or write shards "
        "for it with serialization.extraEngineArgs.quantization: fp8 (a new shard set)",
    )
    assert rewrite("--quantization", "None").overrides == ()


def test_quantized_shards_need_the_same_quantization() -> None:
    load = dataclasses.replace(LOAD, quantization="fp8")
    assert rewrite("--quantization", "fp8", load=load).overrides == ()
    for args, given in (((), "no --quantization"), (("-q", "awq"), "--quantization awq")):
        refused = refusal(*args, load=load)
        assert (refused.reason, refused.message) == (
            reasons.QUANTIZATION_CONFLICT,
            f"{given} conflicts with the shards, which were written with quantization fp8 "
            "(serialization.extraEngineArgs): give the container --quantization fp8",
        )


def test_a_value_attached_to_a_one_letter_flag_is_refused() -> None:
    refused = refusal("-qfp8")
    assert (refused.reason, refused.message) == (
        reasons.UNSUPPORTED_COMMAND,
        "-qfp8 attaches a value to -q, a flag preshard rewrites or checks; write it as -q fp8",
    )


# Targets ---------------------------------------------------------------------------------


def patched(source: dict[str, Any], target: TargetInput | None = None) -> PatchedDeployment:
    result = patch_deployment(source, target or target_input())
    assert isinstance(result, PatchedDeployment), result
    return result


def test_the_load_carries_the_shards_dtype_and_quantization() -> None:
    target = target_input(
        {"serialization": {"dtype": "float16", "extraEngineArgs": {"quantization": "fp8"}}}
    )
    load = tensorizer_load(target)
    assert (load.dtype, load.quantization) == ("float16", "fp8")
    assert (
        tensorizer_load(target_input()).dtype,
        tensorizer_load(target_input()).quantization,
    ) == (
        "auto",
        None,
    )


def test_a_patch_reports_what_it_replaces_of_the_users() -> None:
    source = deployment()
    source["spec"]["template"]["spec"]["containers"][0]["args"] += ["-tp", "8"]
    result = patched(source)
    assert result.overrides == ("replaced -tp 8 with 4 (the shard set's TP size)",)
    assert overrides_line(result.overrides) == (
        "changed in the vLLM command line: replaced -tp 8 with 4 (the shard set's TP size)"
    )
    assert patched(deployment()).overrides == ()


def test_a_conflicting_dtype_is_refused_with_the_container_named() -> None:
    source = deployment()
    source["spec"]["template"]["spec"]["containers"][0]["args"] += ["--dtype", "float16"]
    refused = patch_deployment(source, target_input({"serialization": {"dtype": "bfloat16"}}))
    assert isinstance(refused, Refusal)
    assert refused.reason == reasons.DTYPE_CONFLICT
    assert refused.message.startswith("container vllm: --dtype float16 conflicts with the shards")


def controlled() -> dict[str, Any]:
    source = deployment()
    source["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "unrelated", "uid": "1"},
        {
            "apiVersion": "serving.kserve.io/v1beta1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": "2",
            "controller": True,
        },
    ]
    return source


def test_a_deployment_another_controller_owns_is_refused() -> None:
    refused = patch_deployment(controlled(), target_input())
    assert refused == Refusal(
        reasons.TARGET_MANAGED_BY_CONTROLLER,
        "Deployment vllm is controlled by InferenceService llama (its ownerReference with "
        "controller: true), which puts its own pod template back and would undo the patch: "
        "point that resource at the shards instead, or set allowControllerOwned: true on the "
        "target to patch the Deployment anyway",
    )


def test_an_owner_that_is_not_its_controller_does_not_count() -> None:
    source = controlled()
    del source["metadata"]["ownerReferences"][1]
    patched(source)


def test_the_target_can_allow_a_controller_owned_deployment() -> None:
    allowed = dataclasses.replace(target_input(), allow_controller_owned=True)
    result = patched(controlled(), allowed)
    assert (
        result.deployment["metadata"]["ownerReferences"]
        == controlled()["metadata"]["ownerReferences"]
    )
