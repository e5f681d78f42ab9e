"""The command line: the option table, its RAWSERVE_* variables, and its checks.

Every option is a flag and a variable (`--max-queue` is RAWSERVE_MAX_QUEUE); a flag given
beside its variable wins. `parse_config` reads both, refuses what is invalid the way
argparse does (a `rawserve: error:` line and exit code 2), and returns the frozen
`ServerConfig` (rawserve.config) the server is built from: the argparse namespace never
leaves this module.

Server process; standard library and the checks of the values' own modules only.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import socket
import sys
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from rawserve import __version__
from rawserve.api.settings import AppSettings
from rawserve.config import Batching, ModelConfig, ServerConfig, Tls, onnx_unfit_here
from rawserve.http.cors import browser_origin
from rawserve.http.limits import ProtocolSettings
from rawserve.http.tls import server_context
from rawserve.models.folder import TASK_ALIASES
from rawserve.models.names import ModelNameError, is_folder, parse_model_spec
from rawserve.models.sentence_folder import POOLING_MODES
from rawserve.ops import layout
from rawserve.ops.health_probe import DEFAULT_PORT, SAGEMAKER_COMMAND, SAGEMAKER_PORT
from rawserve.ops.loops import LOOPS, chosen_loop
from rawserve.shared import installed
from rawserve.shared.devices import CoreCount, core_count, parse_devices
from rawserve.shared.logs import LOG_FORMATS, LOG_LEVELS, without_credentials
from rawserve.shared.messages import Engine

# Batch limits by device. A CPU's cost grows with the items, and 32 keeps a batch's time
# short; a GPU's throughput doubles from 64 to 256 items (an H100, BERT-base: the issue's
# figures), so it gets hundreds, bounded by tokens (what its cost follows): TEI's budget.
CPU_MAX_BATCH_SIZE = 32
GPU_MAX_BATCH_SIZE = 256
GPU_MAX_BATCH_TOKENS = 16_384
# The queue holds a few of the device's batches: on a GPU 256 items were one batch, and
# 64 clients sending lists of 32 texts were refused half the time (bench/RESULTS.md).
CPU_MAX_QUEUE = 256
GPU_MAX_QUEUE = 4096
# One Python process speaks HTTP at ~4,000 requests/s. On a GPU machine the cores are
# free for more (an H100's 16 cores, echo handler: 3,895 / 10,111 / 16,512 req/s at 1 / 4
# / 8 processes, 19,072-19,345 at 8 and 16 in another run; BERT-base at 64 clients 1,253
# -> 1,809/s with 4; at 3x overload, 15,000 requests/s offered, 4 processes were the
# queue: refusals took 2.6 s at p99); on a CPU they belong to the model workers (2 cores:
# 2 processes gained nothing), so one does both there. Half the cores leave the rest to
# the serving process, the worker feeding the GPU and its tokenizer's threads.
GPU_HTTP_PROCESSES = 8

# The longest deadline a request may ask for by default; a longer --timeout raises it.
DEFAULT_MAX_TIMEOUT = 300.0

DTYPES = ("auto", "float32", "float16", "bfloat16")
# the options that take one of a few words
# --pooling's modes: sentence-transformers' own, and SPLADE's; TEI's names of them too
POOLING_CHOICES = (*sorted(POOLING_MODES), "splade")
POOLING_NAMES = {"last-token": "lasttoken", "last_token": "lasttoken"}
CHOICES = ("engine", "dtype", "batching", "generation", "loop", "log_format", "log_level")
# the largest whole number an option takes: /info's JSON readers keep it exact
MAX_WHOLE_NUMBER = 2**53
# the largest a time option takes (seconds, or --max-batch-delay-ms' milliseconds): about
# 116 days (--timeout 1e308 was taken, and the scheduler's budget of tokens for a deadline
# came to infinity: every request after the first two 500)
MAX_TIME = 10**7
# the shortest silence a stream's keep-alive comment may end: a comment is to keep idle
# proxies from closing the stream, which none does within a tenth of a second
MIN_STREAM_KEEPALIVE = 0.1
# --handler: a module the worker imports, and the factory in it (`handler` if not named)
HANDLER_SPEC = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*(:([^\W\d]\w*)?)?")
ENV_TRUE = ("1", "true", "yes", "on")
ENV_FALSE = ("", "0", "false", "no", "off")
# huggingface_hub reads these with int() as it is imported: another value (even an empty
# one) ended the server's start in its traceback, before anything was checked
HUB_SECONDS_VARIABLES = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
# the longest of those waits the HTTP client can hold (past about 9e9 s it overflows)
MAX_HUB_SECONDS = 2**31 - 1
KEY_VARIABLE = "RAWSERVE_API_KEY"  # empty, still a value: see `variable_value`
# Options of one value whose second reads as a second device or key (they ran on one GPU,
# refused the first key, without a word): what to do instead
READ_AS_SEVERAL = {
    "--device": "several devices are one comma list (--device cuda:0,cuda:1)",
    "--api-key": "the server takes one key",
}
# huggingface_hub's token variables, the first set taken
HUB_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# The largest --max-batch-size: a start warms up on one batch of it (a million items of a
# tiny model was never ready; 50,000 took 7 s); a GPU's batches are hundreds of items
MAX_BATCH_SIZE = 65536


@dataclass(frozen=True)
class Option:
    flag: str
    type: type
    default: object
    help: str
    repeatable: bool = False  # given several times; its variable is a comma-separated list

    @property
    def dest(self) -> str:
        """Its name on argparse's namespace."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "RAWSERVE_" + self.dest.upper()


MODEL_HELP = (
    "[ALIAS=]MODEL[@REVISION][:TASK], repeatable: MODEL is a local folder or a Hub repo id "
    "(org/name), REVISION a Hub branch, tag or commit, TASK the pipeline task where the "
    "model's files do not say it, ALIAS the name clients use for it; the first model is the "
    "default. E.g. --model emb=BAAI/bge-small-en-v1.5 --model cls=/models/sst2:text-"
    "classification (default: the packaged all-MiniLM-L6-v2)"
)

OPTIONS = [
    Option("--model", str, None, MODEL_HELP, repeatable=True),
    Option("--revision", str, None, "Hub revision of the models named without @REVISION"),
    Option(
        "--task",
        str,
        None,
        "pipeline task of the models named without :TASK (default: inferred from the files)",
    ),
    Option(
        "--pooling",
        str,
        None,
        "how the feature-extraction models pool their token vectors, in place of what their "
        "files say (TEI's --pooling): cls, mean, max, lasttoken, weightedmean, "
        "mean_sqrt_len_tokens, or splade (a masked language model served as a sparse "
        "encoder: /embed_sparse)",
    ),
    Option(
        "--handler",
        str,
        None,
        "MODULE[:FACTORY]: serve what FACTORY() returns (FACTORY default: handler), "
        "f(inputs: list, **params) -> list",
    ),
    Option("--host", str, "127.0.0.1", "bind address"),
    Option("--port", int, DEFAULT_PORT, "bind port"),
    Option(
        "--device",
        str,
        None,
        "cpu, cuda, cuda:N, mps, auto (a GPU where torch sees one), or a comma list: one worker "
        "per entry (default: one worker, on the first GPU; on a CPU machine one "
        "single-threaded worker per core it may run on, as memory allows, or for an "
        "encoder model one worker with every core where a first start measures it faster)",
    ),
    Option(
        "--engine",
        str,
        "auto",
        "torch, onnx (ONNX Runtime, the `onnx` extra: encoder tasks on the CPU), or auto: "
        "where both serve the task, the faster on this machine by a short trial at the "
        "first start (cached), else torch",
    ),
    Option("--dtype", str, "auto", "auto, float32, float16 or bfloat16"),
    Option(
        "--threads",
        int,
        None,
        "torch threads per worker, at most the cores; without --device, one worker per that "
        "many cores (default: the CPU workers split the cores evenly)",
    ),
    Option(
        "--max-batch-size",
        int,
        None,
        f"items per model call (default: {CPU_MAX_BATCH_SIZE}; {GPU_MAX_BATCH_SIZE} on a GPU, "
        "where a batch's cost follows its tokens)",
    ),
    Option(
        "--no-warmup",
        bool,
        False,
        "report ready without first running a batch of --max-batch-size examples (at most "
        "--max-queue)",
    ),
    Option(
        "--no-cuda-graphs",
        bool,
        False,
        "on a GPU, run the forward pass as it is, not replayed from CUDA graphs (an "
        "encoder's per padded batch shape; a causal LM's decoding steps and short prefills)",
    ),
    Option(
        "--max-batch-delay-ms",
        float,
        0.0,  # measured: any delay adds itself at low load, buys nothing (bench/RESULTS.md)
        "how long a free worker may wait for a batch to fill, from the oldest item",
    ),
    Option(
        "--max-batch-tokens",
        int,
        None,
        "token budget of a batch (padded length x items; default: none, "
        f"{GPU_MAX_BATCH_TOKENS} on a GPU: TEI's)",
    ),
    Option(
        "--batching",
        str,
        "cost",
        "cost: batches planned by input length and measured call cost; count: deadline order",
    ),
    Option(
        "--generation",
        str,
        "continuous",
        "text generation on a causal LM: continuous (sequences join and leave the running "
        "batch between decoding steps) or static (one generate call per batch)",
    ),
    Option(
        "--max-sequences",
        int,
        None,
        "continuous generation: sequences a worker runs at once (default: 256 on a GPU, 64 "
        "on a CPU)",
    ),
    Option(
        "--join-wait-steps",
        int,
        0,
        "continuous generation: decoding steps a request that comes while others run may "
        "wait for more to join it in one prefill (as TGI's --max-waiting-tokens): fewer "
        "passes where a prefill costs what a step does (a GPU), a later first token "
        "(default: 0, each joins at the next step)",
    ),
    Option(
        "--max-queue",
        int,
        None,
        f"queued items; beyond it: 503 (default: {CPU_MAX_QUEUE}; {GPU_MAX_QUEUE} on a GPU)",
    ),
    Option(
        "--max-client-batch-size", int, 32, "inputs allowed in one request (TEI's name); more: 413"
    ),
    Option("--timeout", float, 30.0, "default request deadline in seconds"),
    Option(
        "--max-timeout",
        float,
        None,
        "the longest deadline X-Request-Timeout may ask for, not below --timeout (default: "
        f"{DEFAULT_MAX_TIMEOUT:.0f}, or --timeout where longer)",
    ),
    Option("--max-body-bytes", int, 1024 * 1024, "largest accepted request body; beyond it: 413"),
    Option(
        "--max-connections",
        int,
        1000,
        "open connections, each HTTP process taking an equal share (the cap / N rounded "
        "up); past its share the one idle longest (a second at least) is closed, or where "
        "none is the new one is answered 503 (0: no cap)",
    ),
    Option(
        "--stream-keepalive",
        float,
        15.0,
        "seconds a stream may stay silent before it is sent a `: keep-alive` comment, at "
        "least 0.1 (0: never)",
    ),
    Option("--keepalive-timeout", float, 5.0, "seconds an idle keep-alive connection stays open"),
    Option("--head-timeout", float, 10.0, "seconds to receive a request's head; beyond: 408"),
    Option("--body-timeout", float, 30.0, "seconds to receive a request's body; beyond: 408"),
    Option(
        "--write-timeout",
        float,
        30.0,
        "seconds an answer may wait for room to be written (its client reads slower than "
        "it comes, or not at all) before the connection is cut",
    ),
    Option(
        "--api-key",
        str,
        None,
        "every route but /health, /ready, /ready/<model>, /ping and /metrics needs "
        "Authorization: Bearer KEY (else 401)",
    ),
    Option(
        "--chat-template",
        str,
        None,
        "a Jinja chat template FILE for /v1/chat/completions: for a tokenizer that has none; "
        "it replaces the own template of every generation model served",
    ),
    Option("--ssl-certfile", str, None, "TLS: the certificate chain (PEM; may hold the key too)"),
    Option("--ssl-keyfile", str, None, "TLS: the private key (PEM), when not in --ssl-certfile"),
    Option(
        "--cors-allow-origin",
        str,
        None,
        "a browser origin that may call the API, as https://app.example (repeatable; * for "
        "any): answers preflight OPTIONS and adds the CORS headers",
        repeatable=True,
    ),
    Option(
        "--grace",
        float,
        30.0,
        "seconds to drain on SIGTERM/SIGINT/SIGHUP; then what is left gets 503, busy workers are "
        "killed, and the server exits within 2 s",
    ),
    Option(
        "--batch-timeout", float, 120.0, "seconds a batch may run before its worker is restarted"
    ),
    Option(
        "--http-processes",
        int,
        None,
        "processes that speak HTTP (connections, parsing, JSON) beside the one serving "
        "process that schedules and feeds the workers; 1: one process does both (default: "
        f"1; on a GPU half the cores, at most {GPU_HTTP_PROCESSES})",
    ),
    Option(
        "--loop", str, "auto", "the event loop: auto (uvloop where installed), asyncio or uvloop"
    ),
    Option("--log-level", str, "info", "debug, info, warning, error or critical"),
    Option("--log-format", str, "text", "text (one line per event) or json (one object a line)"),
    Option("--no-access-log", bool, False, "do not log a line per request"),
    Option(
        "--thinking-in-content",
        bool,
        False,
        "leave a reasoning model's thinking in its chat answers' content (and Responses' "
        "output_text), tags and all, rather than apart in reasoning_content (a reasoning item)",
    ),
    Option(
        "--download-only",
        bool,
        False,
        "resolve every --model (downloading Hub models into the cache) and exit",
    ),
]


def finite_number(text: str) -> float:
    """A number option's value: `nan` and `inf` pass every `<= 0` check and would then
    leave requests unanswered (a deadline of nan never comes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def whole_number(text: str) -> bool:
    """Whether `int()` reads `text`."""
    try:
        int(text)
    except ValueError:
        return False
    return True


# text options whose empty value is refused in words of their own (parse_config)
SAY_EMPTY_THEMSELVES = frozenset({"--host", "--revision", "--api-key"})


def given_text(value: str) -> str:
    """A text option's value; an empty one is refused, not read as the option left out:
    `--ssl-certfile "$CERT"` with CERT unset served plain HTTP without a word, and
    `--handler ''` the default model."""
    if not value.strip():
        raise argparse.ArgumentTypeError("empty (leave the option out for its default)")
    return value


def naming_the_variable(
    convert: Callable[[str], Any], env: str, text: str | None
) -> Callable[[str], Any]:
    """`convert`, whose error for the variable's own value (argparse converts a text
    default only when the flag is not given) names the variable, not just the flag."""
    if text is None:
        return convert

    def checked(value: str) -> Any:
        try:
            return convert(value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            if value is not text:
                raise
            if isinstance(exc, argparse.ArgumentTypeError):
                reason = str(exc)
            else:
                reason = "not a whole number" if convert is int else "invalid value"
            raise argparse.ArgumentTypeError(f"{env}={text!r}: {reason}") from None

    checked.__name__ = convert.__name__  # argparse's "invalid int value" for the flag's own
    return checked


class OneLineParser(argparse.ArgumentParser):
    """An invalid option is one line, `rawserve: error: ...`, and exit code 2: argparse's
    usage before it runs to twenty lines that bury the line that matters (--help has it).
    A line about an option its variable set says so (`given`: the command line)."""

    given: Sequence[str] = ()
    # the switch variables' bad values, by flag, refused once the command line is read
    # (--help and --version are answered whatever the environment holds) where the flag
    # is not given: beside its flag, a variable is not read
    refused_later: dict[str, str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused_later = {}

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self._set_by(message)}\n")

    def typed(self, flag: str) -> bool:
        """Whether `flag` is on the command line (`--flag VALUE` or `--flag=VALUE`)."""
        return self.times_typed(flag) > 0

    def times_typed(self, flag: str) -> int:
        return sum(arg == flag or arg.startswith(flag + "=") for arg in self.given)

    def _set_by(self, message: str) -> str:
        """The words " (set by RAWSERVE_X=...)" for the first option the message names
        that was not on the command line and whose variable is set: a user who typed no
        --model was told to give no --model with --handler (a deployment's RAWSERVE_MODEL)."""
        by_flag = {option.flag: option for option in OPTIONS}
        for named in re.findall(r"--[a-z][a-z-]*", message):
            option = by_flag.get(named)
            if option is None or message.startswith(option.env):
                continue
            value = variable_value(option.env)  # (empty: read as unset)
            if not self.typed(option.flag) and value is not None:
                shown = "..." if option.env == KEY_VARIABLE else repr(value[:100])
                return f" (set by {option.env}={shown})"
        return ""


# Where SageMaker unpacks a model's files (its ModelDataUrl), and the variables Hugging
# Face's SageMaker images (TGI's, TEI's, the inference toolkit's) read the model from
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
SAGEMAKER_MODEL_VARIABLES = {
    "model": "HF_MODEL_ID",
    "revision": "HF_MODEL_REVISION",
    "task": "HF_TASK",
}


def sagemaker_model(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    model_dir: Path = SAGEMAKER_MODEL_DIR,
) -> None:
    """The model `serve` serves where neither --model nor RAWSERVE_MODEL names one (nor
    --handler serves its own code, which may read /opt/ml/model itself), as Hugging
    Face's SageMaker images find it: HF_MODEL_ID (with HF_MODEL_REVISION for a Hub id,
    and HF_TASK, where --revision and --task are not given), else the files SageMaker
    unpacked into /opt/ml/model; else the default model, as ever."""
    if args.handler or args.model is not None or variable_value("RAWSERVE_MODEL") is not None:
        return
    named = {
        key: os.environ.get(name, "").strip() for key, name in SAGEMAKER_MODEL_VARIABLES.items()
    }
    if named["model"]:
        args.model = [named["model"]]
    elif (model_dir / "config.json").is_file():
        args.model = [str(model_dir)]
    elif model_dir.is_dir() and any(model_dir.iterdir()):
        parser.error(
            f"{model_dir} holds files but no model at its top (its config.json): name the "
            "model's folder in HF_MODEL_ID or RAWSERVE_MODEL"
        )
    elif named["task"]:  # the default model would be served, the task unsaid
        parser.error(
            f"HF_TASK={named['task']!r} names a task but no model: set HF_MODEL_ID, or put "
            f"the model's files in {model_dir}"
        )
    else:
        return
    # (a task not served is refused where --task's is: an ERROR line and exit code 1)
    task = TASK_ALIASES.get(named["task"], named["task"])
    if task and not args.task and variable_value("RAWSERVE_TASK") is None:
        args.task = task
    hub_id = not is_folder(args.model[0])  # (a folder has no revisions)
    if (
        named["revision"]
        and hub_id
        and not args.revision
        and variable_value("RAWSERVE_REVISION") is None
    ):
        args.revision = named["revision"]


def endpoint_fault(endpoint: str) -> str | None:
    """What is wrong with HF_ENDPOINT as an address of a Hub or mirror, or None: read as
    huggingface_hub is imported, a port out of range ended the start in its traceback,
    even with the model cached (and it takes blanks around it as part of it)."""
    if endpoint != endpoint.strip():
        return "blanks around the address (a newline from a file, say): remove them"
    try:
        parts = urllib.parse.urlsplit(endpoint)
        parts.port  # noqa: B018 - raises ValueError for a port that is none
    except ValueError as exc:
        return f"not an address ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http:// or https:// address of a Hub or mirror (unset it for the Hub)"
    return None


def sagemaker_port(parser: OneLineParser) -> int:
    """The port SageMaker calls a container on: SAGEMAKER_BIND_TO_PORT, else 8080."""
    named = os.environ.get("SAGEMAKER_BIND_TO_PORT", "").strip()
    if not named:
        return SAGEMAKER_PORT
    if not whole_number(named) or not 1 <= int(named) <= 65535:
        parser.error(f"SAGEMAKER_BIND_TO_PORT={named!r}: not a port number (1 to 65535)")
    return int(named)


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        allow_abbrev=False,  # `--max-queu 5` set --max-queue; a misspelled variable is warned of
        prog="rawserve",
        description="Serve a Hugging Face transformers pipeline over HTTP/1.1. "
        "Every option can also be set as RAWSERVE_<OPTION>, e.g. RAWSERVE_PORT=8000.",
        epilog="`rawserve serve [OPTIONS]` starts it as SageMaker starts a container: on "
        "port 8080 (or SAGEMAKER_BIND_TO_PORT) unless --port or RAWSERVE_PORT says, "
        "serving HF_MODEL_ID (HF_MODEL_REVISION, HF_TASK) or the files in /opt/ml/model "
        "where no --model names one.",
    )
    for option in OPTIONS:
        if option.type is bool:  # a switch; its variable is 1/true/yes/on or 0/false/no/off
            value = os.environ.get(option.env, "").strip().lower()
            if value not in ENV_TRUE + ENV_FALSE:
                named = ", ".join(word for word in ENV_TRUE + ENV_FALSE if word)
                refusal = f"{option.env} must be one of {named}, or empty"
                parser.refused_later[option.flag] = refusal
            help = f"{option.help} [env {option.env}=1]"
            parser.add_argument(
                option.flag, action="store_true", default=value in ENV_TRUE, help=help
            )
            continue
        if option.repeatable:  # given flags replace the variable's list (read in parse_config)
            help = f"{option.help} [env {option.env}=A,B]"
            parser.add_argument(option.flag, type=option.type, action="append", help=help)
            continue
        variable = variable_value(option.env)
        default = option.default if variable is None else variable
        base: Callable[[str], Any] = finite_number if option.type is float else option.type
        if option.type is str and option.flag not in SAY_EMPTY_THEMSELVES:
            base = given_text
        convert = naming_the_variable(base, option.env, variable)
        # the key is a secret: --help output is pasted into tickets and CI logs
        secret = option.env == KEY_VARIABLE
        shown = (
            ""
            if default is None or secret or "default:" in option.help
            else f" (default: {default})"
        )
        parser.add_argument(
            option.flag,
            type=convert,
            default=default,
            help=f"{option.help}{shown} [env {option.env}]",
        )
    parser.add_argument("--version", action="version", version=f"rawserve {__version__}")
    return parser


def misspelled_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each RAWSERVE_* variable that names no option but nearly names one
    (RAWSERVE_MAX_QUEU): a mistyped flag is refused, a mistyped variable was silently
    ignored, its setting looking applied. Others are left alone (a handler may read
    variables of its own)."""
    known = [option.env for option in OPTIONS]
    lines = []
    for name in sorted(environ):
        if not name.startswith("RAWSERVE_") or name in known or name in OTHER_VARIABLES:
            continue
        if close := difflib.get_close_matches(name, known, n=1, cutoff=0.85):
            lines.append(f"{name} is set but names no option (ignored): {close[0]}?")
    return lines


# variables of rawserve's own that are not options
OTHER_VARIABLES = ("RAWSERVE_CACHE_DIR",)


HANDLER_IGNORES: dict[str, Callable[[argparse.Namespace], bool]] = {
    "--task": lambda args: bool(args.task),
    "--pooling": lambda args: bool(args.pooling),
    "--revision": lambda args: bool(args.revision),
    "--chat-template": lambda args: bool(args.chat_template),
}


def ignored_by_the_handler(config: ServerConfig) -> list[str]:
    """The model options set (here or in the environment) that a handler's workers do not
    read, for a warning (not refused: a deployment sets RAWSERVE_ENGINE for every server)."""
    if not config.handler:
        return []
    model = config.model
    set_here = {"--engine": model.engine is not Engine.AUTO, "--dtype": model.dtype != "auto"}
    return [flag for flag, given in set_here.items() if given] + generation_options(model)


def generation_options(model: ModelConfig) -> list[str]:
    """The text-generation options set (here or in the environment), for a warning where
    no model they apply to is served."""
    set_here = {
        "--generation": model.generation != "continuous",
        "--max-sequences": model.max_sequences is not None,
        "--join-wait-steps": model.join_wait_steps != 0,
    }
    return [flag for flag, given in set_here.items() if given]


def continuous_options(model: ModelConfig) -> list[str]:
    """The continuous batching options set beside `--generation static`, which reads
    none of them, for a warning."""
    unread = generation_options(model) if model.generation == "static" else []
    return [flag for flag in unread if flag != "--generation"]


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """The checked configuration of `argv` (sys.argv when None) and the RAWSERVE_*
    variables; on an invalid value, the error line and exit code 2 (SystemExit)."""
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # SageMaker starts a container as `docker run IMAGE serve` and calls it on port 8080
    # (or the one SAGEMAKER_BIND_TO_PORT names): the image's entrypoint takes the word
    sagemaker = given[:1] == [SAGEMAKER_COMMAND]
    parser.given = given = given[1:] if sagemaker else given
    args = parser.parse_args(given)
    for flag, refusal in parser.refused_later.items():
        if not parser.typed(flag):
            parser.error(refusal)
    # argparse keeps the last of an option's values, as a wrapper's defaults overridden by
    # its user's want; where a second reads as "and this one too", it is refused
    for flag, instead in READ_AS_SEVERAL.items():
        if (times := parser.times_typed(flag)) > 1:
            parser.error(f"{flag} is given {times} times: {instead}")
    if sagemaker and not parser.typed("--port") and variable_value("RAWSERVE_PORT") is None:
        args.port = sagemaker_port(parser)
    if sagemaker:
        sagemaker_model(args, parser)
    for name in CHOICES:  # a word's case or blanks are no mistake (--device takes any)
        setattr(args, name, getattr(args, name).strip().lower())
    # One fixed order of checks: a command line with several mistakes is told the first.
    for variable in HUB_SECONDS_VARIABLES:
        if (text := os.environ.get(variable)) is not None and not (
            whole_number(text) and 1 <= int(text) <= MAX_HUB_SECONDS
        ):
            parser.error(
                f"{variable}={text!r}: not a whole number of seconds from 1 to {MAX_HUB_SECONDS}"
            )
    if (endpoint := os.environ.get("HF_ENDPOINT")) is not None:
        # huggingface_hub reads it as it is imported, blanks included: set empty (as
        # compose files leave a variable) it is unset here, as RAWSERVE_* variables are
        if not endpoint.strip():
            del os.environ["HF_ENDPOINT"]
        elif fault := endpoint_fault(endpoint):
            parser.error(f"HF_ENDPOINT={without_credentials(endpoint)[:100]!r}: {fault}")
    for variable in HUB_TOKEN_VARIABLES:  # an HTTP header's: no request went out
        token = os.environ.get(variable, "").replace("\r", "").replace("\n", "").strip()
        if not (token.isascii() and token.isprintable()):  # (as huggingface_hub cleans it)
            parser.error(f"{variable} holds a character no token has (beyond printable ASCII)")
    try:
        models = flags_or_variable(args.model, "RAWSERVE_MODEL")
        origins = flags_or_variable(args.cors_allow_origin, "RAWSERVE_CORS_ALLOW_ORIGIN")
    except ValueError as exc:
        parser.error(str(exc))
    for text in models:  # a name that cannot be read is a usage error, before any look-up
        try:
            parse_model_spec(text)
        except ModelNameError as exc:
            parser.error(f"--model {without_credentials(text)!r}: {exc}")  # (a URL's)
    if args.handler and models:
        parser.error("--handler serves its own callable: give no --model with it")
    if args.handler and args.download_only:
        parser.error("--download-only fetches a model: a --handler has none to fetch")
    # what a handler does not read: silently ignored, it would look honoured
    unread = [flag for flag, given in HANDLER_IGNORES.items() if args.handler and given(args)]
    if unread:
        parser.error(f"--handler serves its own callable: {', '.join(unread)} would not apply")
    if args.handler and not HANDLER_SPEC.fullmatch(args.handler):
        parser.error(
            f"--handler {args.handler!r} is not MODULE or MODULE:FACTORY "
            "(a dotted module name, and a name in it)"
        )
    if args.handler:  # "shout:" is "shout" (served as "shout:", its route was /models/shout:)
        args.handler = args.handler.removesuffix(":")
    try:
        engine = Engine(args.engine)
    except ValueError:
        engine = Engine.HANDLER
    if engine is Engine.HANDLER:  # (what a loaded handler's workers say, not an option)
        parser.error("--engine must be torch, onnx or auto")
    devices = None  # settled with the models (rawserve.config.plan_workers)
    if args.device:  # no --device (or RAWSERVE_DEVICE empty): the default layout
        try:
            devices = tuple(parse_devices(args.device, os.environ.get("CUDA_VISIBLE_DEVICES")))
        except ValueError as exc:  # (named, as every option's: its variable may set it)
            parser.error(f"--device: {exc}")
    gpu = layout.on_gpu(devices, handler=bool(args.handler))
    args.max_batch_size, args.max_batch_tokens, batch_limits = batch_defaults(
        args.max_batch_size, args.max_batch_tokens, gpu
    )
    if args.max_queue is None:
        args.max_queue = GPU_MAX_QUEUE if gpu else CPU_MAX_QUEUE
    cores = core_count()
    if args.http_processes is None:
        args.http_processes = http_processes_default(gpu, cores.cores)
    check_values(args, parser, cores)
    if engine is Engine.ONNX and not args.handler:  # (a handler's engine is its own)
        unfit = onnx_unfit_here(devices, args.dtype, lambda: gpu)
        if unfit:
            parser.error(f"--engine onnx: {unfit}")
    http = ProtocolSettings(
        max_body_bytes=args.max_body_bytes,
        # each HTTP process counts its own connections: a share each keeps the whole cap
        max_connections=-(-args.max_connections // args.http_processes),
        keepalive_timeout=args.keepalive_timeout,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
    )
    chat_template = read_chat_template(args.chat_template, parser)
    tls = load_tls(args.ssl_certfile, args.ssl_keyfile, parser)
    origins = [checked_origin(origin, parser) for origin in origins]
    return ServerConfig(
        models=tuple(models),
        revision=args.revision,
        task=args.task,
        pooling=pooling_named(args.pooling, parser),
        handler=args.handler,
        model=ModelConfig(
            device=args.device or None,
            devices=devices,
            engine=engine,
            dtype=args.dtype,
            threads=args.threads,
            warmup=not args.no_warmup,
            cuda_graphs=not args.no_cuda_graphs,
            chat_template=chat_template,
            max_batch_size=args.max_batch_size,
            max_batch_delay_ms=args.max_batch_delay_ms,
            max_batch_tokens=args.max_batch_tokens,
            batch_limits=batch_limits,
            batching=Batching(args.batching),
            generation=args.generation,
            max_sequences=args.max_sequences,
            join_wait_steps=args.join_wait_steps,
            max_queue=args.max_queue,
            batch_timeout=args.batch_timeout,
        ),
        host=args.host,
        port=args.port,
        tls=tls,
        http=http,
        app=AppSettings(
            timeout=args.timeout,
            max_timeout=args.max_timeout,
            api_key=args.api_key,
            max_client_batch_size=args.max_client_batch_size,
            cors_allow_origins=tuple(origins),
            stream_keepalive=args.stream_keepalive or None,
            thinking_in_content=args.thinking_in_content,
        ),
        grace=args.grace,
        http_processes=args.http_processes,
        loop=chosen_loop(args.loop),
        log_level=args.log_level,
        log_format=args.log_format,
        access_log=not args.no_access_log,
        download_only=args.download_only,
    )


def set_by_note(flag: str, argv: Sequence[str] | None = None) -> str:
    """The words " (set by RAWSERVE_X=...)" where `flag` is not on the command line
    (`argv`, else sys.argv's) and its variable set it, for a refusal said after the
    parse."""
    parser = OneLineParser()
    parser.given = list(sys.argv[1:] if argv is None else argv)
    return parser._set_by(flag)


def device_unservable(
    devices: Sequence[str] | None, torch_version: str | None = None
) -> str | None:
    """Why the installed torch cannot serve a device of `devices` (--device parsed), as
    far as its distribution's version says without importing it (a CPU build's `+cpu`),
    where a worker would refuse it once torch is imported: said before the port is
    taken, not after a server that could never serve had answered for seconds. None
    where it may."""
    devices = devices or ()
    torch_version = torch_version or installed.version("torch") or ""
    gpus = [device for device in devices if device.startswith("cuda")]
    if gpus and torch_version.endswith("+cpu"):
        return (
            f"--device {gpus[0]}: torch {torch_version} is a build without CUDA: install a "
            "CUDA build of torch, or serve with --device cpu"
        )
    if "mps" in devices and sys.platform != "darwin":
        return "--device mps is an Apple GPU, on macOS only: serve with --device cpu"
    return None


def check_values(
    args: argparse.Namespace, parser: argparse.ArgumentParser, cores: CoreCount
) -> None:
    """Refuse, as argparse does, the first option whose value is out of its range or not
    one of its choices (`cores`: those this process may use, which bound --http-processes
    and --threads)."""
    allowed = f"the cores this process may use ({cores.source})"
    for name in ("max_batch_size", "max_queue", "max_client_batch_size", "max_body_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.revision is not None and not args.revision.strip():  # as `org/name@` is
        parser.error("--revision is empty: name a branch, tag or commit, or leave it out")
    if args.max_batch_size > MAX_BATCH_SIZE:  # the warm-up runs one such batch before ready
        parser.error(f"--max-batch-size must be at most {MAX_BATCH_SIZE:,}")
    if not 0 <= args.port <= 65535:  # the socket would take it modulo 65536
        parser.error("--port must be from 0 (any free port) to 65535")
    # each message names the option at fault alone: one naming two sent a user with an
    # empty RAWSERVE_API_KEY to look at --max-connections
    for wrong, message in (
        (args.batch_timeout <= 0, "--batch-timeout must be positive"),
        (args.grace < 0, "--grace must not be negative"),
        (args.timeout <= 0, "--timeout must be positive"),
        (args.max_batch_delay_ms < 0, "--max-batch-delay-ms must not be negative"),
        (args.max_timeout is not None and args.max_timeout <= 0, "--max-timeout must be positive"),
        (args.batching not in ("cost", "count"), "--batching must be cost or count"),
        (args.max_connections < 0, "--max-connections must not be negative (0: no cap)"),
        (args.api_key == "", "--api-key must not be empty (leave it unset for no key)"),
    ):
        if wrong:
            parser.error(message)
    if args.max_timeout is None:
        args.max_timeout = max(DEFAULT_MAX_TIMEOUT, args.timeout)
    if args.max_timeout < args.timeout:
        # a request asking for more time than the cap would get less than one asking none
        parser.error(
            f"--max-timeout ({args.max_timeout:g} s) must not be below --timeout "
            f"({args.timeout:g} s, the deadline of a request that asks for none)"
        )
    if args.max_batch_delay_ms > args.max_timeout * 1000:
        # (1e308 was taken: a lone request then waited for half of its deadline)
        parser.error(
            f"--max-batch-delay-ms ({args.max_batch_delay_ms:g}) must not be above "
            f"--max-timeout ({args.max_timeout:g} s, the longest deadline)"
        )
    if args.api_key is not None and (fault := api_key_fault(args.api_key)):
        parser.error(f"--api-key {fault}")
    if not 1 <= args.http_processes <= cores.cores:  # one speaks HTTP on a core at most
        parser.error(f"--http-processes must be from 1 to {cores.cores}, {allowed}")
    check_host(args.host, parser)
    for name in ("keepalive_timeout", "head_timeout", "body_timeout", "write_timeout"):
        if getattr(args, name) <= 0:  # (one message for the four blamed a variable set well)
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.stream_keepalive != 0 and args.stream_keepalive < MIN_STREAM_KEEPALIVE:
        # (0.001 sent each stream a thousand comments a second)
        parser.error(
            f"--stream-keepalive must be 0 (no keep-alive comments) or at least "
            f"{MIN_STREAM_KEEPALIVE} seconds"
        )
    if args.generation not in ("continuous", "static"):
        parser.error("--generation must be continuous or static")
    if args.join_wait_steps < 0:
        parser.error("--join-wait-steps must not be negative (0: none wait)")
    for name in ("max_sequences", "threads", "max_batch_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for option in OPTIONS:  # (larger: /info's JSON and the batch code could not hold it)
        value = getattr(args, option.dest)
        if option.type is int and value is not None and value > MAX_WHOLE_NUMBER:
            parser.error(f"{option.flag} must be at most {MAX_WHOLE_NUMBER}")
        if option.type is float and value is not None and value > MAX_TIME:
            parser.error(f"{option.flag} must be at most {MAX_TIME:,}")
    if args.threads is not None and args.threads > cores.cores:
        # more only contend for the cores; torch's thread pool crashed the worker with
        # tens of thousands, and the restarted one failed on memory
        parser.error(f"--threads must be from 1 to {cores.cores}, {allowed}")
    if args.dtype not in DTYPES:
        parser.error("--dtype must be auto, float32, float16 or bfloat16")
    if args.loop not in LOOPS:
        parser.error(f"--loop must be one of {', '.join(LOOPS)}")
    if args.loop == "uvloop" and chosen_loop("auto") != "uvloop":
        parser.error("--loop uvloop: uvloop is not installed")
    if args.log_level.upper() not in LOG_LEVELS:
        parser.error(f"--log-level must be one of {', '.join(LOG_LEVELS).lower()}")
    if args.log_format not in LOG_FORMATS:
        parser.error(f"--log-format must be one of {', '.join(LOG_FORMATS)}")


def api_key_fault(key: str) -> str | None:
    """Why `key` cannot be sent as a Bearer token (None: it can). A header's value cannot
    begin or end in whitespace nor hold a control character: with such a key (a secret
    file's last newline) every request would be refused as a wrong key; nor can clients
    send one beyond ASCII: the openai SDK raised UnicodeEncodeError before it sent, and
    requests sent it in Latin-1, a wrong key, where curl sent UTF-8."""
    if not key.isascii():
        return (
            "holds a character beyond ASCII, which clients cannot send in an Authorization "
            "header alike (RFC 6750's tokens are ASCII)"
        )
    if not key.isprintable():
        return (
            "holds a control character (a file's last newline?), which no Authorization "
            "header can carry"
        )
    if key.strip() != key:
        return (
            "begins or ends in whitespace (a file's last newline?), which no Authorization "
            "header can carry"
        )
    return None


def check_host(host: str, parser: argparse.ArgumentParser) -> None:
    """--host names an address of some kind: an empty one would listen on every interface
    (asyncio reads "" as all of them), and a name nothing resolves would stop the start
    only once the workers are loading. Whether it is this machine's is known on binding."""
    if not host.strip():
        parser.error("--host must be an address or a host name (0.0.0.0: every interface)")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        parser.error(f"--host {host!r} is not an address or a host name: {reason}")


def variable_value(env: str) -> str | None:
    """A RAWSERVE_* variable's value; None where it is unset, or empty as `RAWSERVE_PORT=`
    in a compose or unit file leaves it (click reads a variable so). RAWSERVE_API_KEY empty
    is a value, and refused: read as unset, it would serve with no key at all."""
    value = os.environ.get(env)
    if value is None or (not value.strip() and env != KEY_VARIABLE):
        return None
    return value


def flags_or_variable(given: list[str] | None, env: str) -> list[str]:
    """A repeatable option's values: the flags given, else its variable's comma list (a
    blank variable is none; an empty entry in it is refused, as an empty flag is: `","`
    served the default model without a word)."""
    if given is not None:
        return given
    text = os.environ.get(env, "")
    if not text.strip():
        return []
    values = [value.strip() for value in text.split(",")]
    if not all(values):
        place = values.index("") + 1
        raise ValueError(f"{env}: entry {place} of its comma list (of {len(values)}) is empty")
    return values


def checked_origin(origin: str, parser: argparse.ArgumentParser) -> str:
    """A --cors-allow-origin value as browsers send it (`cors.browser_origin`)."""
    try:
        return browser_origin(origin)
    except ValueError as exc:
        parser.error(f"--cors-allow-origin {origin[:100]!r} is not an origin: {exc}")


def batch_defaults(size: int | None, tokens: int | None, gpu: bool) -> tuple[int, int | None, str]:
    """--max-batch-size and --max-batch-tokens as given, the device's defaults where not
    (tokens bound a batch by default only on a GPU), and a line saying which and why."""
    if gpu:
        default_size, default_tokens, where = GPU_MAX_BATCH_SIZE, GPU_MAX_BATCH_TOKENS, "a GPU"
    else:
        default_size, default_tokens, where = CPU_MAX_BATCH_SIZE, None, "the CPU"
    chosen_size = default_size if size is None else size
    chosen_tokens = default_tokens if tokens is None else tokens
    said = [
        f"{chosen_size} items" + (" (as given)" if size is not None else ""),
        "no token budget"
        if chosen_tokens is None
        else f"{chosen_tokens} tokens" + (" (as given)" if tokens is not None else " (TEI's)"),
    ]
    return chosen_size, chosen_tokens, f"on {where}: up to " + ", ".join(said)


def http_processes_default(gpu: bool, cores: int) -> int:
    """One on a CPU machine; on a GPU machine several, leaving most cores to the rest."""
    return max(1, min(GPU_HTTP_PROCESSES, cores // 2)) if gpu else 1


def pooling_named(named: str | None, parser: argparse.ArgumentParser) -> str | None:
    """--pooling's mode in sentence-transformers' words (TEI's last-token: lasttoken)."""
    if not named:
        return None
    mode = POOLING_NAMES.get(named.strip().lower(), named.strip().lower())
    if mode not in POOLING_CHOICES:
        parser.error(f"--pooling must be one of {', '.join(sorted(POOLING_CHOICES))}")
    return mode


def read_chat_template(path: str | None, parser: argparse.ArgumentParser) -> str | None:
    """The text of --chat-template's file, read once (the workers are sent the text)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as template:
            text = template.read()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--chat-template: cannot read {path}: {exc}")
    if not text.strip():  # it would take the model's own template's place: no chat at all
        parser.error(f"--chat-template: {path} is empty")
    return text


def load_tls(
    certfile: str | None, keyfile: str | None, parser: argparse.ArgumentParser
) -> Tls | None:
    """The listening socket's TLS, loaded now: a file that cannot be read stops the server
    before anything starts."""
    if keyfile and not certfile:
        parser.error("--ssl-keyfile needs --ssl-certfile")
    if not certfile:
        return None
    try:
        context = server_context(certfile, keyfile)
    except ValueError as exc:
        parser.error(f"--ssl-certfile/--ssl-keyfile: {exc}")
    return Tls(certfile, keyfile or None, context)
