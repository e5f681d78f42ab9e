"""The messages that cross the pipe between the server and a worker process.

Small frozen dataclasses and plain data only: no tuples with positional meaning and
no pickled exceptions. A failure is described by an `ItemFailure` (kind + a message
that is safe to show a client); tracebacks stay in the worker's log.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rawserve.shared.tallies import Counts


class Engine(enum.Enum):
    """What runs an encoder's forward pass (`--engine`)."""

    TORCH = "torch"
    ONNX = "onnx"  # ONNX Runtime, on the CPU, for the encoder tasks (the `onnx` extra)
    AUTO = "auto"  # where both serve the task: the faster here, by a short trial at start
    HANDLER = "handler"  # a `--handler`'s own code (what it runs, and in what precision)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to load its model; sent once, when it is spawned.

    The server settles the facts (rawserve.models): `model` is a local folder (a Hub id is
    resolved before any worker starts), and the task and pooling are what the server read
    from that folder, so a worker never derives them itself."""

    model: str
    task: str | None = None  # None only with a handler
    handler: str | None = None  # "module:factory" instead of a transformers pipeline
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    pooling: str = "none"  # feature-extraction: a sentence-transformers mode, or none (tokens)
    normalize: bool = False  # feature-extraction: normalize the pooled vector
    warmup_batch: int = 0  # items of the batch run before reporting ready (0: no warm-up)
    name: str = ""  # the served model's name in log lines, when the server has several
    engine: Engine = Engine.TORCH
    chat_template: str | None = None  # a Jinja template for a tokenizer that has none
    # text generation on a causal LM: "continuous" (sequences join and leave the running
    # batch between decoding steps) or "static" (one `generate` call per batch)
    generation: str = "continuous"
    max_sequences: int | None = None  # continuous: sequences at once (None: by device)
    # continuous: steps a sequence that comes while rows run may wait for company to join
    join_wait_steps: int = 0
    # tokenize each batch on a thread of its own as it arrives, apart from the model's
    # (rawserve.worker.feeder). None: on a GPU, whose worker is sent its next batch while
    # one runs; a CPU worker gets one batch at a time, and a second thread only adds a hop
    prepare_ahead: bool | None = None
    # on a GPU: forward passes and decoding steps replayed from CUDA graphs (rawserve.worker
    # .cuda_graphs, decode_graphs, prefill_graphs)
    cuda_graphs: bool = False
    # this server start's id: a trial verdict kept under it was measured at this very
    # start (by its layout trial's timers, which load the model first), not an earlier one
    start: str = ""
    # the model as the command line named it (a folder or a Hub id; `model` is the folder
    # it resolved to): the trial files name it, for a person looking for a model's files
    source: str = ""


@dataclass(frozen=True)
class Control:
    """How the server wants a batch run, beside the task's parameters: set by the server,
    never by a client, and part of what items must share to share a batch."""

    # a streamed generation: the worker sends this stream a `TokenChunk` per new token
    stream_id: int | None = None
    # the embedding routes (OpenAI's, TEI's): a pooled vector (mean pooling where the model
    # has none), normalized unless asked not to, with the input's real token count
    embedding_route: bool = False
    # TEI's /embed_sparse: a SPLADE model's vector as its words of nonzero weight
    sparse: bool = False


NO_CONTROL = Control()
EMBEDDING_ROUTE = Control(embedding_route=True)
SPARSE_ROUTE = Control(embedding_route=True, sparse=True)


@dataclass(frozen=True)
class Batch:
    """One model call: items that share the same parameters."""

    batch_id: int
    inputs: tuple[Any, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    threads: int | None = (
        None  # intra-op threads (torch or ONNX Runtime) for this call; None: as loaded
    )
    control: Control = NO_CONTROL
    # each input's request id (its response's X-Request-Id, as the access log names it),
    # for the worker's log lines about an item; () where the server gave none
    request_ids: tuple[str, ...] = ()
    # when each input was admitted (time.monotonic, the same clock in every process):
    # a generation worker times its first token from there; () where the server gave none
    admitted: tuple[float, ...] = ()

    def request_id(self, index: int) -> str:
        """The request id of the input at `index`, for a log line ("-": none given)."""
        return self.request_ids[index] if index < len(self.request_ids) else "-"


class FailureKind(enum.Enum):
    INPUT = "input"  # the model rejected this input: the client's to fix (422)
    INTERNAL = "internal"  # the model failed for another reason (500)
    OUT_OF_MEMORY = "out_of_memory"  # even a batch of one did not fit (500)


@dataclass(frozen=True)
class ItemFailure:
    kind: FailureKind
    message: str


@dataclass(frozen=True)
class BatchResult:
    """The answer to a `Batch`: one output or `ItemFailure` per input, in order."""

    batch_id: int
    outputs: tuple[Any, ...]
    compute_seconds: float
    effective_batch_cap: int | None = None  # lowered after out-of-memory errors; None: no cap
    # real tokens per input, measured now and then: the server's length estimate learns
    token_counts: tuple[int, ...] | None = None
    # the new tokens each input's sequence made (a continuous worker's; 0 for one failed):
    # the server learns the seconds a token made, not those of a sequence that ended early
    made: tuple[int, ...] | None = None
    # seconds it waited in the worker behind the batch before it (set by the server's
    # pool, two batches in flight): the scheduler times the batch's own run without it
    waited: float = 0.0
    # seconds the worker's preparing thread took on it (tokenizing), apart from the model
    prepare_seconds: float = 0.0
    # its inputs ran again after their worker died (set by the server's pool): its time,
    # a restart's, says nothing of the model's speed
    rerun: bool = False


@dataclass(frozen=True)
class TokenChunk:
    """One new token of a streamed generation (sent while its batch is still running)."""

    stream_id: int
    index: int  # the item's position in its batch
    token: Mapping[str, Any]  # TGI's token: {"id", "text", "logprob", "special"}
    # the generation goes on after this token (unless it fails or its client leaves);
    # False where it ends here, or where the worker cannot tell
    more: bool = False
    # with a reasoning model's first chat token: where this prompt leaves its thinking to
    # open (`CausalLMRunner.opened`), which a chat template's settings may change
    opened: str | None = None


@dataclass(frozen=True)
class TokenChunks:
    """The new tokens of one forward pass of a continuous generation worker, for every
    stream it runs: one message (one write, one read) where a `TokenChunk` each would
    cost a write and two reads per token; sent before the next pass starts."""

    chunks: tuple[TokenChunk, ...]


@dataclass(frozen=True)
class Progress:
    """A continuous generation worker's sign of life while its passes stream nothing
    (its sequences are not streamed): a forward pass has ended. Sent at most once every
    `PROGRESS_EVERY` seconds, so that the server's batch timeout tells a long generation
    from a hung worker."""


PROGRESS_EVERY = 1.0  # seconds between two `Progress` messages at most


@dataclass(frozen=True)
class GenerationPasses:
    """A continuous generation worker's forward passes since it last sent these, for the
    server's metrics: prefills (joiners' prompts, a long prompt's chunk, a window of
    prompt scoring) and the prompt tokens they read, decoding steps and the rows they
    ran (a new token each), and its sequences' latencies (rawserve.worker.token_times).
    Sent at most once every `PASSES_EVERY` seconds while it runs, and once more when it
    falls idle."""

    prefills: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    rows: int = 0
    # and how long its sequences took (rawserve.shared.tallies: counts per bucket, None
    # where nothing was timed): from admission to the start of the step that prefilled
    # each, to each one's first token, and between two tokens of one sequence
    queue: Counts | None = None
    first_token: Counts | None = None
    inter_token: Counts | None = None


PASSES_EVERY = 1.0  # seconds between two `GenerationPasses` messages at most


@dataclass(frozen=True)
class Cancel:
    """The server no longer wants a batch's answer (its client left, or its deadline
    passed). A continuous worker ends the batch's sequences at its next decoding step and
    answers the batch with what it has; a worker that runs one batch at a time (its feeder
    thread reads it meanwhile) stops a generation at its next token, and runs the rest on."""

    batch_id: int


@dataclass(frozen=True)
class WorkerWarming:
    """The model is loaded; the worker runs its warm-up batch before it says ready."""

    load_seconds: float


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model can take, for checks and estimates in the server."""

    max_input_tokens: int | None = None  # it reads no more of an input (truncates); None: ?
    max_new_tokens: int | None = None  # the longest generation its positions allow
    # what a generation that names no length or beams gets (the model's generation config,
    # else the pipeline's defaults): its cost in the server; 0 new tokens: it generates none
    default_new_tokens: int = 0
    default_beams: int = 1

    @property
    def longest_input(self) -> int | None:
        """The most tokens the model reads of one input: its truncation length, else (a
        generation model, which refuses a longer prompt) its positions; None: unknown."""
        if self.max_input_tokens is not None:
            return self.max_input_tokens
        return self.max_new_tokens + 1 if self.max_new_tokens is not None else None


@dataclass(frozen=True)
class WorkerReady:
    pid: int
    task: str
    device: str
    dtype: str
    load_seconds: float
    details: Mapping[str, Any] = field(default_factory=dict)
    warmup_seconds: float | None = None  # None: no warm-up ran
    limits: ModelLimits = field(default_factory=ModelLimits)
    engine: Engine = Engine.TORCH  # what runs the forward pass (never AUTO)
    engine_reason: str = ""  # why that engine, for the log and /info
    dtype_reason: str = ""  # why that precision (half by default on a GPU), for /info
    bfloat16_trial: str = ""  # what --dtype bfloat16 would give on this CPU ("": not tried)
    attention: str = ""  # the attention kernels chosen on a GPU, for /info ("": torch's)
    cuda_graphs: str = ""  # what became of CUDA graphs on a GPU, for /info ("": none tried)
    # a causal LM's batching, continuous or static, and why, for /info ("": no such model)
    generation: str = ""
    # the weights its checkpoint had none for, made at random, in words ("": none)
    untrained: str = ""
    # the model's tokenizer in the `tokenizers` library's JSON form (None: it has none):
    # the server tokenizes and decodes with it for /tokenize and /decode
    tokenizer: str | None = None
    # a continuous worker: how many sequences it runs at once. It takes any number of
    # batches at a time, runs their items side by side, and answers each batch as soon
    # as its own items are done, in any order. 0: it runs one batch after another.
    sequences: int = 0


@dataclass(frozen=True)
class WorkerLoadFailed:
    message: str


@dataclass(frozen=True)
class Shutdown:
    """Asks a worker to finish and exit."""
