"""Rewrite a vLLM container's command line so that it loads a tensorizer shard set.

preshard patches Deployments it does not own, so this rewrite is conservative. It recognises
the ways people start the vLLM server in Kubernetes: `vllm serve <model>` (any path to the
`vllm` script), `python -m vllm.entrypoints.openai.api_server --model <model>`,
`python -m vllm.entrypoints.cli.main serve`, `args` alone on the `vllm/vllm-openai` image, and
one plain command inside `sh -c` / `bash -c`. It changes only what decides the load (the
model directory, `--tensor-parallel-size`, `--load-format`, `--model-loader-extra-config`),
keeps the name clients use, leaves every other token as written, and refuses with a readable
sentence every command line whose effect it cannot be sure of. Every value of the user's that
it replaces is reported (`RewrittenCommand.overrides`), the user's tensorizer settings are merged
into preshard's JSON, and a `--dtype` or `--quantization` the shards were not written for is
refused. `restore_vllm_command` undoes the rewrite, keeping what the user changed since.

Flags are matched the way vLLM 0.34's `FlexibleArgumentParser` reads them: underscores and
dashes are the same in `--long-names`, `--flag=value` and `--flag value` are the same,
`--model-loader-extra-config.key value` sets one key of the JSON, and Python's argparse
expands unambiguous abbreviations (`--tensor-parallel 2`, `-t 2`). Abbreviations of the flags
this module reads are refused rather than guessed at.

Everything here is pure: strings in, strings out, no I/O.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from preshard.contract import reasons

# The `vllm/vllm-openai` image's ENTRYPOINT (vllm-project/vllm docker/Dockerfile, final
# stage `vllm-openai`: `ENTRYPOINT ["vllm", "serve"]`). A container that sets only `args`
# runs `vllm serve <args>`, so the first arg is the positional model (or `--model` follows).
IMAGE_ENTRYPOINT: Final = ("vllm", "serve")
API_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"
CLI_MODULE: Final = "vllm.entrypoints.cli.main"

# Every option string vLLM 0.34's `serve` parser registers for the settings this module reads
# or writes, by argparse destination. Tests compare the table with vLLM's own parser, so a
# new alias in a later vLLM fails a test instead of slipping past the rewrite.
VLLM_OPTION_STRINGS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "model": ("--model",),
        "served_model_name": ("--served-model-name",),
        "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
        "load_format": ("--load-format",),
        "model_loader_extra_config": ("--model-loader-extra-config",),
        "pipeline_parallel_size": ("--pipeline-parallel-size", "-pp"),
        "data_parallel_size": ("--data-parallel-size", "-dp"),
        "prefill_context_parallel_size": ("--prefill-context-parallel-size", "-pcp"),
        "nnodes": ("--nnodes", "-n"),
        "headless": ("--headless",),
        "enable_expert_parallel": (
            "--enable-expert-parallel",
            "-ep",
            "--disable-expert-parallel",
            "--no-enable-expert-parallel",
        ),
        "config": ("--config",),
        "dtype": ("--dtype",),
        "quantization": ("--quantization", "-q"),
    }
)

_Arity = Literal["none", "one", "many"]
_ARITY: Final[Mapping[str, _Arity]] = {
    "model": "one",
    "served_model_name": "many",
    "tensor_parallel_size": "one",
    "load_format": "one",
    "model_loader_extra_config": "one",
    "pipeline_parallel_size": "one",
    "data_parallel_size": "one",
    "prefill_context_parallel_size": "one",
    "nnodes": "one",
    "headless": "none",
    "enable_expert_parallel": "none",
    "config": "one",
    "dtype": "one",
    "quantization": "one",
}
_DEST_BY_OPTION: Final = {
    option: dest for dest, options in VLLM_OPTION_STRINGS.items() for option in options
}
_EXPERT_PARALLEL_ON: Final = frozenset({"--enable-expert-parallel", "-ep"})
# vLLM's spellings of the same weight dtype (vllm/config/model.py, `_STR_DTYPE_TO_TORCH_DTYPE`).
_DTYPE_ALIASES: Final[Mapping[str, str]] = MappingProxyType({"half": "float16", "float": "float32"})
# What `--quantization` reads as "no quantization" (vLLM's `optional_type`).
_NO_QUANTIZATION: Final = frozenset({"", "None"})

# The keys vLLM 0.34's tensorizer loader accepts in `--model-loader-extra-config`: the init
# fields of `TensorizerConfig` (vllm/model_executor/model_loader/tensorizer.py), which vLLM
# copies into the config it builds the loader from. Tests compare this with vLLM's own class.
TENSORIZER_CONFIG_KEYS: Final = frozenset(
    {
        "tensorizer_uri",
        "tensorizer_dir",
        "vllm_tensorized",
        "verify_hash",
        "num_readers",
        "encryption_keyfile",
        "s3_access_key_id",
        "s3_secret_access_key",
        "s3_endpoint",
        "stream_kwargs",
        "serialization_kwargs",
        "deserialization_kwargs",
    }
)
# Keys preshard decides: where the shards are and how they are read come from the spec (the
# shard set, `loading`, `storage`, `encryption`), so the user's values of them are replaced (or
# dropped where preshard sets none) and reported. The credentials reach tensorizer through the
# storage Secret's environment, which keys in the JSON would override.
PRESHARD_LOADER_KEYS: Final = frozenset(
    {
        "tensorizer_uri",
        "tensorizer_dir",
        "num_readers",
        "s3_endpoint",
        "encryption_keyfile",
        "verify_hash",
        "s3_access_key_id",
        "s3_secret_access_key",
    }
)
# The user's keys that are merged, with the JSON type vLLM needs for each.
_MERGED_KEY_TYPES: Final[Mapping[str, type]] = MappingProxyType(
    {
        "vllm_tensorized": bool,
        "stream_kwargs": dict,
        "serialization_kwargs": dict,
        "deserialization_kwargs": dict,
    }
)
# Inside the merged dicts: keys that override what preshard set (vLLM spreads them over its
# own arguments: TensorizerArgs.stream_kwargs and deserialization_kwargs) are dropped and
# reported; keys vLLM passes itself as well would fail with a duplicate argument, so are refused.
_NESTED_PRESHARD_KEYS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "stream_kwargs": frozenset({"s3_access_key_id", "s3_secret_access_key", "s3_endpoint"}),
        "deserialization_kwargs": frozenset({"verify_hash", "encryption", "num_readers"}),
    }
)
_NESTED_VLLM_KEYS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "stream_kwargs": frozenset({"mode"}),
        "deserialization_kwargs": frozenset({"dtype", "device"}),
    }
)
_MISSING: Final = object()

# Settings that must stay 1: each changes how weights are split across GPUs, while a shard
# set holds exactly one file per tensor-parallel rank. vLLM substitutes only the TP rank into
# the URI template (TensorizerLoader.load_model), and with data or prefill-context
# parallelism it shards MoE layers over DP x PCP x TP ranks
# (FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp), which no TP-rank file matches.
_MUST_BE_ONE: Final[Mapping[str, str]] = {
    "pipeline_parallel_size": (
        "a shard set holds one file per tensor-parallel rank, so pipeline parallelism must be 1"
    ),
    "data_parallel_size": (
        "with data parallelism vLLM splits MoE layers over the data-parallel ranks too, which no "
        "per-tensor-parallel-rank shard matches; scale with Deployment replicas instead"
    ),
    "prefill_context_parallel_size": (
        "with prefill context parallelism vLLM splits MoE layers over more ranks than the "
        "tensor-parallel ones the shards were written for"
    ),
    "nnodes": (
        "tensor parallelism across nodes spans several pods, while preshard patches one pod "
        "template with one GPU per tensor-parallel rank"
    ),
}

_SHELLS: Final = frozenset({"sh", "bash", "dash", "ash"})
_SHELL_OPTIONS: Final = re.compile(r"^-[celux]+$")
_PYTHON: Final = re.compile(r"^python(\d+(\.\d+)?)?$")
_PYTHON_OPTIONS: Final = re.compile(r"^-[BEIOsuq]+$")
_ASSIGNMENT: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NEGATIVE_NUMBER: Final = re.compile(r"^-\d+$|^-\d*\.\d+$")
_URI_RANK_TEMPLATE: Final = re.compile(r"%0\dd")
# Finds a vLLM server start inside a shell string that is too complex to rewrite, so that the
# container is still recognised (and then refused with a reason, not reported missing).
_VLLM_IN_SCRIPT: Final = re.compile(
    r"(?:^|[\s;&|(`])(?:\S*/)?vllm\s+serve(?:\s|$)"
    r"|-m\s+vllm\.entrypoints\.(?:openai\.api_server|cli\.main)(?:\s|$)"
)


@dataclass(frozen=True)
class TensorizerLoad:
    """What the patched container must load."""

    model_dir: str
    """Local directory the init container fills with the config and tokenizer files."""
    tensor_parallel_size: int
    tensorizer_uri: str
    """Rank file template, e.g. `s3://bucket/prefix/<key>/model-rank-%03d.tensors`."""
    num_readers: int
    s3_endpoint: str | None = None
    """The S3 endpoint; written into the JSON only when it is `https://`."""
    encryption_keyfile: str | None = None
    """Path of the mounted key file, when the shard set is encrypted."""
    verify_hash: bool = False
    """Check the stored per-tensor hashes while loading."""
    dtype: str = "auto"
    """The weight dtype the shards were written in (`serialization.dtype`); `auto`: the model's."""
    quantization: str | None = None
    """The quantization method the shards were written with (`serialization.extraEngineArgs`)."""

    def __post_init__(self) -> None:
        if not self.model_dir.startswith("/"):
            raise ValueError(f"model_dir must be an absolute path, got {self.model_dir!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.num_readers < 1:
            raise ValueError("num_readers must be at least 1")
        templated = _URI_RANK_TEMPLATE.search(self.tensorizer_uri) is not None
        if self.tensor_parallel_size > 1 and not templated:
            raise ValueError(
                "tensorizer_uri needs a zero-padded rank template such as %03d when "
                "tensor_parallel_size is greater than 1"
            )
        if self.tensor_parallel_size == 1 and templated:
            raise ValueError(
                "at tensor_parallel_size 1 vLLM opens tensorizer_uri as written: name the "
                "rank file, not a %03d template"
            )


@dataclass(frozen=True)
class RewrittenCommand:
    """The container's new `command` and `args`; None leaves a field unset."""

    command: list[str] | None
    args: list[str] | None
    served_model_name: str | None
    """The model name clients use, kept from the original command line."""
    overrides: tuple[str, ...] = ()
    """Each value the user had set that the rewrite replaced, merged or dropped, in words."""


@dataclass(frozen=True)
class ContainerCommand:
    """A container's `command` and `args`, as a Deployment stores them."""

    command: list[str] | None
    args: list[str] | None


@dataclass(frozen=True)
class RestoredCommand:
    """A patched command line with preshard's changes undone."""

    command: list[str] | None
    args: list[str] | None
    kept: tuple[str, ...] = ()
    """The flags preshard had set that the user changed since and that are kept as they are."""


class UnsupportedCommandError(ValueError):
    """A command line that cannot be rewritten safely."""

    def __init__(self, message: str, reason: str = reasons.UNSUPPORTED_COMMAND) -> None:
        super().__init__(message)
        self.reason: str = reason
        self.message: str = message


def model_loader_extra_config(load: TensorizerLoad) -> str:
    """The flat `--model-loader-extra-config` JSON: compact, keys sorted, deterministic."""
    return _compact(_loader_config(load))


def _loader_config(load: TensorizerLoad) -> dict[str, object]:
    """preshard's own keys of the tensorizer JSON."""
    config: dict[str, object] = {
        "tensorizer_uri": load.tensorizer_uri,
        "num_readers": load.num_readers,
    }
    # tensorizer 2.10.1 refuses a plain-http endpoint passed as an argument
    # (tensorizer/stream_io.py: open_stream -> _enforce_scheme raises "Non-HTTPS endpoint
    # URLs are not allowed."), but accepts one it finds in AWS_ENDPOINT_URL_S3 or
    # AWS_ENDPOINT_URL. So only an https endpoint goes into the JSON; any other reaches
    # tensorizer through the environment the controller sets on the container.
    if load.s3_endpoint is not None and load.s3_endpoint.lower().startswith("https://"):
        config["s3_endpoint"] = load.s3_endpoint
    if load.encryption_keyfile is not None:
        config["encryption_keyfile"] = load.encryption_keyfile
    if load.verify_hash:
        config["verify_hash"] = True
    return config


def _compact(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def is_vllm_openai_image(image: str) -> bool:
    """Whether an image reference names the `vllm-openai` image (any registry, tag, digest)."""
    name = image.partition("@")[0]
    last = name.rsplit("/", 1)[-1]
    return last.partition(":")[0] == "vllm-openai"


def is_vllm_command(
    command: Sequence[str] | None,
    args: Sequence[str] | None,
    *,
    image: str | None = None,
) -> bool:
    """Whether a container starts the vLLM OpenAI server, to find it among several.

    A container without `command` runs its image's entrypoint, which only the image reference
    tells: pass `image` to recognise `args`-only containers of the `vllm-openai` image. A shell
    string counts when it starts vLLM anywhere, even where it is too complex to rewrite, so
    that the container is refused with a reason instead of reported missing.
    """
    if not command:
        return image is not None and is_vllm_openai_image(image)
    words = [*command, *(args or ())]
    try:
        script = _shell_script_index(words)
    except UnsupportedCommandError:
        return False
    if script is None:
        return _match_program(words) is not None
    return _VLLM_IN_SCRIPT.search(words[script]) is not None


def rewrite_vllm_command(
    command: Sequence[str] | None,
    args: Sequence[str] | None,
    load: TensorizerLoad,
    *,
    image: str | None = None,
) -> RewrittenCommand:
    """The container's command line rewritten to load the shard set.

    A container without `command` runs its image's entrypoint with `args`; preshard knows that
    entrypoint (`vllm serve`) only for the `vllm-openai` image. Pass the container's `image`:
    `args` alone on any other image are refused, not read as `vllm serve` arguments (`busybox`
    with `args: [sleep, infinity]` would become `sleep` served as a model). Without `image`,
    the entrypoint is taken to be `vllm serve`.

    Idempotent: rewriting a rewritten command line with the same `load` returns it unchanged,
    and with another `load` returns what rewriting the original would have.

    Raises UnsupportedCommandError when the command line cannot be rewritten safely.
    """
    if not command and image is not None and not is_vllm_openai_image(image):
        raise UnsupportedCommandError(
            f"the container sets only args, so it runs the entrypoint of its image {image!r}, "
            "which preshard cannot see (it knows only the vllm-openai image's, `vllm serve`); "
            "set command, e.g. [vllm, serve], if it starts the vLLM server"
        )
    line = _command_line(command, args)
    rest, served, overrides = _rewrite_arguments(
        line.arguments, line.entrypoint, load, _append_part(line)
    )
    new_command, new_args = line.rebuilt(rest)
    return RewrittenCommand(
        command=new_command, args=new_args, served_model_name=served, overrides=overrides
    )


def restore_vllm_command(
    current: ContainerCommand,
    patched: ContainerCommand,
    original: ContainerCommand,
    *,
    keep_edits: bool = True,
) -> RestoredCommand:
    """`current` with the rewrite that turned `original` into `patched` undone.

    Only what preshard changed is reverted, flag by flag (the model, `--served-model-name`,
    `--tensor-parallel-size`, `--load-format`, and `--model-loader-extra-config` key by key):
    where the current value is still the one preshard set, the original one comes back; flags
    and values the user added meanwhile stay where they are. A flag preshard set that the user
    changed since is kept as it is and named in `kept`; with `keep_edits=False` it gets its
    original value instead (what the next patch would put back anyway), which is how the
    user's own Deployment is derived while it is still patched.
    """
    if _same_command(current, patched):
        return RestoredCommand(original.command, original.args)
    try:
        lines = [_command_line(c.command, c.args) for c in (current, patched, original)]
        found = [_restorable_occurrences(line) for line in lines]
    except UnsupportedCommandError:
        # The user rewrote the command line into one preshard cannot read.
        if keep_edits:
            return RestoredCommand(current.command, current.args, ("the command line",))
        return RestoredCommand(original.command, original.args)
    line = lines[0]
    plan: dict[int, _Edit] = {}
    appended: list[_Token] = []
    kept: list[str] = []
    for dest in _RESTORED_DESTS:
        have, had, was = (by_dest.get(dest, []) for by_dest in found)
        now, set_, before = (
            _occurrence_texts(line_, uses)
            for line_, uses in zip(lines, (have, had, was), strict=True)
        )
        replacement = [t for o in was for t in lines[2].arguments[o.start : o.end]]
        if now == set_:
            pass
        elif set_ == before:
            continue  # the user's own flag: preshard left it as it was
        elif dest == "model_loader_extra_config" and (
            merged := _restore_loader_config((have, had, was), keep_edits)
        ):
            text, edited = merged
            if edited:
                kept.append(VLLM_OPTION_STRINGS[dest][0])
            if text is not None:
                replacement = [_Token(VLLM_OPTION_STRINGS[dest][0], ""), _Token(text, "")]
        elif keep_edits:
            kept.append(_kept_label(dest, now))
            continue
        if not have:
            appended += [_Token(t.text, _append_part(line)) for t in replacement]
            continue
        part = line.arguments[have[0].start].part
        plan[have[0].start] = (have[0].end, [_Token(t.text, part) for t in replacement])
        for other in have[1:]:
            plan[other.start] = (other.end, [])
    new_command, new_args = line.rebuilt([*_apply(line.arguments, plan), *appended])
    return RestoredCommand(new_command, new_args, tuple(kept))


_NOT_VLLM: Final = (
    "the container does not start the vLLM server in a form preshard can rewrite: expected "
    "`vllm serve <model>`, `python -m vllm.entrypoints.openai.api_server --model <model>`, "
    "`args` for the vllm-openai image, or one of these inside `sh -c`"
)

_Entrypoint = Literal["serve", "api_server"]


@dataclass(frozen=True)
class _Token:
    """One word of the container's command line and the field it lives in."""

    text: str
    part: str
    """`command`, `args`, `image` (the inherited entrypoint) or `script` (inside `sh -c`)."""


def _container_tokens(command: Sequence[str] | None, args: Sequence[str] | None) -> list[_Token]:
    if command:
        head = [_Token(word, "command") for word in command]
    else:
        head = [_Token(word, "image") for word in IMAGE_ENTRYPOINT]
    return [*head, *(_Token(word, "args") for word in args or ())]


def _args_field(tokens: Sequence[_Token], args: Sequence[str] | None) -> list[str] | None:
    words = [t.text for t in tokens if t.part == "args"]
    return words if args is not None or words else None


def _shell_script_index(words: Sequence[str]) -> int | None:
    """Where the `-c` string is, when the command line runs a shell; None when it does not."""
    if not words or posixpath.basename(words[0]) not in _SHELLS:
        return None
    index = 1
    with_c = False
    while index < len(words) and _SHELL_OPTIONS.match(words[index]):
        with_c = with_c or "c" in words[index]
        index += 1
    if not with_c:
        raise UnsupportedCommandError(
            f"the container runs {posixpath.basename(words[0])} without -c (a script file or "
            "an interactive shell), whose commands preshard cannot see"
        )
    if index >= len(words):
        raise UnsupportedCommandError("the container runs a shell with -c but no command string")
    return index


def _match_program(words: Sequence[str]) -> tuple[_Entrypoint, int] | None:
    """How the words start vLLM's server and how many of them name the program."""
    if not words:
        return None
    name = posixpath.basename(words[0])
    if name == "vllm":
        return ("serve", 2) if words[1:2] == ["serve"] else None
    if not _PYTHON.match(name):
        return None
    index = 1
    while index < len(words) and _PYTHON_OPTIONS.match(words[index]):
        index += 1
    if words[index : index + 1] != ["-m"] or index + 1 >= len(words):
        return None
    module = words[index + 1]
    if module == API_SERVER_MODULE:
        return "api_server", index + 2
    if module == CLI_MODULE and words[index + 2 : index + 3] == ["serve"]:
        return "serve", index + 3
    return None


@dataclass(frozen=True)
class _CommandLine:
    """A container's command line, split where vLLM's own arguments start."""

    command: Sequence[str] | None
    args: Sequence[str] | None
    tokens: list[_Token]
    """Every word of the container, the image's entrypoint first when it sets only args."""
    head: int
    """How many of `tokens` name the program (without a shell)."""
    script: int | None
    """Where the `sh -c` string is in `tokens`, when a shell runs vLLM."""
    script_head: list[str]
    """The words of the shell string before vLLM's arguments (assignments, exec, program)."""
    assignments: int
    """How many `NAME=value` words the shell string starts with."""
    entrypoint: _Entrypoint
    arguments: list[_Token]
    """vLLM's arguments, after the program."""

    def rebuilt(self, arguments: Sequence[_Token]) -> tuple[list[str] | None, list[str] | None]:
        """The container's `command` and `args` with other vLLM arguments, in the same form."""
        if self.script is None:
            tokens = [*self.tokens[: self.head], *arguments]
        else:
            words = self.script_head
            text = shlex.join([*words[self.assignments :], *(t.text for t in arguments)])
            quoted = [_quote_assignment(word) for word in words[: self.assignments]]
            tokens = list(self.tokens)
            tokens[self.script] = _Token(" ".join([*quoted, text]), tokens[self.script].part)
        command = [t.text for t in tokens if t.part == "command"] if self.command else None
        return command, _args_field(tokens, self.args)


def _command_line(command: Sequence[str] | None, args: Sequence[str] | None) -> _CommandLine:
    """The container's command line read as a start of vLLM's server; refuses any other."""
    tokens = _container_tokens(command, args)
    script = _shell_script_index([t.text for t in tokens])
    if script is None:
        program = _match_program([t.text for t in tokens])
        if program is None:
            raise UnsupportedCommandError(_NOT_VLLM)
        entrypoint, length = program
        return _CommandLine(command, args, tokens, length, None, [], 0, entrypoint, tokens[length:])
    words = _plain_shell_words(tokens[script].text)
    assignments = 0
    while assignments < len(words) and _ASSIGNMENT.match(words[assignments]):
        assignments += 1
    start = assignments
    if words[start : start + 1] == ["exec"]:
        start += 1
        if words[start : start + 1] == ["exec"]:
            raise UnsupportedCommandError(
                "the shell string chains `exec exec`; only a single leading exec is supported"
            )
    program = _match_program(words[start:])
    if program is None:
        raise UnsupportedCommandError(_NOT_VLLM)
    entrypoint, length = program
    arguments = [_Token(word, "script") for word in words[start + length :]]
    return _CommandLine(
        command,
        args,
        tokens,
        0,
        script,
        words[: start + length],
        assignments,
        entrypoint,
        arguments,
    )


def _append_part(line: _CommandLine) -> str:
    """Where flags the command line lacks are added: the shell string, args, or command."""
    if line.script is not None:
        return "script"
    return "args" if (not line.command or line.args is not None) else "command"


def _quote_assignment(word: str) -> str:
    # Quoting the whole `NAME=value` word would turn the assignment into a command name.
    name, _, value = word.partition("=")
    return f"{name}={shlex.quote(value)}"


def _plain_shell_words(script: str) -> list[str]:
    """The words of a shell string that is one plain command, split as the shell would.

    Refuses everything whose meaning a re-joined word list would not keep: operators,
    redirections, expansions, globs, comments and several lines. Line continuations are
    removed first, as the shell does.
    """
    text = script.strip()
    kept: list[str] = []
    state = _ShellState()
    index = 0
    while index < len(text):
        chunk, index = _shell_step(text, index, state)
        kept.append(chunk)
    if state.quote:
        raise _shell_error("an unterminated quote")
    words = shlex.split("".join(kept))
    if not words:
        raise UnsupportedCommandError("the shell string is empty")
    return words


@dataclass
class _ShellState:
    quote: str = ""
    word_start: bool = True


def _shell_step(text: str, index: int, state: _ShellState) -> tuple[str, int]:
    """What to keep of the text at `index` and where the next step starts."""
    char = text[index]
    following = text[index + 1 : index + 2]
    if state.quote == "'":
        state.quote = "" if char == "'" else state.quote
        return char, index + 1
    if char == "\\" and following == "\n":
        return "", index + 2
    if state.quote == '"':
        if char == "\\" and following in ("$", "`"):
            raise _shell_error("an escaped expansion character inside double quotes")
        if char in "$`":
            raise _shell_error(_expansion(char, following))
        if char == "\\":
            return text[index : index + 2], index + 2
        state.quote = "" if char == '"' else state.quote
        return char, index + 1
    if char == "\\":
        if not following:
            raise _shell_error("a trailing backslash")
        state.word_start = False
        return text[index : index + 2], index + 2
    if char in " \t":
        state.word_start = True
        return char, index + 1
    construct = _unquoted_construct(char, following, state.word_start)
    if construct is not None:
        raise _shell_error(construct)
    state.quote = char if char in "'\"" else ""
    state.word_start = False
    return char, index + 1


def _unquoted_construct(char: str, following: str, word_start: bool) -> str | None:
    """The shell construct an unquoted character starts, if any."""
    if char == "\n":
        return "several lines (more than one command)"
    if char in "&|<" and following == char:
        return {"&": "`&&`", "|": "`||`", "<": "a here-document `<<`"}[char]
    simple = {
        ";": "`;`",
        "&": "`&` (a background job)",
        "|": "a pipe `|`",
        "<": "a redirection `<`",
        ">": "a redirection `>`",
        "(": "a subshell `(`",
        ")": "a subshell `)`",
        "*": "a glob pattern `*`",
        "?": "a glob pattern `?`",
        "[": "a glob pattern `[`",
        "{": "brace expansion `{`",
        "~": "tilde expansion `~`",
    }
    if char in simple:
        return simple[char]
    if char in "$`":
        return _expansion(char, following)
    if char == "#" and word_start:
        return "a comment `#`"
    return None


def _expansion(char: str, following: str) -> str:
    if char == "`":
        return "command substitution with backticks"
    if following == "(":
        return "command substitution `$(`"
    return "parameter expansion `$`"


def _shell_error(construct: str) -> UnsupportedCommandError:
    return UnsupportedCommandError(
        f"the shell string uses {construct}, so it is not one plain command preshard can "
        "rewrite safely; run vLLM directly (command and args) or keep the shell string to a "
        "single vllm command"
    )


# A replacement of the tokens from a start index (the key of a plan) up to `end`.
_Edit = tuple[int, list[_Token]]


@dataclass(frozen=True)
class _Occurrence:
    """One use of a flag this module reads: its tokens `start:end` and its values."""

    dest: str
    start: int
    end: int
    values: tuple[str, ...]
    inline: bool
    """Written as `--flag=value` in one token."""
    option: str
    """The flag as written, before `=` (and before the `.key` of a dotted JSON flag)."""
    key: str | None = None
    """The key of a `--json-flag.key value` flag, which sets one key of the JSON."""


def _rewrite_arguments(
    tokens: Sequence[_Token],
    entrypoint: _Entrypoint,
    load: TensorizerLoad,
    append_to: str,
) -> tuple[list[_Token], str, tuple[str, ...]]:
    """vLLM's arguments (after the program) rewritten, the served model name, and the user's
    values the rewrite replaced."""
    words = [t.text for t in tokens]
    positional = bool(words) and not _is_option_like(words[0])
    by_dest = _by_dest(_scan(words, 1 if positional else 0))
    _check_refusals(by_dest, load)
    extra_config, overrides = _merged_loader_config(
        _loader_config_of(by_dest.get("model_loader_extra_config", [])), load
    )
    overrides = [*_replaced_flags(by_dest, load), *overrides]

    model, start, edit = _model(tokens, by_dest, entrypoint, positional, load)
    plan: dict[int, _Edit] = {start: edit}

    appended: list[_Token] = []
    served_occurrences = by_dest.get("served_model_name", [])
    if served_occurrences:
        served = served_occurrences[-1].values[0]
    else:
        served = model
        appended += [_Token("--served-model-name", append_to), _Token(model, append_to)]

    for dest, value in (
        ("tensor_parallel_size", str(load.tensor_parallel_size)),
        ("load_format", "tensorizer"),
        ("model_loader_extra_config", extra_config),
    ):
        flag = VLLM_OPTION_STRINGS[dest][0]
        found = by_dest.get(dest, [])
        if not found:
            appended += [_Token(flag, append_to), _Token(value, append_to)]
            continue
        first = found[0]
        value_part = tokens[first.end - 1].part
        plan[first.start] = (
            first.end,
            [_Token(flag, tokens[first.start].part), _Token(value, value_part)],
        )
        for other in found[1:]:
            plan[other.start] = (other.end, [])
    return [*_apply(tokens, plan), *appended], served, tuple(overrides)


def _by_dest(occurrences: Sequence[_Occurrence]) -> dict[str, list[_Occurrence]]:
    by_dest: dict[str, list[_Occurrence]] = {}
    for occurrence in occurrences:
        by_dest.setdefault(occurrence.dest, []).append(occurrence)
    return by_dest


def _replaced_flags(by_dest: Mapping[str, list[_Occurrence]], load: TensorizerLoad) -> list[str]:
    """The user's TP size and load format, where the rewrite replaces them with others."""
    replaced: list[str] = []
    tp = by_dest.get("tensor_parallel_size", [])
    if tp and _as_int(tp[-1].values[0]) != load.tensor_parallel_size:
        replaced.append(
            f"replaced {tp[-1].option} {_shown(tp[-1].values[0])} with "
            f"{load.tensor_parallel_size} (the shard set's TP size)"
        )
    load_format = by_dest.get("load_format", [])
    if load_format and load_format[-1].values[0] != "tensorizer":
        replaced.append(
            f"replaced {load_format[-1].option} {_shown(load_format[-1].values[0])} with tensorizer"
        )
    return replaced


def _shown(value: str) -> str:
    """A user's flag value as a message quotes it: short, on one line."""
    text = " ".join(value.split())
    return text if len(text) <= 64 else text[:61] + "..."


def _loader_config_of(found: Sequence[_Occurrence]) -> dict[str, object]:
    """The `--model-loader-extra-config` JSON vLLM reads from these flags ({} without any).

    vLLM's parser gathers every `--model-loader-extra-config.key value` into one JSON that it
    passes last, so with any dotted key the plain JSON flags do not count; without one, the
    last plain flag wins.
    """
    dotted = [o for o in found if o.key is not None]
    if dotted:
        config: dict[str, object] = {}
        for occurrence in dotted:
            key = occurrence.key or ""
            if key.endswith("+"):
                raise UnsupportedCommandError(
                    f"{occurrence.option}.{key} appends to a list in vLLM's JSON, which "
                    "preshard cannot merge safely; write the JSON out",
                    reasons.UNSUPPORTED_LOADER_CONFIG,
                )
            _merge_into(config, key.split("."), _json_or_text(occurrence.values[0]))
        return config
    if not found:
        return {}
    last = found[-1]
    try:
        parsed = json.loads(last.values[0])
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise UnsupportedCommandError(
            f"{last.option} is not a JSON object, so vLLM would not start with it",
            reasons.UNSUPPORTED_LOADER_CONFIG,
        )
    return parsed


def _json_or_text(value: str) -> object:
    try:
        parsed: object = json.loads(value)
    except ValueError:
        return value
    return parsed


def _merge_into(config: dict[str, object], keys: list[str], value: object) -> None:
    """Set one dotted key as vLLM's parser does: dicts merge, lists extend, the rest is set."""
    for key in keys[:-1]:
        inner = config.get(key)
        if not isinstance(inner, dict):
            inner = {}
            config[key] = inner
        config = inner
    last = keys[-1]
    current = config.get(last)
    if isinstance(value, dict) and isinstance(current, dict):
        for inner_key, inner_value in value.items():
            _merge_into(current, [inner_key], inner_value)
    elif isinstance(value, list) and isinstance(current, list):
        current.extend(value)
    else:
        config[last] = value


def _merged_loader_config(
    user: Mapping[str, object], load: TensorizerLoad
) -> tuple[str, list[str]]:
    """The tensorizer JSON: the user's keys merged under preshard's; and what changed of theirs.

    Keys tensorizer's loader does not accept are refused: vLLM would ignore them, so they
    most likely belong to the loader the container used before (`runai_streamer`,
    `sharded_state`, ...), and dropping them silently would hide that.
    """
    ours = _loader_config(load)
    unknown = sorted(key for key in user if key not in TENSORIZER_CONFIG_KEYS)
    if unknown:
        raise UnsupportedCommandError(
            "--model-loader-extra-config has keys vLLM's tensorizer loader does not accept ("
            + ", ".join(_shown(key) for key in unknown)
            + "): they are probably for the load format the container used before. Remove "
            f"them; the keys it accepts are {', '.join(sorted(TENSORIZER_CONFIG_KEYS))}",
            reasons.UNSUPPORTED_LOADER_CONFIG,
        )
    merged: dict[str, object] = {}
    kept: list[str] = []
    replaced: list[str] = []
    for key, value in user.items():
        if key in PRESHARD_LOADER_KEYS:
            if ours.get(key, _MISSING) != value:
                replaced.append(key)
            continue
        wanted = _MERGED_KEY_TYPES[key]
        if value is not None and not isinstance(value, wanted):
            raise UnsupportedCommandError(
                f"--model-loader-extra-config key {key} must be a JSON "
                f"{'boolean' if wanted is bool else 'object'}",
                reasons.UNSUPPORTED_LOADER_CONFIG,
            )
        if isinstance(value, dict):
            merged[key], dropped = _without_preshard_keys(key, value)
            replaced += dropped
        else:
            merged[key] = value
        kept.append(key)
    merged.update(ours)
    changes: list[str] = []
    if kept:
        changes.append(f"kept your {', '.join(sorted(kept))}")
    if replaced:
        changes.append(f"replaced your {', '.join(sorted(replaced))} with preshard's settings")
    notes = [f"--model-loader-extra-config: {'; '.join(changes)}"] if changes else []
    return _compact(merged), notes


def _without_preshard_keys(
    key: str, value: dict[str, object]
) -> tuple[dict[str, object], list[str]]:
    """A merged dict without the keys that would override preshard's, and their names."""
    clashing = sorted(k for k in value if k in _NESTED_VLLM_KEYS.get(key, frozenset()))
    if clashing:
        raise UnsupportedCommandError(
            f"--model-loader-extra-config key {key} sets {', '.join(clashing)}, which vLLM "
            "passes to tensorizer itself, so loading would fail",
            reasons.UNSUPPORTED_LOADER_CONFIG,
        )
    ours = _NESTED_PRESHARD_KEYS.get(key, frozenset())
    return (
        {k: v for k, v in value.items() if k not in ours},
        [f"{key}.{k}" for k in sorted(value) if k in ours],
    )


# The flags the rewrite sets, in the order a restore undoes them.
_RESTORED_DESTS: Final = (
    "model",
    "served_model_name",
    "tensor_parallel_size",
    "load_format",
    "model_loader_extra_config",
)


def _same_command(one: ContainerCommand, other: ContainerCommand) -> bool:
    # The API server drops an empty list, so `args: []` and no args are the same.
    return (one.command or None, one.args or None) == (other.command or None, other.args or None)


def _restorable_occurrences(line: _CommandLine) -> dict[str, list[_Occurrence]]:
    """The uses of the flags the rewrite sets, with a positional model as a `model` use."""
    words = [t.text for t in line.arguments]
    positional = bool(words) and not _is_option_like(words[0])
    by_dest = _by_dest(_scan(words, 1 if positional else 0))
    if positional:
        by_dest["model"] = [
            _Occurrence("model", 0, 1, (words[0],), False, ""),
            *by_dest.get("model", []),
        ]
    return by_dest


def _occurrence_texts(line: _CommandLine, found: Sequence[_Occurrence]) -> list[list[str]]:
    return [[t.text for t in line.arguments[o.start : o.end]] for o in found]


def _restore_loader_config(
    found: tuple[list[_Occurrence], list[_Occurrence], list[_Occurrence]],
    keep_edits: bool,
) -> tuple[str | None, bool] | None:
    """The tensorizer JSON restored key by key, where the user edited it after the patch.

    Keys still as preshard set them get their original value back (or go); keys the user
    added stay; a key preshard set that the user changed is kept with `keep_edits`. Returns
    the JSON (None: the original flags as they were written) and whether one of preshard's
    keys was kept as the user changed it; None when a JSON does not parse.
    """
    try:
        now, set_, before = (_loader_config_of(occurrences) for occurrences in found)
    except UnsupportedCommandError:
        return None
    merged: dict[str, object] = {}
    edited = False
    for key in dict.fromkeys([*before, *now, *set_]):
        value_now, value_set = now.get(key, _MISSING), set_.get(key, _MISSING)
        value_before = before.get(key, _MISSING)
        if value_now == value_set:
            value = value_before
        elif value_set == value_before or keep_edits:
            value = value_now
            edited = edited or value_set != value_before
        else:
            value = value_before
        if value is not _MISSING:
            merged[key] = value
    if merged == before:
        return None, edited
    return _compact(merged), edited


def _kept_label(dest: str, texts: list[list[str]]) -> str:
    """How a kept flag reads in a message: the flag and, for a number or a name, its value."""
    if not texts:
        return f"{VLLM_OPTION_STRINGS[dest][0]} (removed)"
    if dest in ("tensor_parallel_size", "load_format"):
        return _shown(" ".join(texts[-1]))
    if dest == "model":
        return "the model argument"
    return VLLM_OPTION_STRINGS[dest][0]


def _apply(tokens: Sequence[_Token], plan: Mapping[int, _Edit]) -> list[_Token]:
    """The tokens with each planned range replaced; every other token kept as it is."""
    result: list[_Token] = []
    index = 0
    while index < len(tokens):
        if index in plan:
            end, replacement = plan[index]
            result += replacement
            index = end
        else:
            result.append(tokens[index])
            index += 1
    return result


def _model(
    tokens: Sequence[_Token],
    by_dest: Mapping[str, list[_Occurrence]],
    entrypoint: _Entrypoint,
    positional: bool,
    load: TensorizerLoad,
) -> tuple[str, int, _Edit]:
    """The original model, and the edit that points it at the model directory."""
    options = by_dest.get("model", [])
    if len(options) > 1:
        raise UnsupportedCommandError(
            "--model is given more than once, so which model is served is ambiguous"
        )
    if positional and entrypoint == "api_server":
        raise UnsupportedCommandError(
            "the api_server module ignores a positional model and serves its default one; "
            "give the model with --model"
        )
    if positional and options:
        raise UnsupportedCommandError(
            "the model is given both as the first argument and with --model, which vLLM rejects"
        )
    if positional:
        original = tokens[0].text
        if entrypoint == "serve" and original == "serve":
            raise UnsupportedCommandError(
                "the arguments repeat `serve` after `vllm serve` (the vllm-openai image's "
                "entrypoint already is `vllm serve`), which vLLM rejects"
            )
        return original, 0, (1, [_Token(load.model_dir, tokens[0].part)])
    if not options:
        where = (
            "as the first argument after `serve` or with --model"
            if entrypoint == "serve"
            else "with --model"
        )
        raise UnsupportedCommandError(f"no model found: give the model {where}")
    option = options[0]
    original = option.values[0]
    if not original:
        raise UnsupportedCommandError("--model is empty")
    if option.inline:
        replacement = [_Token(f"{option.option}={load.model_dir}", tokens[option.start].part)]
    else:
        replacement = [
            tokens[option.start],
            _Token(load.model_dir, tokens[option.start + 1].part),
        ]
    return original, option.start, (option.end, replacement)


def _check_refusals(by_dest: Mapping[str, list[_Occurrence]], load: TensorizerLoad) -> None:
    if "config" in by_dest:
        raise UnsupportedCommandError(
            "--config reads settings from a file preshard cannot see (it may set the model, "
            "the parallelism or the load format), so the command line cannot be rewritten "
            "safely; put those settings on the command line"
        )
    if "headless" in by_dest:
        raise UnsupportedCommandError(
            "--headless starts engine workers for a server in another pod, while preshard "
            "patches the pod that serves"
        )
    for dest, why in _MUST_BE_ONE.items():
        for occurrence in by_dest.get(dest, []):
            value = occurrence.values[0]
            number = _as_int(value)
            if number is None:
                raise UnsupportedCommandError(
                    f"{occurrence.option} is {value!r}, not a number preshard can check: {why}"
                )
            if number != 1:
                raise UnsupportedCommandError(f"{occurrence.option} is {number}: {why}")
    expert_parallel = by_dest.get("enable_expert_parallel", [])
    if (
        expert_parallel
        and expert_parallel[-1].option in _EXPERT_PARALLEL_ON
        and load.tensor_parallel_size > 1
    ):
        raise UnsupportedCommandError(
            "expert parallelism gives each GPU whole experts instead of a tensor-parallel "
            "slice of every expert, which does not match the per-rank shards"
        )
    for occurrence in by_dest.get("served_model_name", []):
        if not occurrence.values[0]:
            raise UnsupportedCommandError("--served-model-name is empty")
    _check_weights(by_dest, load)


def _check_weights(by_dest: Mapping[str, list[_Occurrence]], load: TensorizerLoad) -> None:
    """Refuse a dtype or quantization other than the one the shards were written with.

    vLLM converts the stored tensors to the dtype it runs with, so a server set to another
    dtype than the shards' would serve rounded weights without a word; and a quantization
    method changes the layout of the weights it loads into. `auto` on either side is the
    model's own dtype, which preshard cannot check, and so is accepted.
    """
    dtypes = by_dest.get("dtype", [])
    if dtypes:
        written = dtypes[-1].values[0]
        wanted = _DTYPE_ALIASES.get(written, written)
        if "auto" not in (wanted, load.dtype) and wanted != load.dtype:
            raise UnsupportedCommandError(
                f"--dtype {_shown(written)} conflicts with the shards, which hold "
                f"{load.dtype} weights (serialization.dtype): vLLM would convert them. Use "
                f"--dtype {load.dtype} or auto, or set serialization.dtype (a new shard set)",
                reasons.DTYPE_CONFLICT,
            )
    methods = by_dest.get("quantization", [])
    written_method = methods[-1].values[0] if methods else None
    method = None if written_method in _NO_QUANTIZATION else written_method
    if method == load.quantization:
        return
    if load.quantization is None:
        raise UnsupportedCommandError(
            f"{methods[-1].option} {_shown(str(method))} conflicts with the shards, which are "
            "unquantized: remove it, or write shards for it with "
            f"serialization.extraEngineArgs.quantization: {_shown(str(method))} (a new shard set)",
            reasons.QUANTIZATION_CONFLICT,
        )
    given = f"--quantization {_shown(method)}" if method is not None else "no --quantization"
    raise UnsupportedCommandError(
        f"{given} conflicts with the shards, which were written with quantization "
        f"{load.quantization} (serialization.extraEngineArgs): give the container "
        f"--quantization {load.quantization}",
        reasons.QUANTIZATION_CONFLICT,
    )


def _scan(words: Sequence[str], start: int) -> list[_Occurrence]:
    """Every use of the flags this module reads, as vLLM's parser would see them."""
    found: list[_Occurrence] = []
    index = start
    while index < len(words):
        word = words[index]
        if word == "--":
            raise UnsupportedCommandError(
                "a bare `--` ends vLLM's options, so what follows it cannot be rewritten safely"
            )
        if not _is_option_like(word):
            index += 1
            continue
        written, equals, inline_value = word.partition("=")
        name = _normalise(written)
        base, dot, _ = name.partition(".")
        dest = _classify(base)
        if dest is None:
            index += 1
            continue
        if dot:
            found.append(_dotted(words, index, dest, name, inline_value if equals else None))
            index = found[-1].end
            continue
        occurrence = _occurrence(words, index, dest, written, inline_value if equals else None)
        found.append(occurrence)
        index = occurrence.end
    return found


def _dotted(
    words: Sequence[str], index: int, dest: str, name: str, inline_value: str | None
) -> _Occurrence:
    # vLLM turns `--json-flag.key value` into one key of that flag's JSON.
    base, _, key = name.partition(".")
    if dest != "model_loader_extra_config":
        raise UnsupportedCommandError(
            f"{base} is written with a `.key` suffix, which vLLM reads as JSON; preshard "
            "cannot rewrite it safely"
        )
    if inline_value is not None:
        return _Occurrence(dest, index, index + 1, (inline_value,), True, base, key)
    if index + 2 > len(words):
        raise UnsupportedCommandError(f"{words[index]} has no value")
    return _Occurrence(dest, index, index + 2, (words[index + 1],), False, base, key)


def _occurrence(
    words: Sequence[str], index: int, dest: str, written: str, inline_value: str | None
) -> _Occurrence:
    arity = _ARITY[dest]
    if arity == "none":
        if inline_value is not None:
            raise UnsupportedCommandError(f"{written} takes no value")
        return _Occurrence(dest, index, index + 1, (), False, written)
    if inline_value is not None:
        return _Occurrence(dest, index, index + 1, (inline_value,), True, written)
    end = index + 1
    while end < len(words) and not _is_option_like(words[end]):
        end += 1
        if arity == "one":
            break
    if end == index + 1:
        raise UnsupportedCommandError(f"{written} has no value")
    return _Occurrence(dest, index, end, tuple(words[index + 1 : end]), False, written)


def _classify(name: str) -> str | None:
    """The destination of a flag this module reads; refuses abbreviations of one."""
    dest = _DEST_BY_OPTION.get(name)
    if dest is not None:
        return dest
    long_name = name.startswith("--")
    if not long_name and _DEST_BY_OPTION.get(name[:2]) is not None:
        # argparse reads `-qfp8` as `-q fp8`: a value attached to a one-letter flag.
        raise UnsupportedCommandError(
            f"{name} attaches a value to {name[:2]}, a flag preshard rewrites or checks; write "
            f"it as {name[:2]} {name[2:]}"
        )
    if any(
        option != name and option.startswith(name) and option.startswith("--") == long_name
        for option in _DEST_BY_OPTION
    ):
        raise UnsupportedCommandError(
            f"{name} is an abbreviation vLLM may expand to a flag preshard rewrites or checks; "
            "spell the flag out in full"
        )
    return None


def _normalise(option: str) -> str:
    # FlexibleArgumentParser turns `_` into `-` in a long flag's name, up to the first `.`.
    if not option.startswith("--"):
        return option
    name, dot, rest = option[2:].partition(".")
    return f"--{name.replace('_', '-')}{dot}{rest}"


def _as_int(value: str) -> int | None:
    # argparse converts these flags with int(), so "01" and " 1" mean 1 as well.
    try:
        return int(value)
    except ValueError:
        return None


def _is_option_like(word: str) -> bool:
    """Whether argparse reads the word as a flag rather than as a value."""
    if not word.startswith("-") or word == "-" or _NEGATIVE_NUMBER.match(word):
        return False
    return "=" in word or " " not in word
