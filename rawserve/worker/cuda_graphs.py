"""An encoder's forward pass replayed from CUDA graphs, one per padded batch shape.

On a GPU a BERT-base-sized forward pass is bound by its launches, not its arithmetic:
~300 kernels, each issued by Python through the modules (an H100: 5.7 ms for one text,
11 ms for 64, 22 ms for 256). A CUDA graph records those launches once and replays them
in one call. Graphs have fixed shapes, so a batch is padded up to the next bucket of rows
and tokens (padded tokens are masked out; padded rows attend to their first token alone,
and are dropped from the output), and each bucket's graph is captured the first time a
batch of that shape comes. Batches past `MAX_GRAPH_TOKENS` padded tokens run as they
are: there the arithmetic outweighs the launches, and their outputs would hold GPU memory
per graph.

Worker process only (imports torch).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("rawserve.worker")

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MAX_GRAPH_TOKENS = 8192  # padded rows x tokens: past it, a batch runs without a graph
MAX_GRAPHS = 64  # shapes captured at most; the rest run without one
WARM_RUNS = 2  # runs before a capture (lazy setups, cuBLAS's workspace), as torch advises
CHECK_TOLERANCE = 1e-2  # a first replay against the pass as it is: the same kernels, fp16

Forward = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def token_bucket(length: int) -> int:
    """Tokens padded to a multiple of 8 up to 64, of 16 up to 128, then of 32."""
    step = 8 if length <= 64 else 16 if length <= 128 else 32
    return -(-length // step) * step


def rows_bucket(rows: int) -> int | None:
    """The rows a batch of `rows` is padded to; None past the largest bucket."""
    at = bisect.bisect_left(ROW_BUCKETS, rows)
    return ROW_BUCKETS[at] if at < len(ROW_BUCKETS) else None


def bucket(rows: int, length: int, max_length: int) -> tuple[int, int] | None:
    """The padded shape a batch of `rows` x `length` tokens runs at, its tokens no more
    than the model reads (`max_length`); None: no graph (a batch beyond the model's
    length runs as it is, and fails as it would)."""
    padded_rows = rows_bucket(rows)
    if padded_rows is None or length > max_length:
        return None
    shape = padded_rows, min(token_bucket(length), max_length)
    return shape if shape[0] * shape[1] <= MAX_GRAPH_TOKENS else None


def padded(inputs: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor]) -> None:
    """Write a batch's inputs into a bucket's larger tensors: its rows and tokens at the
    start, zeros after them (so nothing of the batch before stays), and each padded row
    attending to its first token alone (a row that attends to nothing may come out NaN
    in some attention kernels: unread, but nothing to leave in a GPU's memory)."""
    rows, length = inputs["input_ids"].shape
    for name, target in into.items():
        target.zero_()
        target[:rows, :length].copy_(inputs[name], non_blocking=True)
    into["attention_mask"][rows:, 0] = 1


def unpadded(output: torch.Tensor, rows: int, length: int, per_token: bool) -> torch.Tensor:
    """The batch's part of a bucket's output (`per_token`: a vector per token, whose
    padded tokens are cut too)."""
    return output[:rows, :length] if per_token else output[:rows]


_thread = threading.local()


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    _thread.recording = True
    try:
        yield
    finally:
        _thread.recording = False


def recording() -> bool:
    """True while this thread records a graph and checks its first replay. A check of the
    model's output that reads it back to the host (a forward hook's) waits for the
    caller's check of the replay's output: CUDA refuses such a read while it records
    (the recording fails), and an output that is not numbers is the input's fault, not
    the graph's."""
    return getattr(_thread, "recording", False)


@dataclass
class Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # the tensors the graph reads: fill, then replay
    output: torch.Tensor  # the tensor the graph writes


class GraphedForward:
    """`forward(inputs)` → one tensor, replayed from a graph per bucket where one fits.

    `per_token`: the output has a vector per token (a hidden state), not one per row
    (logits). One thread calls it (the worker's model thread): the graphs share one
    memory pool, so an output is read before the next replay.
    """

    def __init__(self, forward: Forward, device: str, per_token: bool, max_length: int):
        self.forward = forward
        self.device = device
        self.per_token = per_token
        self.max_length = max_length
        self.shelf = GraphShelf(device, "the forward pass", MAX_GRAPHS)
        self.names: tuple[str, ...] | None = None  # the inputs the first batch had

    @property
    def graphs(self) -> dict[tuple[int, int], Captured]:
        return self.shelf.graphs

    @property
    def failed(self) -> bool:
        """A capture failed: this model runs without graphs."""
        return self.shelf.failed

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        rows, length = inputs["input_ids"].shape
        captured = self._graph_for(inputs, rows, length)
        if captured is None:
            return self.forward(inputs)
        padded(inputs, captured.inputs)
        captured.graph.replay()
        return unpadded(captured.output, rows, length, self.per_token)

    def _graph_for(
        self, inputs: Mapping[str, torch.Tensor], rows: int, length: int
    ) -> Captured | None:
        shape = bucket(rows, length, self.max_length)
        if shape is None or "attention_mask" not in inputs:
            return None
        names = tuple(sorted(inputs))
        if self.names is None:
            self.names = names
        if names != self.names:  # other inputs than the graphs read
            return None
        captured = self.shelf.graphs.get(shape)
        if captured is not None or not self.shelf.has_room(shape):
            return captured
        return self.shelf.add(shape, lambda: self._capture(shape, inputs))

    def _capture(self, shape: tuple[int, int], batch: Mapping[str, torch.Tensor]) -> Captured:
        """Record the bucket's graph on the batch that asked for it, padded, and check it."""
        tensors = {
            name: torch.empty(shape, dtype=batch[name].dtype, device=self.device)
            for name in sorted(batch)
        }
        padded(batch, tensors)
        with _recording():
            graph, output = self._record(tensors)
            self._check(graph, tensors, output, *batch["input_ids"].shape)
        log.info("CUDA graphs: captured %d rows x %d tokens", *shape)
        return Captured(graph, tensors, output)

    def _check(
        self,
        graph: Any,
        tensors: dict[str, torch.Tensor],
        output: torch.Tensor,
        rows: int,
        length: int,
    ) -> None:
        """Replay the new graph once, against the pass run as it is on the same tensors
        (the batch's `rows` x `length`): a model whose pass does not record faithfully (a
        branch on a tensor's value, state kept between calls) runs without graphs, not
        with wrong answers."""
        expected = unpadded(self.forward(tensors), rows, length, self.per_token)
        graph.replay()
        replayed = unpadded(output, rows, length, self.per_token)
        check_close(replayed, expected, CHECK_TOLERANCE)

    def _record(self, tensors: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The forward pass on `tensors`, recorded: the graph, and the tensor it writes."""
        return self.shelf.record(lambda: self.forward(tensors))


class GraphShelf:
    """Graphs kept by shape, recorded into one memory pool, at most `limit` of them; the
    first failure to record (or a replay that differs) turns them off for good, and the
    pass runs as it is. For an encoder's forward pass (above) and the continuous batch's
    steps and prefills (rawserve.worker.decode_graphs, prefill_graphs); `what` names the
    pass in the log."""

    def __init__(self, device: Any, what: str, limit: int):
        self.device = device
        self.what = what
        self.limit = limit
        self.graphs: dict[Any, Any] = {}
        self.pool: Any = None
        self.failed = False
        self.full = False  # `limit` recorded (said once in the log)

    def has_room(self, shape: Any) -> bool:
        """Whether `shape` has a graph or may get one."""
        if self.failed:
            return False
        if shape in self.graphs or len(self.graphs) < self.limit:
            return True
        if not self.full:
            self.full = True
            log.info("CUDA graphs: %s: %d shapes recorded; new ones run as they are",
                     self.what, self.limit)  # fmt: skip
        return False

    def replay(
        self, shape: Any, capture: Callable[[], Any], refill: Callable[[Any], None] | None = None
    ) -> Any | None:
        """`shape`'s graph replayed, after `refill(captured)` writes its inputs; a new
        shape's recorded by `capture()` (which replays it once, to check it). None: the
        recording failed, run the pass as it is."""
        captured = self.graphs.get(shape)
        if captured is None:
            return self.add(shape, capture)
        if refill is not None:
            refill(captured)
        captured.graph.replay()
        return captured

    def add(self, shape: Any, capture: Callable[[], Any]) -> Any | None:
        """`capture()`'s graph kept for `shape`; None if it raised (logged, and the
        graphs are off from now on)."""
        try:
            captured = capture()
        except Exception:  # noqa: BLE001 - logged once; the pass runs as it is
            log.warning("CUDA graphs: recording %s failed, running without", self.what,
                        exc_info=True)  # fmt: skip
            self.failed = True
            self.forget()
            return None
        self.graphs[shape] = captured
        return captured

    def forget(self) -> None:
        """Drop the graphs, and their memory pool with them: a pool whose graphs are all
        gone is freed, and recording into its old handle fails."""
        self.graphs.clear()
        self.pool = None

    def record(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return record(run, self.device, self.pool)


def said_after_warm_up(said: str, shelves: Sequence[GraphShelf]) -> str:
    """What a runner's graphs come to once the warm-up recorded them (`said`: what
    turning them on said), for the log and `/info`: a recording that failed there turned
    its graphs off for good (one that reads the scores back to the host, say), and a
    worker that still said "on" would hide that it runs as it is."""
    failed = [shelf.what for shelf in shelves if shelf.failed]
    if not failed:
        return said
    why = f"recording {' and '.join(failed)} failed at the warm-up (the log says why)"
    if len(failed) == len(shelves):
        return f"off: {why}, so it runs as it is"
    return f"{said}; but {why}, so that runs as it is"


def check_close(replayed: torch.Tensor, expected: torch.Tensor, tolerance: float) -> float:
    """The largest difference between a first replay and the pass as it is; raises when
    they differ by more than `tolerance` (relative and absolute)."""
    replayed, expected = replayed.float(), expected.float()
    difference = float((replayed - expected).abs().max()) if replayed.numel() else 0.0
    # (NaN where the pass as it is gave NaN is faithful: the input overflowed, and the
    # caller's check of the output fails it alone)
    if not torch.allclose(replayed, expected, rtol=tolerance, atol=tolerance, equal_nan=True):
        raise ValueError(f"the replayed pass differs from the pass as it is by {difference}")
    return difference


def record(run: Callable[[], Any], device: Any, pool: Any) -> tuple[Any, Any]:
    """`run()` recorded into a CUDA graph that allocates from `pool`, after WARM_RUNS runs
    on a side stream: the graph, and what `run` returned while recording (the tensors
    each replay writes)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARM_RUNS):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # this thread's calls alone are checked while recording: the preparing thread pins
    # the next batch's tensors meanwhile, which is no part of the graph
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = run()
    return graph, output
