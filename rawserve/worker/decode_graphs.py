"""A continuous batch's decoding step replayed from CUDA graphs.

On a GPU a small causal LM's decoding step is bound by its launches, not its arithmetic:
a GPT-2-small-sized model's step took 6.4 ms from Python on an H100 whatever the batch,
1.1 ms replayed (bench/RESULTS.md), where the GPU's work is a fraction of a millisecond.
A CUDA graph records those launches once and replays them in one call.

Graphs have fixed shapes and fixed addresses, and a continuous batch changes both at
every step: rows join and leave, and the cache's window `[start, end)` slides along the
buffers of `kv_slots.KvSlots`. So a graphed step runs on fixed views instead: the rows
padded up to the next bucket, and the cache's columns up to the next power of two past
`end` (at most the buffers' length). Three small tensors carry what changes: each row's
last token, its position, and the window's bounds. Inside the graph the new token's keys
and values are written at column `end` (read from a tensor, not baked in), and the
attention mask is built from the slots' row mask, cut to the window: columns outside it
hold other rows' old keys, and are masked out. A padded row attends at least to its own
new column, so nothing it computes is NaN (its keys land in a free row of the buffers,
which a joining row overwrites where it reads).

A graph per (rows, columns) bucket is recorded the first time a step of that shape runs,
and checked once against the step run as it is (a GPU worker's warm-up records the
common ones: `ContinuousBatcher.record_graphs`). When the slots allocate new buffers (the
batch outgrew them, or a failed step dropped them) the graphs go: they read the old
addresses (on a GPU the first buffers are roomy, so this is rare). Models whose
attention takes no 4D mask (flash attention) or slides a window run as they are.

Worker process only (imports torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from rawserve.worker.cuda_graphs import ROW_BUCKETS, GraphShelf, check_close, rows_bucket
from rawserve.worker.kv_slots import KvSlots, SlotLayer

log = logging.getLogger("rawserve.generation")

# the fewest columns a graph attends over: fewer shapes (recording one stalls every
# sequence, ~30 ms on an H100) for a little more attention at the start
MIN_COLUMNS = 128
# shapes recorded at most, the rest run as they are: every row bucket (14 up to 256
# rows) at every column bucket up to 2,048 (5), with room
MAX_DECODE_GRAPHS = 128
CHECK_TOLERANCE = 5e-2  # a first replay's logits against the step run as it is (fp16)
MASKABLE = ("sdpa", "eager")  # attention implementations that take a 4D additive mask


def column_bucket(end: int, length: int) -> int:
    """The columns a step attends over: the next power of two past `end` (the new
    token's column), at least MIN_COLUMNS, at most the buffers' `length`."""
    columns = MIN_COLUMNS
    while columns <= end:
        columns *= 2
    return min(columns, length)


def row_bucket(rows: int, capacity: int) -> int | None:
    """The rows a step runs at: the next bucket, at most the buffers' rows (which grow
    rarely: a graph of their size fits any count below); None past the largest bucket."""
    padded = rows_bucket(rows)
    return None if padded is None else min(padded, capacity)


class FixedLayer(SlotLayer):
    """A layer's cache inside a graph: the new column is written where `bounds[1]` says,
    and the model sees the first `columns` columns of the first `rows` rows."""

    def __init__(self, slots: KvSlots, index: int, rows: int, columns: int, bounds: torch.Tensor):
        super().__init__(slots, index)
        self.rows, self.columns, self.column = rows, columns, bounds[1:2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.slots.keys[self.index][: self.rows]
        values = self.slots.values[self.index][: self.rows]
        keys.index_copy_(2, self.column, key_states)
        values.index_copy_(2, self.column, value_states)
        self.keys, self.values = keys[:, :, : self.columns], values[:, :, : self.columns]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.columns


@dataclass
class Captured:
    graph: Any  # torch.cuda.CUDAGraph (or, in tests, whatever replays the step)
    logits: torch.Tensor  # what the graph writes: [rows, 1, vocabulary]


class GraphedDecode:
    """`step(slots, last, positions)` → the running rows' logits for their next token,
    replayed from a graph; None where no graph serves (run the step as it is).

    Call it after `slots.open_column()` and before `close_column()`: the new column's
    mask is set, and `end` is where its keys go. One thread calls it (the loop's)."""

    def __init__(self, model: Any, cache_name: str):
        self.model = model
        self.cache_name = cache_name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.shelf = GraphShelf(self.device, "a decoding step", MAX_DECODE_GRAPHS)
        self.slots: KvSlots | None = None  # the buffers the graphs read
        self.layout = -1  # and their allocation
        rows = ROW_BUCKETS[-1]
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.bounds = torch.zeros(2, dtype=torch.long, device=self.device)  # start, end

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether the graphs' own 4D masks stand for the model's: its attention takes
        one, and attends to the whole sequence (the graphs' masks have no sliding
        window)."""
        config = model.config
        if getattr(config, "_attn_implementation", None) not in MASKABLE:
            return False
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return False
        return not any(
            "sliding" in str(kind) for kind in getattr(config, "layer_types", None) or ()
        )

    def step(
        self,
        slots: KvSlots,
        last: torch.Tensor,
        positions: torch.Tensor,
        as_is: Callable[[], torch.Tensor],
    ) -> torch.Tensor | None:
        """`as_is()`: the loop's own step on the same inputs, which a new graph's first
        replay is checked against."""
        rows = len(last)
        shape = self._shape(slots, rows)
        if shape is None:
            return None
        self._fill(slots, last, positions)
        captured = self.shelf.replay(shape, lambda: self._capture(slots, shape, rows, as_is))
        return None if captured is None else captured.logits[:rows, -1, :]

    def _shape(self, slots: KvSlots, rows: int) -> tuple[int, int] | None:
        """The (rows, columns) bucket this step runs at; None: no graph serves it."""
        if slots is not self.slots or slots.layout != self.layout:
            self.shelf.forget()  # the graphs read buffers that are gone
            self.slots, self.layout = slots, slots.layout
        capacity, length = slots.capacity
        count = row_bucket(rows, capacity)
        if count is None:
            return None
        shape = count, column_bucket(slots.end, length)
        return shape if self.shelf.has_room(shape) else None

    def _fill(self, slots: KvSlots, last: torch.Tensor, positions: torch.Tensor) -> None:
        rows = len(last)
        self.ids[:rows, 0].copy_(last)
        self.positions[:rows, 0].copy_(positions)
        self.bounds[0].fill_(slots.start)
        self.bounds[1].fill_(slots.end)

    def fixed_step(self, slots: KvSlots, rows: int, columns: int) -> torch.Tensor:
        """The step on the fixed views of a (rows, columns) bucket: what a graph records."""
        window = slots.row_mask[:rows, :columns] != 0
        column = torch.arange(columns, device=self.device)
        start, end = self.bounds[0], self.bounds[1]
        seen = (window & (column >= start) & (column <= end)) | (column == end)
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~seen, torch.finfo(self.dtype).min)[:, None, None, :]
        layers = [FixedLayer(slots, i, rows, columns, self.bounds) for i in range(len(slots.keys))]
        out = self.model(
            input_ids=self.ids[:rows],
            attention_mask=mask,
            position_ids=self.positions[:rows],
            **{self.cache_name: transformers.Cache(layers=layers)},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits

    def _capture(
        self,
        slots: KvSlots,
        shape: tuple[int, int],
        rows: int,
        as_is: Callable[[], torch.Tensor],
    ) -> Captured:
        """Record the bucket's graph on this step's inputs, and check its first replay
        against the step run as it is (which writes the same keys into the same column)."""
        expected = as_is()
        graph, logits = self._record(slots, *shape)
        graph.replay()
        difference = check_close(logits[:rows, -1, :], expected, CHECK_TOLERANCE)
        log.info("CUDA graphs: recorded a decoding step of %d rows x %d columns "
                 "(first replay within %.2g)", *shape, difference)  # fmt: skip
        return Captured(graph, logits)

    def _record(self, slots: KvSlots, rows: int, columns: int) -> tuple[Any, torch.Tensor]:
        """The fixed step recorded: the graph, and the logits tensor it writes."""
        return self.shelf.record(lambda: self.fixed_step(slots, rows, columns))
