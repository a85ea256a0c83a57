"""Rewrite a vLLM container's command line so that it loads a tensorizer shard set.

preshard patches Deployments it does not own, so this rewrite is conservative. It recognises
the ways people start the vLLM server in Kubernetes: `vllm serve <model>` (any path to the
`vllm` script), `python -m vllm.entrypoints.openai.api_server --model <model>`,
`python -m vllm.entrypoints.cli.main serve`, `args` alone on the `vllm/vllm-openai` image, and
one plain command inside `sh -c` / `bash -c`. It changes only what decides the load (the
model directory, `--tensor-parallel-size`, `--load-format`, `--model-loader-extra-config`),
keeps the name clients use, leaves every other token as written, and refuses with a readable
sentence every command line whose effect it cannot be sure of.

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

from preshard import reasons

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
}
_DEST_BY_OPTION: Final = {
    option: dest for dest, options in VLLM_OPTION_STRINGS.items() for option in options
}
_EXPERT_PARALLEL_ON: Final = frozenset({"--enable-expert-parallel", "-ep"})

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


class UnsupportedCommandError(ValueError):
    """A command line that cannot be rewritten safely."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reason: str = reasons.UNSUPPORTED_COMMAND
        self.message: str = message


def model_loader_extra_config(load: TensorizerLoad) -> str:
    """The flat `--model-loader-extra-config` JSON: compact, keys sorted, deterministic."""
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
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


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
    tokens = _container_tokens(command, args)
    append_to = "args" if (not command or args is not None) else "command"
    script = _shell_script_index([t.text for t in tokens])
    if script is None:
        texts = [t.text for t in tokens]
        program = _match_program(texts)
        if program is None:
            raise UnsupportedCommandError(_NOT_VLLM)
        entrypoint, length = program
        rest, served = _rewrite_arguments(tokens[length:], entrypoint, load, append_to)
        tokens = [*tokens[:length], *rest]
    else:
        text, served = _rewrite_script(tokens[script].text, load)
        tokens[script] = _Token(text, tokens[script].part)
    return RewrittenCommand(
        command=[t.text for t in tokens if t.part == "command"] if command else None,
        args=_args_field(tokens, args),
        served_model_name=served,
    )


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


def _rewrite_script(script: str, load: TensorizerLoad) -> tuple[str, str]:
    """The `sh -c` string rewritten, keeping the shell form; and the served model name."""
    words = _plain_shell_words(script)
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
    rest, served = _rewrite_arguments(arguments, entrypoint, load, "script")
    command = shlex.join([*words[assignments : start + length], *(t.text for t in rest)])
    return " ".join([*(_quote_assignment(word) for word in words[:assignments]), command]), served


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
    """The flag as written, before `=`."""


def _rewrite_arguments(
    tokens: Sequence[_Token],
    entrypoint: _Entrypoint,
    load: TensorizerLoad,
    append_to: str,
) -> tuple[list[_Token], str]:
    """vLLM's arguments (after the program) rewritten, and the served model name."""
    words = [t.text for t in tokens]
    positional = bool(words) and not _is_option_like(words[0])
    occurrences = _scan(words, 1 if positional else 0)
    by_dest: dict[str, list[_Occurrence]] = {}
    for occurrence in occurrences:
        by_dest.setdefault(occurrence.dest, []).append(occurrence)
    _check_refusals(by_dest, load)

    model, start, edit = _model(tokens, by_dest, entrypoint, positional, load)
    plan: dict[int, _Edit] = {start: edit}

    appended: list[_Token] = []
    served_occurrences = by_dest.get("served_model_name", [])
    if served_occurrences:
        served = served_occurrences[-1].values[0]
    else:
        served = model
        appended += [_Token("--served-model-name", append_to), _Token(model, append_to)]

    extra_config = model_loader_extra_config(load)
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
    return [*_apply(tokens, plan), *appended], served


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
            found.append(_dotted(words, index, dest, base, bool(equals)))
            index = found[-1].end
            continue
        occurrence = _occurrence(words, index, dest, written, inline_value if equals else None)
        found.append(occurrence)
        index = occurrence.end
    return found


def _dotted(words: Sequence[str], index: int, dest: str, base: str, inline: bool) -> _Occurrence:
    # vLLM turns `--json-flag.key value` into one key of that flag's JSON.
    if dest != "model_loader_extra_config":
        raise UnsupportedCommandError(
            f"{base} is written with a `.key` suffix, which vLLM reads as JSON; preshard "
            "cannot rewrite it safely"
        )
    end = index + 1 if inline else index + 2
    if end > len(words):
        raise UnsupportedCommandError(f"{words[index]} has no value")
    return _Occurrence(dest, index, end, ("",), inline, base)


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
