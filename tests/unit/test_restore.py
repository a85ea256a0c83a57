"""Restoring a patched Deployment reverts only what preshard changed, by exact equality.

The user edits the Deployment while it is patched; the restore gives back their Deployment with
those edits and without preshard's changes. A field preshard set that the user changed since
is kept as the user left it and named.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from preshard.builders.patching import (
    ANNOTATION_ORIGINAL,
    ANNOTATION_PATCHED,
    PatchedDeployment,
    build_patched_deployment,
    build_restored_deployment,
    patch_deployment,
    restore_deployment,
    restore_message,
)
from preshard.builders.vllm_args import ContainerCommand, RestoredCommand, restore_vllm_command
from tests.unit.test_patching import deployment, target_input

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def patched() -> dict[str, Any]:
    result = build_patched_deployment(deployment(), target_input())
    assert isinstance(result, dict)
    return result


def vllm(item: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = item["spec"]["template"]["spec"]["containers"][0]
    return container


def flag_value(container: dict[str, Any], name: str) -> str:
    args: list[str] = container["args"]
    return args[args.index(name) + 1]


def set_flag(container: dict[str, Any], name: str, value: str) -> None:
    args: list[str] = container["args"]
    args[args.index(name) + 1] = value


def restore(item: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    restored = restore_deployment(item)
    assert restored is not None
    return restored.deployment, restored.kept


def test_an_unedited_deployment_comes_back_exactly() -> None:
    restored, kept = restore(patched())
    assert restored["spec"] == deployment()["spec"]
    assert restored["metadata"]["annotations"] == {}
    assert kept == ()


def test_the_users_own_edits_stay_and_preshards_changes_go() -> None:
    edited = patched()
    container = vllm(edited)
    container["args"] += ["--max-num-seqs", "8"]
    container["env"].append({"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"})
    container["resources"]["limits"]["memory"] = "64Gi"
    container["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
    pod = edited["spec"]["template"]["spec"]
    pod["volumes"].append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    pod["containers"].append({"name": "exporter", "image": "exporter:1"})
    edited["spec"]["replicas"] = 5

    restored, kept = restore(edited)

    expected = deployment()
    expected["spec"]["replicas"] = 5
    pod = expected["spec"]["template"]["spec"]
    pod["volumes"].append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    pod["containers"].append({"name": "exporter", "image": "exporter:1"})
    pod["containers"][0] = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.34.0",
        "command": ["vllm", "serve"],
        "args": [MODEL, "--port", "8000", "--max-num-seqs", "8"],
        "env": [
            {"name": "HF_HOME", "value": "/cache"},
            {"name": "AWS_REGION", "value": "old"},
            {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
        ],
        "resources": {
            "requests": {"nvidia.com/gpu": "1", "cpu": "4"},
            "limits": {"nvidia.com/gpu": "1", "memory": "64Gi"},
        },
        "volumeMounts": [
            {"name": "cache", "mountPath": "/cache"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    assert restored["spec"] == expected["spec"]
    assert kept == ()


def test_a_flag_added_in_the_middle_stays_where_the_user_put_it() -> None:
    edited = patched()
    args = vllm(edited)["args"]
    args[3:3] = ["--enforce-eager"]
    restored, _ = restore(edited)
    assert vllm(restored)["args"] == [MODEL, "--port", "8000", "--enforce-eager"]


def test_a_field_of_preshards_the_user_changed_is_kept_and_named() -> None:
    edited = patched()
    container = vllm(edited)
    set_flag(container, "--tensor-parallel-size", "8")
    container["resources"]["limits"]["nvidia.com/gpu"] = "8"
    region = next(e for e in container["env"] if e["name"] == "AWS_REGION")
    region["value"] = "eu-west-1"

    restored, kept = restore(edited)

    assert vllm(restored)["args"] == [MODEL, "--port", "8000", "--tensor-parallel-size", "8"]
    assert vllm(restored)["resources"] == {
        "requests": {"nvidia.com/gpu": "1", "cpu": "4"},
        "limits": {"nvidia.com/gpu": "8"},
    }
    assert vllm(restored)["env"] == [
        {"name": "HF_HOME", "value": "/cache"},
        {"name": "AWS_REGION", "value": "eu-west-1"},
    ]
    assert kept == (
        "--tensor-parallel-size 8",
        "env AWS_REGION",
        "resources.limits nvidia.com/gpu",
    )
    assert restore_message("vllm", kept) == (
        "Deployment vllm restored; kept your own changes to what preshard had set: "
        "--tensor-parallel-size 8, env AWS_REGION, resources.limits nvidia.com/gpu"
    )
    assert restore_message("vllm", ()) == "Deployment vllm restored"


def test_a_flag_of_preshards_the_user_removed_stays_removed_and_is_named() -> None:
    edited = patched()
    args = vllm(edited)["args"]
    at = args.index("--load-format")
    del args[at : at + 2]
    restored, kept = restore(edited)
    assert vllm(restored)["args"] == [MODEL, "--port", "8000"]
    assert kept == ("--load-format (removed)",)
    assert flag_value(vllm(patched()), "--load-format") == "tensorizer"


def test_tensorizer_keys_the_user_added_stay_and_preshards_go() -> None:
    source = deployment()
    vllm(source)["args"] += ["--load-format", "safetensors"]
    first = build_patched_deployment(source, target_input())
    assert isinstance(first, dict)
    extra = json.loads(flag_value(vllm(first), "--model-loader-extra-config"))
    extra["deserialization_kwargs"] = {"lazy_load": True}
    set_flag(vllm(first), "--model-loader-extra-config", json.dumps(extra))

    restored, kept = restore(first)

    assert vllm(restored)["args"] == [
        MODEL,
        "--port",
        "8000",
        "--load-format",
        "safetensors",
        "--model-loader-extra-config",
        '{"deserialization_kwargs":{"lazy_load":true}}',
    ]
    assert kept == ()


def test_a_tensorizer_key_of_preshards_the_user_changed_is_kept() -> None:
    edited = patched()
    extra = json.loads(flag_value(vllm(edited), "--model-loader-extra-config"))
    extra["num_readers"] = 2
    set_flag(vllm(edited), "--model-loader-extra-config", json.dumps(extra))
    restored, kept = restore(edited)
    assert vllm(restored)["args"] == [
        MODEL,
        "--port",
        "8000",
        "--model-loader-extra-config",
        '{"num_readers":2}',
    ]
    assert kept == ("--model-loader-extra-config",)


def test_the_users_pythonpath_edit_stays_without_the_bundled_tensorizer() -> None:
    source = deployment()
    vllm(source)["env"].append({"name": "PYTHONPATH", "value": "/opt/plugins"})
    edited = build_patched_deployment(source, target_input())
    assert isinstance(edited, dict)
    path = next(e for e in vllm(edited)["env"] if e["name"] == "PYTHONPATH")
    assert path["value"] == "/var/run/preshard/tensorizer:/opt/plugins"
    path["value"] += ":/opt/more"
    restored, kept = restore(edited)
    assert vllm(restored)["env"] == [
        {"name": "HF_HOME", "value": "/cache"},
        {"name": "AWS_REGION", "value": "old"},
        {"name": "PYTHONPATH", "value": "/opt/plugins:/opt/more"},
    ]
    assert kept == ()


def test_a_renamed_container_keeps_everything_but_preshards_pod_level_parts() -> None:
    edited = patched()
    vllm(edited)["name"] = "server"
    restored, _ = restore(edited)
    pod = restored["spec"]["template"]["spec"]
    assert pod["initContainers"] == [{"name": "warmup", "image": "busybox"}]
    assert pod["volumes"] == [{"name": "cache", "emptyDir": {}}]
    assert pod["containers"][0] == vllm(edited)


def test_a_deployment_patched_before_the_patched_record_is_restored_as_before() -> None:
    legacy = patched()
    del legacy["metadata"]["annotations"][ANNOTATION_PATCHED]
    vllm(legacy)["env"].append({"name": "ADDED", "value": "1"})
    restored, kept = restore(legacy)
    assert restored["spec"] == deployment()["spec"]
    assert kept == ()


def test_an_unpatched_deployment_has_nothing_to_restore() -> None:
    assert restore_deployment(deployment()) is None
    assert build_restored_deployment(deployment()) is None


# While it stays patched ----------------------------------------------------------------------


def repatch(item: dict[str, Any]) -> PatchedDeployment:
    again = patch_deployment(item, target_input())
    assert isinstance(again, PatchedDeployment)
    return again


def test_the_users_edits_while_patched_become_part_of_the_original() -> None:
    edited = patched()
    vllm(edited)["env"].append({"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"})
    again = repatch(edited)
    assert again.deployment["spec"] == edited["spec"], "no rollout for the user's own edit"
    original = json.loads(again.deployment["metadata"]["annotations"][ANNOTATION_ORIGINAL])
    assert original["env"] == [
        {"name": "HF_HOME", "value": "/cache"},
        {"name": "AWS_REGION", "value": "old"},
        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
    ]
    restored, _ = restore(again.deployment)
    assert vllm(restored)["env"] == original["env"]
    assert repatch(again.deployment).deployment == again.deployment


def test_a_hand_edit_of_preshards_field_is_reasserted_and_not_recorded() -> None:
    edited = patched()
    set_flag(vllm(edited), "--tensor-parallel-size", "8")
    again = repatch(edited)
    assert flag_value(vllm(again.deployment), "--tensor-parallel-size") == "4"
    assert again.deployment["metadata"]["annotations"] == patched()["metadata"]["annotations"]
    restored, kept = restore(again.deployment)
    assert restored["spec"] == deployment()["spec"]
    assert kept == ()


def test_the_overrides_are_the_same_on_every_pass() -> None:
    source = deployment()
    vllm(source)["args"] += ["--tensor-parallel-size", "8"]
    first = patch_deployment(source, target_input())
    assert isinstance(first, PatchedDeployment)
    assert first.overrides == (
        "replaced --tensor-parallel-size 8 with 4 (the shard set's TP size)",
    )
    assert repatch(first.deployment).overrides == first.overrides


# The command line alone --------------------------------------------------------------------


def command(command: list[str] | None, args: list[str] | None) -> ContainerCommand:
    return ContainerCommand(command, args)


def test_a_shell_string_the_user_edited_is_restored_word_by_word() -> None:
    original = command(["sh", "-c", "exec vllm serve m --port 8000"], None)
    patched_line = command(
        [
            "sh",
            "-c",
            "exec vllm serve /var/run/preshard/model --port 8000 --served-model-name m "
            "--tensor-parallel-size 2 --load-format tensorizer --model-loader-extra-config "
            "'{\"num_readers\":8}'",
        ],
        None,
    )
    edited = command(
        [
            "sh",
            "-c",
            "exec vllm serve /var/run/preshard/model --port 8000 --served-model-name m "
            "--tensor-parallel-size 2 --load-format tensorizer --model-loader-extra-config "
            "'{\"num_readers\":8}' --enforce-eager",
        ],
        None,
    )
    assert restore_vllm_command(edited, patched_line, original) == RestoredCommand(
        ["sh", "-c", "exec vllm serve m --port 8000 --enforce-eager"], None
    )
    assert restore_vllm_command(patched_line, patched_line, original) == RestoredCommand(
        ["sh", "-c", "exec vllm serve m --port 8000"], None
    )


def test_an_args_only_container_keeps_its_form() -> None:
    original = command(None, ["m", "-tp", "1", "--port", "8000"])
    patched_line = command(
        None,
        [
            "/dir",
            "--tensor-parallel-size",
            "2",
            "--port",
            "8000",
            "--served-model-name",
            "m",
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            "{}",
        ],
    )
    edited = command(None, [*(patched_line.args or []), "--seed", "1"])
    assert restore_vllm_command(edited, patched_line, original) == RestoredCommand(
        None, ["m", "-tp", "1", "--port", "8000", "--seed", "1"]
    )


def test_without_keeping_edits_preshards_flags_get_their_original_values() -> None:
    original = command(["vllm", "serve", "m"], None)
    patched_line = command(
        ["vllm", "serve", "/dir", "--served-model-name", "m", "--tensor-parallel-size", "2"],
        None,
    )
    edited = command(
        ["vllm", "serve", "/dir", "--served-model-name", "m", "--tensor-parallel-size", "8"],
        None,
    )
    assert restore_vllm_command(edited, patched_line, original, keep_edits=False) == (
        RestoredCommand(["vllm", "serve", "m"], None)
    )
    assert restore_vllm_command(edited, patched_line, original) == RestoredCommand(
        ["vllm", "serve", "m", "--tensor-parallel-size", "8"], None, ("--tensor-parallel-size 8",)
    )


def test_a_command_line_the_user_replaced_by_an_unreadable_one_is_kept_and_named() -> None:
    original = command(["vllm", "serve", "m"], None)
    patched_line = command(["vllm", "serve", "/dir", "--served-model-name", "m"], None)
    edited = command(["sh", "-c", "vllm serve /dir; sleep 1"], None)
    assert restore_vllm_command(edited, patched_line, original) == RestoredCommand(
        ["sh", "-c", "vllm serve /dir; sleep 1"], None, ("the command line",)
    )
    assert restore_vllm_command(
        edited, patched_line, original, keep_edits=False
    ) == RestoredCommand(["vllm", "serve", "m"], None)


def test_the_records_are_plain_copies() -> None:
    item = patched()
    annotations = item["metadata"]["annotations"]
    assert json.loads(annotations[ANNOTATION_PATCHED]) == {
        "container": "vllm",
        **{k: copy.deepcopy(v) for k, v in vllm(item).items() if k not in ("name", "image")},
    }
