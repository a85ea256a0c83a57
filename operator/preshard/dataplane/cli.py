"""The data-plane subcommands of `preshard`: serialize, reshard, verify, fetch-config, delete.

Every run ends the same way, whatever happens: one `Outcome` (compact JSON) written to the
termination log and printed on stdout, and the exit code of its reason. Flags are parsed as
text and checked here, so a bad value also ends in an `InvalidArguments` outcome.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Final, TypedDict

from preshard.contract import reasons
from preshard.contract.layout import InvalidURIError, S3Location
from preshard.contract.outcome import (
    DEFAULT_TERMINATION_LOG,
    EXIT_CODES,
    Command,
    Outcome,
    exit_code,
)
from preshard.contract.quantity import QuantityError, whole_bytes
from preshard.dataplane import logs
from preshard.dataplane.errors import DataplaneError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from preshard.dataplane.serialize import S3Clients
    from preshard.dataplane.upload import TransferSettings

TERMINATION_LOG_ENV: Final = "PRESHARD_TERMINATION_LOG"
ARTIFACT_KEY_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MESSAGE_LIMIT: Final = 1000

_COMMON_ENV = """\
environment:
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN
                        S3 credentials (or a web identity: AWS_ROLE_ARN and
                        AWS_WEB_IDENTITY_TOKEN_FILE); never passed as flags
  AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
                        the S3 endpoint when --endpoint is not given (http:// works)
  AWS_REGION, AWS_DEFAULT_REGION
                        the region when --region is not given
  AWS_CA_BUNDLE         the CA bundle when --ca-bundle is not given
  PRESHARD_TERMINATION_LOG
                        where the outcome goes when --termination-log is not given
                        (default /dev/termination-log)
  PRESHARD_PROGRESS_INTERVAL
                        seconds between progress lines (default 5)
"""


def _exit_codes(*names: str) -> str:
    lines = ["exit codes:", "  0   success"]
    for name in names:
        lines.append(f"  {EXIT_CODES[name]:<3} {name}")
    lines.append(
        f"  {EXIT_CODES[reasons.INTERNAL_ERROR]:<3} {reasons.INTERNAL_ERROR} (anything else)"
    )
    return "\n".join(lines) + "\n"


_S3_FAILURES = (reasons.ACCESS_DENIED, reasons.UNREACHABLE, reasons.BUCKET_NOT_FOUND)
_CHECK_FAILURES = (
    reasons.MANIFEST_MISSING,
    reasons.MANIFEST_INVALID,
    reasons.SHARD_MISSING,
    reasons.SIZE_MISMATCH,
    reasons.TP_MISMATCH,
)
# A command that checks a set's files against its manifest.
_READ_FAILURES = (*_CHECK_FAILURES, reasons.HASH_MISMATCH, reasons.INVALID_ARGUMENTS)


class _Terminated(BaseException):
    """SIGTERM arrived (the Job's deadline or a deletion): end with an outcome, not silently."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add serialize, reshard, verify, fetch-config and delete to the `preshard` parser."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common options")
    group.add_argument("--endpoint", metavar="URL", help="S3 endpoint URL (http:// or https://)")
    group.add_argument("--region", metavar="REGION", help="S3 region")
    group.add_argument(
        "--ca-bundle",
        metavar="PATH",
        help="PEM file of the CAs to trust for the endpoint's TLS certificate (default: "
        "$AWS_CA_BUNDLE, else boto3's public CAs)",
    )
    group.add_argument(
        "--addressing-style",
        default="auto",
        metavar="auto|path|virtual",
        help="bucket in the path or in the host name (default auto: boto3's choice)",
    )
    group.add_argument(
        "--termination-log",
        metavar="PATH",
        help="where to write the outcome (default: $PRESHARD_TERMINATION_LOG, else "
        "/dev/termination-log)",
    )
    group.add_argument(
        "--log-format", default="text", metavar="text|json", help="log line format (default text)"
    )

    def command(
        name: str,
        *,
        help: str,
        usage: str,
        description: str,
        failures: tuple[str, ...],
        environment: str = "",
    ) -> argparse.ArgumentParser:
        return subparsers.add_parser(
            name,
            parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter,
            help=help,
            usage=usage,
            description=description,
            epilog=_COMMON_ENV + environment + "\n" + _exit_codes(*failures),
        )

    serialize = command(
        "serialize",
        help="make a shard set: serialize a model with vLLM + tensorizer and upload it",
        usage="preshard serialize --model ID_OR_S3_URI [--revision REV] "
        "--tensor-parallel-size N --dtype DTYPE [--max-model-len L] [--engine-args-json JSON] "
        "--dest s3://bucket/prefix/KEY/ --artifact-key KEY --scratch-dir DIR "
        "[--encryption-keyfile PATH] [--upload-concurrency N] [--part-size BYTES] "
        "[--scratch-size-limit BYTES] [common options]",
        description=(
            "Serialize a model for tensor-parallel size N (pipeline and data parallel 1) into\n"
            "one tensorizer file per rank, model-rank-%03d.tensors, and store them in S3 with\n"
            "the model's non-weight files (config, tokenizer, generation config, ...) and a\n"
            "manifest.json written last. The model comes from the Hugging Face Hub (an id and\n"
            "revision) or from an s3:// prefix of safetensors and config files; either is\n"
            "downloaded to DIR/model first, and the rank files are written to DIR/shards.\n"
            "A destination that already holds a complete set for the same key and TP ends the\n"
            "command at once; anything else there is replaced."
        ),
        environment="  HF_TOKEN              Hugging Face token for private or gated models\n"
        "  PRESHARD_ENGINE       module:attribute of the engine (default: vLLM)\n",
        failures=(
            reasons.INVALID_ARGUMENTS,
            reasons.MODEL_NOT_FOUND,
            reasons.INSUFFICIENT_SCRATCH,
            reasons.ENCRYPTION_KEY_INVALID,
            reasons.SERIALIZATION_FAILED,
            *_S3_FAILURES,
        ),
    )
    serialize.add_argument(
        "--model", metavar="ID_OR_S3_URI", help="Hub repository id or s3:// prefix (required)"
    )
    serialize.add_argument("--revision", metavar="REV", help="Hub revision (branch, tag or commit)")
    serialize.add_argument("--tensor-parallel-size", metavar="N", help="TP size (required)")
    serialize.add_argument(
        "--dtype", metavar="DTYPE", help="auto, bfloat16, float16, ... (required)"
    )
    serialize.add_argument("--max-model-len", metavar="L", help="vLLM max_model_len")
    serialize.add_argument(
        "--engine-args-json",
        metavar="JSON",
        help='extra vLLM EngineArgs fields, e.g. \'{"quantization": "fp8"}\'',
    )
    _add_write_arguments(
        serialize,
        key_help="the shard set's key (required)",
        keyfile_help="file with the 32-byte tensorizer key",
    )
    serialize.set_defaults(run=_run_serialize)

    reshard = command(
        "reshard",
        help="make a shard set for another tensor-parallel size from a verified set, no GPU",
        usage="preshard reshard SRC_URI --to-tensor-parallel-size M "
        "--dest s3://bucket/prefix/KEY/ [--artifact-key KEY] --scratch-dir DIR "
        "[--encryption-keyfile PATH] [--upload-concurrency N] [--part-size BYTES] "
        "[--scratch-size-limit BYTES] [common options]",
        description=(
            "Read the rank files of the verified shard set at SRC_URI (made for TP N) and\n"
            "write the set vLLM itself would write for TP M: the same tensor names, shapes,\n"
            "dtypes and bytes in every rank file, without a GPU or vLLM. The rank files and\n"
            "config files are downloaded to DIR/source (each checked against its checksum), the\n"
            "new rank files written to DIR/shards one tensor at a time, then stored at --dest\n"
            "with the config files and a manifest.json, written last, that names the source.\n"
            "LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM models in float32,\n"
            "float16 or bfloat16; quantized, MoE and other models are refused\n"
            "(ReshardUnsupported). An encrypted set needs its key and is written encrypted\n"
            "with the same key. --dest ends with the artifact key (--artifact-key, default:\n"
            "its last path segment)."
        ),
        failures=(
            reasons.RESHARD_UNSUPPORTED,
            *_READ_FAILURES,
            reasons.INSUFFICIENT_SCRATCH,
            reasons.ENCRYPTION_KEY_INVALID,
            *_S3_FAILURES,
        ),
    )
    _add_uri(reshard, "SRC_URI")
    reshard.add_argument(
        "--to-tensor-parallel-size", metavar="M", help="the new set's TP size (required)"
    )
    _add_write_arguments(
        reshard,
        key_help="the new set's key (default: --dest's last segment)",
        keyfile_help="the 32-byte key of an encrypted source",
    )
    reshard.set_defaults(run=_run_reshard)

    verify = command(
        "verify",
        help="check that a shard set is complete for a tensor-parallel size",
        usage="preshard verify URI --tensor-parallel-size N [--artifact-key KEY] [--deep] "
        "[common options]",
        description=(
            "Check the shard set at URI: manifest.json present and valid, made for TP N with\n"
            "N rank files, every listed file present with its recorded size (one GET, one\n"
            "LIST); with --deep also re-read every file against its recorded checksum."
        ),
        failures=(
            *_READ_FAILURES,
            *_S3_FAILURES,
        ),
    )
    _add_uri(verify, "URI")
    verify.add_argument("--tensor-parallel-size", metavar="N", help="expected TP size (required)")
    verify.add_argument("--artifact-key", metavar="KEY", help="expected artifact key")
    verify.add_argument("--deep", action="store_true", help="also check every file's checksum")
    verify.set_defaults(run=_run_verify)

    fetch = command(
        "fetch-config",
        help="copy a shard set's config and tokenizer files into a directory",
        usage="preshard fetch-config URI DIR [--tensorizer-dir DIR] [common options]",
        description=(
            "Check that the shard set at URI is complete (sizes), then copy its non-weight\n"
            "files (config, tokenizer, ...) into DIR, checking each file's checksum. Never the\n"
            "weights: vLLM streams those from S3. DIR becomes vLLM's model directory.\n"
            "With --tensorizer-dir, also copy the tensorizer this image bundles there, for a\n"
            "vLLM image without it (the stock vllm/vllm-openai image has none)."
        ),
        failures=(
            *_READ_FAILURES,
            *_S3_FAILURES,
        ),
    )
    _add_uri(fetch, "URI")
    fetch.add_argument("directory", metavar="DIR", nargs="?", help="where to put the files")
    fetch.add_argument(
        "--tensorizer-dir",
        metavar="DIR",
        help="also copy the bundled tensorizer package here (for vLLM's PYTHONPATH)",
    )
    fetch.set_defaults(run=_run_fetch_config)

    delete = command(
        "delete",
        help="delete one shard set",
        usage="preshard delete URI [common options]",
        description=(
            "Delete the shard set at URI: manifest.json first (so a half-deleted set never\n"
            "looks complete), unfinished multipart uploads, then every object under exactly\n"
            "URI/ (s3://b/p/key never touches s3://b/p/key2/). A missing set is not an error."
        ),
        failures=(reasons.INVALID_ARGUMENTS, *_S3_FAILURES),
    )
    _add_uri(delete, "URI")
    delete.set_defaults(run=_run_delete)


def _add_uri(parser: argparse.ArgumentParser, metavar: str) -> None:
    """The shard set a command works on, as its first argument."""
    parser.add_argument("uri", metavar=metavar, nargs="?", help="s3://bucket/prefix/KEY/")


def _add_write_arguments(
    parser: argparse.ArgumentParser, *, key_help: str, keyfile_help: str
) -> None:
    """The options of a command that writes a set (see `_writes`)."""
    parser.add_argument("--dest", metavar="S3_URI", help="s3://bucket/prefix/KEY/ (required)")
    parser.add_argument("--artifact-key", metavar="KEY", help=key_help)
    parser.add_argument("--scratch-dir", metavar="DIR", help="local scratch directory (required)")
    parser.add_argument("--encryption-keyfile", metavar="PATH", help=keyfile_help)
    parser.add_argument(
        "--upload-concurrency", metavar="N", default="16", help="parallel S3 requests (default 16)"
    )
    parser.add_argument(
        "--part-size", metavar="BYTES", default="32Mi", help="multipart part size (default 32Mi)"
    )
    parser.add_argument(
        "--scratch-size-limit",
        metavar="BYTES",
        help="the scratch volume's size limit (an emptyDir sizeLimit), when free space says less",
    )


def _run_serialize(args: argparse.Namespace) -> int:
    def body() -> Outcome:
        from preshard.dataplane.engine import DTYPES, parse_engine_args  # noqa: PLC0415
        from preshard.dataplane.serialize import (  # noqa: PLC0415 - pulls in the data-plane deps
            SerializeOptions,
            serialize,
        )

        model = _required(args.model, "--model")
        tp = _positive_int(
            _required(args.tensor_parallel_size, "--tensor-parallel-size"), "--tensor-parallel-size"
        )
        dtype = _required(args.dtype, "--dtype")
        if dtype not in DTYPES:
            raise _invalid(f"--dtype {dtype!r} is not one of {', '.join(sorted(DTYPES))}")
        writes = _writes(args, key_required=True)
        options = SerializeOptions(
            model=model,
            revision=args.revision or None,
            tensor_parallel_size=tp,
            dtype=dtype,
            max_model_len=_positive_int(args.max_model_len, "--max-model-len")
            if args.max_model_len
            else None,
            engine_args=parse_engine_args(args.engine_args_json),
            **writes,
        )
        clients = _writer_clients(args, writes["transfer"])
        return serialize(options, clients)

    return _run("serialize", args, body, uri=args.dest)


def _run_reshard(args: argparse.Namespace) -> int:
    def body() -> Outcome:
        from preshard.dataplane.reshard import ReshardOptions, reshard  # noqa: PLC0415

        source = _location(_required(args.uri, "SRC_URI"), "SRC_URI")
        tp = _positive_int(
            _required(args.to_tensor_parallel_size, "--to-tensor-parallel-size"),
            "--to-tensor-parallel-size",
        )
        writes = _writes(args, key_required=False)
        options = ReshardOptions(source=source, tensor_parallel_size=tp, **writes)
        clients = _writer_clients(args, writes["transfer"])
        return reshard(options, clients)

    return _run("reshard", args, body, uri=args.dest)


class _WriteOptions(TypedDict):
    """The options of a command that writes a set, by the names its options type uses."""

    destination: S3Location
    artifact_key: str
    scratch_dir: Path
    encryption_keyfile: Path | None
    transfer: TransferSettings
    scratch_size_limit: int | None


def _writes(args: argparse.Namespace, *, key_required: bool) -> _WriteOptions:
    """Where a command writes its set and with what (`--dest`, the artifact key, scratch, the
    encryption key, the transfer settings), checked. Without `key_required` the key defaults
    to the last segment of `--dest`."""
    destination = _location(_required(args.dest, "--dest"), "--dest")
    last = destination.prefix.rsplit("/", 1)[-1]
    key = _required(args.artifact_key, "--artifact-key") if key_required else args.artifact_key
    key = key or last
    if not ARTIFACT_KEY_PATTERN.match(key):
        raise _invalid(
            f"the artifact key {key!r} must be one path segment of letters, digits, . _ -"
        )
    if last != key:
        raise _invalid(f"--dest {destination.uri} must end with the artifact key {key}")
    return _WriteOptions(
        destination=destination,
        artifact_key=key,
        scratch_dir=Path(_required(args.scratch_dir, "--scratch-dir")),
        encryption_keyfile=Path(args.encryption_keyfile) if args.encryption_keyfile else None,
        transfer=_transfer_settings(args),
        scratch_size_limit=(
            parse_size(args.scratch_size_limit, "--scratch-size-limit")
            if args.scratch_size_limit
            else None
        ),
    )


def _writer_clients(args: argparse.Namespace, transfer: TransferSettings) -> S3Clients:
    """A client for the requests botocore retries, and one for the transfers, which retry
    themselves, with a connection for each transfer in flight."""
    from preshard.dataplane.serialize import S3Clients  # noqa: PLC0415 - data-plane deps

    return S3Clients(
        control=_client(args),
        transfer=_client(
            args,
            max_connections=transfer.concurrency + 8,
            botocore_attempts=1,
            sign_payloads=False,
        ),
    )


def _run_verify(args: argparse.Namespace) -> int:
    def body() -> Outcome:
        from preshard.dataplane.commands import verify  # noqa: PLC0415 - data-plane deps

        location = _location(_required(args.uri, "URI"), "URI")
        tp = _positive_int(
            _required(args.tensor_parallel_size, "--tensor-parallel-size"), "--tensor-parallel-size"
        )
        return verify(
            _client(args),
            location,
            tensor_parallel_size=tp,
            artifact_key=args.artifact_key,
            deep=args.deep,
        )

    return _run("verify", args, body, uri=args.uri)


def _run_fetch_config(args: argparse.Namespace) -> int:
    def body() -> Outcome:
        from preshard.dataplane.commands import fetch_config  # noqa: PLC0415 - data-plane deps

        location = _location(_required(args.uri, "URI"), "URI")
        directory = Path(_required(args.directory, "DIR"))
        tensorizer_dir = Path(args.tensorizer_dir) if args.tensorizer_dir else None
        return fetch_config(_client(args), location, directory, tensorizer_dir=tensorizer_dir)

    return _run("fetch-config", args, body, uri=args.uri)


def _run_delete(args: argparse.Namespace) -> int:
    def body() -> Outcome:
        from preshard.dataplane.commands import delete  # noqa: PLC0415 - data-plane deps

        return delete(_client(args), _location(_required(args.uri, "URI"), "URI"))

    return _run("delete", args, body, uri=args.uri)


def _run(
    command: Command, args: argparse.Namespace, body: Callable[[], Outcome], *, uri: str | None
) -> int:
    log_format: logs.LogFormat = "json" if args.log_format == "json" else "text"
    with logs.configured(log_format, command), _sigterm_raises():
        started = time.monotonic()
        try:
            if args.log_format not in ("text", "json"):
                raise _invalid(f"--log-format {args.log_format!r} is not text or json")
            outcome = body()
        except DataplaneError as exc:
            logs.logger().error("%s", exc)
            outcome = Outcome(
                command=command, ok=False, reason=exc.reason, message=exc.message, uri=uri
            )
        except _Terminated:
            logs.logger().error("terminated by SIGTERM")
            outcome = Outcome(
                command=command,
                ok=False,
                reason=reasons.INTERNAL_ERROR,
                message="terminated by SIGTERM",
                uri=uri,
            )
        except Exception as exc:  # noqa: BLE001 - every failure must end in an outcome
            logs.logger().exception("unexpected failure")
            outcome = Outcome(
                command=command,
                ok=False,
                reason=reasons.INTERNAL_ERROR,
                message=f"unexpected {type(exc).__name__}: {exc}",
                uri=uri,
            )
        outcome = outcome.model_copy(
            update={
                "message": logs.redact(outcome.message)[:_MESSAGE_LIMIT],
                "seconds": round(time.monotonic() - started, 3),
            }
        )
        message = outcome.to_message()
        _write_termination_log(args.termination_log, message)
        print(message, flush=True)
        return exit_code(outcome.reason)


DATAPLANE_COMMANDS: Final = ("serialize", "reshard", "verify", "fetch-config", "delete")


def report_usage_error(command: Command, problem: str) -> int:
    """End a run whose command line does not parse the way every run ends: with an outcome.

    The flags did not parse, so the outcome goes where `PRESHARD_TERMINATION_LOG` (or the
    default) says.
    """
    outcome = Outcome(
        command=command,
        ok=False,
        reason=reasons.INVALID_ARGUMENTS,
        message=logs.redact(f"invalid command line: {problem}")[:_MESSAGE_LIMIT],
    )
    message = outcome.to_message()
    _write_termination_log(None, message)
    print(message, flush=True)
    return exit_code(outcome.reason)


def _write_termination_log(flag: str | None, message: str) -> None:
    path = Path(flag or os.environ.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG)
    try:
        path.write_text(message)
    except OSError as exc:
        logs.logger().warning("could not write the outcome to %s (%s)", path, exc.strerror)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _client(
    args: argparse.Namespace,
    *,
    max_connections: int = 16,
    botocore_attempts: int = 4,
    sign_payloads: bool = True,
) -> S3Client:
    from preshard.dataplane.s3 import ADDRESSING_STYLES, make_client  # noqa: PLC0415 - boto3

    style = next((s for s in ADDRESSING_STYLES if s == args.addressing_style), None)
    if style is None:
        raise _invalid(
            f"--addressing-style {args.addressing_style!r} is not one of "
            f"{', '.join(ADDRESSING_STYLES)}"
        )
    return make_client(
        endpoint=args.endpoint,
        region=args.region,
        max_connections=max_connections,
        botocore_attempts=botocore_attempts,
        sign_payloads=sign_payloads,
        ca_bundle=_ca_bundle(args.ca_bundle),
        addressing_style=style,
    )


def _ca_bundle(path: str | None) -> str | None:
    """The `--ca-bundle` file, checked before any request: a missing or unreadable file, or
    one without a PEM certificate, would otherwise fail every request with a library error."""
    if path is None:
        return None
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError:
        raise _invalid(f"--ca-bundle {path}: holds no PEM CA certificate") from None
    except FileNotFoundError:
        raise _invalid(f"--ca-bundle {path}: no such file") from None
    except OSError as error:
        raise _invalid(f"--ca-bundle {path}: cannot be read ({error.strerror})") from None
    return path


def _transfer_settings(args: argparse.Namespace) -> TransferSettings:
    from preshard.dataplane.upload import (  # noqa: PLC0415
        MAX_PART_SIZE,
        MIN_PART_SIZE,
        TransferSettings,
    )

    concurrency = _positive_int(args.upload_concurrency, "--upload-concurrency")
    if concurrency > 256:
        raise _invalid("--upload-concurrency must be at most 256")
    part_size = parse_size(args.part_size, "--part-size")
    if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
        raise _invalid(
            f"--part-size must be between {MIN_PART_SIZE} (5Mi) and {MAX_PART_SIZE} (5Gi) bytes"
        )
    return TransferSettings(concurrency=concurrency, part_size=part_size)


def _invalid(message: str) -> DataplaneError:
    return DataplaneError(reasons.INVALID_ARGUMENTS, message)


def _required(value: str | None, flag: str) -> str:
    if value is None or not str(value).strip():
        raise _invalid(f"{flag} is required")
    return str(value)


def _positive_int(value: str, flag: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _invalid(f"{flag} {value!r} is not a whole number") from None
    if number < 1:
        raise _invalid(f"{flag} must be at least 1")
    return number


def parse_size(value: str, flag: str) -> int:
    """A byte count given as a Kubernetes quantity (`67108864`, `64Mi`, `1e11`, `.5Ti`).

    Read by the same parser as the spec's `scratchSize` (what an `emptyDir`'s `sizeLimit`
    holds), so every size the ShardedModel accepts is accepted here.
    """
    try:
        return whole_bytes(value.strip())
    except QuantityError as error:
        raise _invalid(
            f"{flag} {value!r} is not a size in bytes (like 67108864, 64Mi or 1e11): {error}"
        ) from None


def _location(uri: str, flag: str) -> S3Location:
    try:
        return S3Location.parse(uri)
    except InvalidURIError as exc:
        raise _invalid(f"{flag}: {exc}") from exc
