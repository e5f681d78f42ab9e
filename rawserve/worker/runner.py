"""The base of every runner: a loaded model that turns a batch of checked inputs into one
plain-data output per input (numpy arrays or Python lists/dicts), and says safely what
went wrong when an input fails.

Worker process only. torch is imported where it is used, not at the top: a handler's
runner shares this base, and a worker whose handler uses no torch never loads it
(importing it was most of such a worker's start).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rawserve.shared.devices import gpu_present
from rawserve.shared.logs import SCHEME, SCHEME_PREFIX, first_line, without_credentials
from rawserve.shared.messages import (
    NO_CONTROL,
    Control,
    Engine,
    FailureKind,
    ItemFailure,
    ModelLimits,
)

if TYPE_CHECKING:
    import torch

    from rawserve.worker.cuda_graphs import GraphedForward
    from rawserve.worker.model_classes import Untrained
    from rawserve.worker.onnx_engine import OnnxNetwork

log = logging.getLogger("rawserve.runner")

# torch.multinomial's complaint when logits divided by a tiny temperature overflow
SAMPLING_FAILED = "probability tensor contains either `inf`, `nan` or element < 0"
# what a client is told of it
SAMPLING_FAILED_MESSAGE = (
    "sampling failed numerically with these parameters (a temperature or a "
    "repetition_penalty very close to 0 leaves no probabilities to draw from): raise it, or "
    "generate greedily (do_sample false, or temperature 0)"
)
# why a model's output is NaN or infinite: an overflow, as float16 meets on long inputs,
# or a broken checkpoint (the model's fault, never the request's: a 500)
NOT_NUMBERS_WHY = (
    "(NaN or infinite: the model overflowed (in float16, --dtype bfloat16 or float32 has the "
    "range), or its weights are broken)"
)
# what a client is told when the model's own scores are NaN or infinite before any setting
# of the request touched them: no token can be chosen from them, whatever the request asks
MODEL_SCORES_FAILED_MESSAGE = (
    f"the model's scores for this input are not numbers {NOT_NUMBERS_WHY}; "
    "no token can be chosen from them"
)

# what a batch too large for the memory raises, besides MemoryError and CUDA's own error
OUT_OF_MEMORY_MESSAGES = (
    "out of memory",  # CUDA's, and what handlers put in a MemoryError
    "can't allocate memory",  # torch's CPU allocator, a RuntimeError
    "Failed to allocate memory",  # ONNX Runtime's arena, its own exception class
)

# The side the runners that read whole inputs (encoders, classifiers, seq2seq's encoder)
# pad a batch on, whatever the tokenizer was saved with: a decoder counts its positions
# from the first token, so a left-padded input beside a longer one would be read at
# shifted positions and answer other than alone (a GPT-2's vector 0.25 cosine from its
# own). On the right, the pads come after every token and the attention mask hides them.
PAD_SIDE = "right"
# a tokenizer saved without a length declares transformers' VERY_LARGE_INTEGER (~1e30)
UNDECLARED_LENGTH = 10**9
# the input limit of a model without positions whose tokenizer declares none: T5's own
# length (t5-*'s tokenizers declare it); a tokenizer_config.json's model_max_length sets
# more. LongT5's attention is local, its cost linear: the 16,384 it was trained for.
UNDECLARED_INPUT_TOKENS = 512
UNDECLARED_INPUT_TOKENS_BY_TYPE = {"longt5": 16384}
# The tokens a generation model reads, prompt and new tokens together, where its config
# names no positions (Bloom's and MPT's ALiBi, a recurrent model's state: any length), nor
# a length it was trained at (`TRAINED_LENGTH_FIELDS`), and its tokenizer declares none.
# It was a million: a 300 KB prompt (~100,000 tokens) ran, its attention growing with the
# square of its length, and held a worker until its deadline while other clients waited.
# 2,048: what Bloom and Mamba were trained at (the models that name none); a longer prompt
# costs Bloom's attention quadratically more and gives either nothing it learned to read.
UNDECLARED_POSITIONS = 2048
UNDECLARED_POSITIONS_BY_TYPE = {"recurrent_gemma": 8192, "xlstm": 8192}  # trained at 8,192
# where a config names its training length instead of positions: ChatGLM's and Qwen's
# `seq_length`, MPT's `max_seq_len`
TRAINED_LENGTH_FIELDS = ("seq_length", "max_seq_len")
# A tokenizer's length of a million or more is no length a model was trained at: a
# placeholder (transformers' ~1e30 for one saved without a length; 1e6 as some write it)
TRAINED_LENGTH_BELOW = 10**6
# Models whose position ids count on from the padding id (RoBERTa's scheme: the first token
# sits at position pad_token_id + 1), so the first pad_token_id + 1 positions hold no token
PADDING_OFFSET_MODEL_TYPES = frozenset(
    {
        "camembert",
        "data2vec-text",
        "esm",
        "ibert",
        "longformer",
        "luke",
        "mpnet",
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xmod",
    }
)
# A file's path in a message (one segment or more, from a drive letter, a slash or a
# name), left out for clients unless it reads as words or numbers: one that starts at a
# name (not at /, a drive, . or ~) is a path only where a segment has a file's extension
# (models/me/w.bin), not `POSITIVE/NEGATIVE/NEUTRAL`, `2024/01/02` or `1.2/3.4`; one of a
# single segment only where it reads as a file's (`_ONE_SEGMENT_FILE`), not `and/or`,
# `1/2` nor `/health`. A ~ is a name's character in every segment (`PROGRA~1`, `w.bin~`),
# and a path (or a drive) starts only where a run of them does: each run is read once.
_PATHLIKE = re.compile(
    r"(?<![\w.\-~])(?:[A-Za-z]:)?[\w.\-~]*+"
    # a segment, then more; or one alone that is not a drive's letter (`/C:/x` is `C:/x`)
    r"(?:[/\\][\w.\-~]++(?:[/\\][\w.\-~]++)+|[/\\](?![A-Za-z]:)[\w.\-~]++)"
)
_ROOTED = re.compile(r"[A-Za-z]:|[/\\.~]")
_EXTENSION = re.compile(r"\.[A-Za-z]\w*(?:[/\\]|$)")
# A path of one segment is a file's from a drive, ~ or . (not .5/2), or with an extension
# (`/key.pem`, `C:/secret.txt`, `~/.netrc`, `./key.pem`, `My Documents/key.txt`'s tail)
_ONE_SEGMENT_FILE = re.compile(r"[A-Za-z]:|~|\.(?!\d)")
# An address in a message (scheme://...), ending before the punctuation after it: its
# path is the address's, not a file's (a file:// one's is a file's), and its query and
# fragment may carry a key (`?api_key=...`, `#access_token=...`)
_URL = re.compile(rf"{SCHEME_PREFIX}(?P<address>{SCHEME}[^\s'\"<>]*[^\s'\"<>.,;:!?)\]}}])")
# The credentials of an address without a scheme, left out for clients as a URL's are
# (`without_credentials`): a user:password@host (a library's words on a URL it could not
# use: `svc:Sup3rS3cret@10.1.2.3`), its user no number (`12:00:01@UTC`) nor `mailto`, its
# host one with a dot or a port. The password runs to the end of its stretch without
# space, /, @ or quote, whichever user starts it: the stretch's end (an @ before a host)
# is checked once at its start, then its first user:, and the rest (`before`) kept.
_BARE_CREDENTIALS = re.compile(
    r"(?<![^\s/@'\"])(?=[^\s/@'\"]*+@(?:[\w\-]++(?:\.[\w\-]++)+|[\w\-]++:\d))"
    r"(?P<before>[^\s/@'\"]*?)(?<![\w.\-])(?!mailto:)[A-Za-z][\w.\-]*+:[^\s/@'\"]++@"
)
MAX_CLIENT_MESSAGE = 300  # characters of a failure's first line that a client is told
MAX_TOKEN_SHOWN = 40  # characters of a token's text that a refusal names


class NotNumbers(ArithmeticError):
    """A model's output (scores, vectors) for an input holds NaN or infinity: the model's
    fault, told to the client as its own words with a 500 (the input's batch-mates, run
    apart from it, are answered)."""


def refuse_not_numbers(values: torch.Tensor, what: str, mask: Any = None) -> None:
    """Raise `NotNumbers` where `values` (batch, features) or (batch, tokens, features)
    hold NaN or infinity; `mask` (batch, tokens): 0 at a padding position, which is not
    read. JSON has no form for such a number: written as null, a score or a vector reads
    as an answer (a null score, "no entities", a null vector) where there is none."""
    finite = values.isfinite().all(-1)
    if mask is not None and finite.dim() == 2:
        finite = finite | (mask.to(finite.device) == 0)
    if not bool(finite.all()):
        raise NotNumbers(f"the model's {what} for this input are not numbers {NOT_NUMBERS_WHY}")


class WrittenForClients(ValueError):
    """An input refused with words written for the client (a chat template's own
    `raise_exception`): told as they are, not scrubbed of what looks like a path, which
    would turn "user/assistant/user" into "<path>"."""


def resolve_device(device: str) -> str:
    """The torch device to load on: `auto` is the GPU where torch sees one. A GPU that torch
    cannot use is refused here, in words, before a log line claims it (torch's own
    complaint, an AssertionError from deep in the load, names no remedy)."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        if gpu_present():  # (--device auto on a machine that shows one): say why not
            log.warning(
                "no GPU for this worker: the machine shows one, and torch %s %s; serving "
                "on the CPU (--device cpu to choose it)",
                torch.__version__,
                why_no_cuda(torch),
            )
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"--device asks for a GPU, and torch {torch.__version__} {why_no_cuda(torch)}, "
            "or serve with --device cpu"
        )
    if device == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(
            f"--device mps: torch {torch.__version__} sees no Apple GPU here, "
            "serve with --device cpu"
        )
    return device


def why_no_cuda(torch: Any) -> str:
    """Why torch sees no CUDA GPU, and what to check."""
    hip = getattr(torch.version, "hip", None)  # a ROCm build's GPUs are torch's cuda too
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else hip and f"ROCm {hip}"
    if not built:
        return "is a build without CUDA: install a CUDA build of torch"
    if visible := os.environ.get("CUDA_VISIBLE_DEVICES"):
        # `--device cuda:3` gives the worker GPU 3 alone: on a machine of one GPU it
        # sees none, and the driver is not what to check
        return (
            f"sees no CUDA GPU among CUDA_VISIBLE_DEVICES={visible}, the GPUs this "
            "worker was given: check that they exist (nvidia-smi lists them)"
        )
    # PyPI's build needs a driver of its CUDA version or later: an older one leaves torch
    # without the GPU (nvidia-smi names the newest CUDA the driver runs)
    return f"sees no CUDA GPU here: check the driver (this torch is built for {built})"


def resolve_dtype(dtype: str) -> Any:
    import torch

    return "auto" if dtype == "auto" else getattr(torch, dtype)


def choose_attention_kernels(device: str) -> str | None:
    """On a GPU, attention by kernels that need no plan per shape; None on a CPU.

    PyTorch's attention prefers cuDNN's kernels on recent GPUs, and cuDNN builds a graph
    for every new shape of its inputs, on the CPU, before it runs. A server's batches
    come in ever-new shapes (items by padded tokens; a longer key at every decoding
    step), so that planning, not the GPU, set the pace of an H100 worker: its GPU was
    busy a tenth to a third of the time (bench/RESULTS.md). The flash and memory-
    efficient kernels plan nothing and run any shape at once."""
    if not device.startswith("cuda"):
        return None
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    return "flash or memory-efficient kernels, not cuDNN's (which plan anew for every shape)"


def undeclared_input_tokens(config: Any) -> int:
    """The input limit of a model without positions whose tokenizer declares none."""
    model_type = getattr(config, "model_type", "")
    return UNDECLARED_INPUT_TOKENS_BY_TYPE.get(model_type, UNDECLARED_INPUT_TOKENS)


def generation_positions(config: Any, tokenizer: Any) -> int:
    """The tokens a generation model reads, its prompt and new tokens together: the
    positions its config names (a model of images and text: its text config's), else
    `undeclared_positions`."""
    text = config.get_text_config(decoder=True)
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return int(positions) if positions else undeclared_positions(text, tokenizer)


def undeclared_positions(config: Any, tokenizer: Any) -> int:
    """The tokens a generation model whose config names no positions reads: the length
    its tokenizer declares where it is a real one, else the length its config says it was
    trained at, else its type's (`UNDECLARED_POSITIONS`)."""
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < TRAINED_LENGTH_BELOW:
        return declared
    for name in TRAINED_LENGTH_FIELDS:
        trained = getattr(config, name, None)
        if isinstance(trained, int) and trained > 0:
            return trained
    model_type = getattr(config, "model_type", "")
    return UNDECLARED_POSITIONS_BY_TYPE.get(model_type, UNDECLARED_POSITIONS)


def token_positions(config: Any) -> int | None:
    """The tokens a model's position embeddings can place, where its config names them:
    `max_position_embeddings` (or `n_positions`), less the positions a RoBERTa-like model
    leaves before its first token."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if not positions:
        return None
    if getattr(config, "model_type", None) in PADDING_OFFSET_MODEL_TYPES:
        positions -= int(getattr(config, "pad_token_id", None) or 0) + 1
    return int(positions)


def embedding_rows(model: Any) -> int | None:
    """The token ids `model` has an embedding for: its input embedding table's rows; an
    ONNX graph's, which shows none, the vocabulary its config names. None: no table of
    token ids (an audio model's, an image model's patches)."""
    table = getattr(model, "get_input_embeddings", None)
    if table is None:  # an ONNX graph
        rows = getattr(getattr(model, "config", None), "vocab_size", None)
    else:
        try:
            rows = getattr(table(), "num_embeddings", None)
        except NotImplementedError:  # (transformers' own words for a model without one)
            rows = None
    return int(rows) if rows else None


def first_id_past(ids: Any, rows: int) -> int | None:
    """The first token id of `ids` (a tensor, or lists of ids) at or past `rows`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ids, torch.Tensor):
        past = ids[ids >= rows]
        return int(past[0]) if past.numel() else None
    if all(max(row, default=0) < rows for row in ids):  # (a long prompt: at C's pace)
        return None
    return next(token for row in ids for token in row if token >= rows)


def highest_token_id(tokenizer: Any) -> int:
    """The highest id `tokenizer` makes: of its vocabulary and the tokens added to it."""
    return max(tokenizer.get_vocab().values(), default=-1)


def keep_pad_readable(tokenizer: Any, rows: int) -> None:
    """A pad token the model has no embedding for (one added to the tokenizer, the model
    not resized) replaced by the end-of-text or the unknown token: a padded batch's pads
    are read by the embedding table as its tokens are, and masked out after, so any
    token the model can read pads as well."""
    pad = tokenizer.pad_token_id
    if pad is None or pad < rows:
        return
    for token in (tokenizer.eos_token, tokenizer.unk_token):
        token_id = tokenizer.convert_tokens_to_ids(token) if token is not None else None
        if token_id is not None and token_id < rows:
            log.warning(
                "the pad token %r (id %d) has no row in the model's embedding table (%d "
                "rows): batches are padded with %r instead",
                tokenizer.pad_token,
                pad,
                rows,
                token,
            )
            tokenizer.pad_token = token
            return


def greedy_at_zero_temperature(options: dict[str, Any]) -> None:
    """generate() options made greedy where their temperature is 0, as TGI and OpenAI read
    it (generate() refuses to sample at 0); in place."""
    if options.get("temperature") == 0.0:
        del options["temperature"]
        options["do_sample"] = False


def dtype_name(model: Any) -> str:
    return str(model.dtype).removeprefix("torch.")


class Runner:
    """A model loaded in this worker, for one task."""

    # what writes this runner's answers to the server (a handler's restricts what they hold)
    answer_pickler: type[pickle.Pickler] = pickle.Pickler

    def __init__(
        self,
        task: str,
        device: str,
        dtype: str = "float32",
        tokenizer: Any = None,
        embedding_rows: int | None = None,
    ):
        self.task = task
        self.device = device
        self.dtype = dtype
        self.dtype_reason = ""  # why that precision, for the log and /info (set on loading)
        self.bfloat16_trial = ""  # what bfloat16 would give on this CPU ("": not tried)
        self.attention = ""  # the attention kernels chosen on a GPU ("": torch's own)
        self.tokenizer = tokenizer  # None: inputs are not text (or not tokenized here)
        self.batch_cancelled: Callable[[], bool] = lambda: False  # nobody waits for it
        # the token ids the model has an embedding for (None: not known, a handler's): a
        # tokenizer given tokens without `resize_token_embeddings` makes ids past them
        self.embedding_rows = embedding_rows
        # whether the tokenizer makes ids past the table at all: the ids are checked only
        # then (reading a GPU tensor's ids waits for the device, each batch)
        self.makes_unreadable_ids = False
        if tokenizer is not None and embedding_rows is not None:
            keep_pad_readable(tokenizer, embedding_rows)
            self.makes_unreadable_ids = highest_token_id(tokenizer) >= embedding_rows
        self.engine = Engine.TORCH
        self.engine_reason = ""
        self.onnx: OnnxNetwork | None = None  # the forward pass, when ONNX Runtime runs it
        self._ahead_tokenizer: Any = None  # the preparing thread's own (see `prepare`)
        self.cuda_graphs = ""  # what became of CUDA graphs (a GPU), for the log and /info
        self.generation_mode = ""  # a generation model's: continuous or static, and why
        # the weights its checkpoint had no tensors for, made at random (None: none, or
        # not known: a handler's model, a graph the folder ships)
        self.untrained: Untrained | None = None
        self.graphed: GraphedForward | None = None  # the forward pass, replayed (a GPU)

    @property
    def on_cuda(self) -> bool:
        """Whether the model runs on a GPU (its batches are then prepared ahead, their
        tensors pinned, and a continuous batch holds more rows)."""
        return self.device.startswith("cuda")

    @property
    def details(self) -> dict[str, Any]:
        """Facts about the loaded model for /info (e.g. pooling); none by default."""
        return {}

    @property
    def limits(self) -> ModelLimits:
        """What the model can take (for the server's checks and estimates); unknown here."""
        return ModelLimits()

    def tokenizer_json(self) -> str | None:
        """The tokenizer in the `tokenizers` library's JSON form, for the server (None: the
        model has no such tokenizer)."""
        if self.tokenizer is None:  # a handler's worker may not have transformers loaded
            return None
        import transformers

        if isinstance(self.tokenizer, transformers.PreTrainedTokenizerFast):
            return str(self.tokenizer.backend_tokenizer.to_str())
        return None

    def max_input_length(self, config: Any) -> int:
        """The most tokens an input may have: the tokenizer's limit or the model's
        positions; for a model without positions (T5's are relative) whose tokenizer
        declares none, `undeclared_input_tokens` (it was a million: a T5 encoder took a
        6,000-word text whole, 2 GB, and 400,000 words ran out of memory, a 500)."""
        positions = token_positions(config)
        declared = self.tokenizer.model_max_length if self.tokenizer is not None else None
        if declared is None or declared >= UNDECLARED_LENGTH:
            declared = positions or undeclared_input_tokens(config)
        return int(min(declared, positions or declared))

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        raise NotImplementedError

    @property
    def prepares_ahead(self) -> bool:
        """Whether `prepare` can do anything for this runner's batches."""
        return False

    def prepare(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> Any:
        """What of a batch can be done before the model is free: on a GPU, tokenizing batch
        N+1 while batch N computes (rawserve.worker.feeder calls this on a thread of its
        own). None: nothing here, `run` does it all. Whatever fails here is done again by
        `run`, which says what failed."""
        return None

    def run_prepared(
        self, inputs: list[Any], params: dict[str, Any], control: Control, prepared: Any
    ) -> list[Any]:
        """`run`, given what `prepare` made of the same inputs and parameters."""
        return self.run(inputs, params, control)

    def ahead_tokenizer(self) -> Any:
        """A tokenizer for `prepare` alone: a fast tokenizer must not be used by two
        threads at once (its padding and truncation settings are the instance's)."""
        if self._ahead_tokenizer is None:
            self._ahead_tokenizer = copy.deepcopy(self.tokenizer)
        return self._ahead_tokenizer

    def staged(self, encoded: Any) -> Any:
        """Tokenized tensors ready for the device: pinned on a GPU, so that the model's
        thread copies them without waiting (`on_device`)."""
        if self.on_cuda:
            return type(encoded)({name: tensor.pin_memory() for name, tensor in encoded.items()})
        return encoded

    def on_device(self, encoded: Any) -> Any:
        return encoded.to(self.device, non_blocking=self.on_cuda)

    def use_cuda_graphs(self) -> str:
        """Replay the forward pass from CUDA graphs (rawserve.worker.cuda_graphs) where
        this runner can; what became of it, in words."""
        return "off: this task's forward pass is not replayed"

    def set_threads(self, count: int) -> None:
        """Intra-op threads for the next batches (cheap: the pools are kept): torch's, where
        it is loaded (a handler may use none)."""
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(count)
        if self.onnx is not None:
            self.onnx.set_threads(count)

    def bind_stream(self, send: Callable[[Any], None], cancelled_stream: Any) -> None:
        """Runners that stream tokens get the worker's pipe and the cancel flag here."""

    def bind_cancel(self, cancelled: Callable[[], bool]) -> None:
        """What says that nobody waits for the batch running any more, for the runners
        that can stop one midway (a generation, at its next token)."""
        self.batch_cancelled = cancelled

    def count_tokens(self, inputs: list[Any], tokenizer: Any = None) -> list[int] | None:
        """Real tokens per text input (for the server's length estimate); None if unknown.
        `tokenizer`: the calling thread's own (the preparing thread's), if not the model's."""
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None or not all(isinstance(value, str) for value in inputs):
            return None
        return [len(ids) for ids in tokenizer(inputs, truncation=False, verbose=False)["input_ids"]]

    def refuse_unreadable(
        self, ids: Any, tokenizer: Any = None, holder: str = "the input holds"
    ) -> None:
        """Raise `WrittenForClients` (a 422) where `ids` (a tensor of rows, or lists of
        ids) hold a token the model has no embedding for, before the model reads them: it
        failed on it (a 500), and on a GPU a device-side assert, which left the worker's
        CUDA context unusable for every batch after. `tokenizer`: the calling thread's;
        `holder`: what holds the ids, in the refusal's words."""
        if self.embedding_rows is None or not self.makes_unreadable_ids:
            return
        unreadable = first_id_past(ids, self.embedding_rows)
        if unreadable is None:
            return
        tokenizer = tokenizer or self.tokenizer
        token = str(tokenizer.convert_ids_to_tokens(unreadable))[:MAX_TOKEN_SHOWN]
        raise WrittenForClients(
            f"{holder} the token {token!r} (id {unreadable}), which this model "
            f"cannot read: its embedding table has {self.embedding_rows} rows and its "
            f"tokenizer {len(tokenizer)} tokens (tokens were added to the tokenizer "
            "without resizing the model's embeddings)"
        )

    def describe_failure(self, exc: BaseException) -> ItemFailure:
        """Turn a failure on one item into a message that is safe to send to a client."""
        out_of_memory = any(message in str(exc) for message in OUT_OF_MEMORY_MESSAGES)
        torch = sys.modules.get("torch")  # only a torch loaded raises its errors
        if torch is not None and isinstance(exc, torch.OutOfMemoryError):
            out_of_memory = True
        if isinstance(exc, MemoryError) or out_of_memory:
            return ItemFailure(
                FailureKind.OUT_OF_MEMORY, "the model ran out of memory on this input"
            )
        if isinstance(exc, NotNumbers):
            return ItemFailure(FailureKind.INTERNAL, str(exc))
        if isinstance(exc, WrittenForClients):
            return ItemFailure(FailureKind.INPUT, first_line(exc)[:MAX_CLIENT_MESSAGE])
        if isinstance(exc, ValueError):
            return ItemFailure(FailureKind.INPUT, client_message(exc))
        if isinstance(exc, RuntimeError) and SAMPLING_FAILED in str(exc):
            return ItemFailure(FailureKind.INPUT, SAMPLING_FAILED_MESSAGE)
        return ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


def client_message(exc: BaseException) -> str:
    """An input's failure in words for its client: its first line, paths, an address's
    credentials and query left out (an error of no words: "refused", not its class's
    name, which is the server's code)."""
    if not str(exc).strip():
        return "the input was refused (no reason given)"
    line = first_line(exc)
    told, at = [], 0
    for found in _URL.finditer(line):
        told.append(_text_left_out(line[at : found.start("address")]))
        told.append(_address_left_out(found["address"]))
        at = found.end()
    told.append(_text_left_out(line[at:]))
    return "".join(told)[:MAX_CLIENT_MESSAGE]


def _address_left_out(address: str) -> str:
    address, query, _ = without_credentials(address).partition("?")
    address, fragment, _ = address.partition("#")
    if address.lower().startswith("file:"):
        address = "file://<path>"
    return address + ("?<query>" if query or fragment else "")


def _text_left_out(text: str) -> str:
    text = _BARE_CREDENTIALS.sub(r"\g<before><credentials>@", text)
    return _PATHLIKE.sub(_path_left_out, text)


def _path_left_out(found: re.Match[str]) -> str:
    path = found[0]
    if path.count("/") + path.count("\\") == 1:  # one segment: and/or, 1/2, /health
        is_file = _ONE_SEGMENT_FILE.match(path) or _EXTENSION.search(path)
    else:
        is_file = _ROOTED.match(path) or _EXTENSION.search(path)
    return "<path>" if is_file else path
