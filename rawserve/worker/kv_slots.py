"""The KV cache of a continuously batched causal LM: one preallocated buffer per layer.

Worker process only (imports torch). `KvSlots` keeps, per layer, a key and a value buffer
`[row_capacity, heads, length_capacity, head_dim]` and an attention-mask buffer
`[row_capacity, length_capacity]`; the batch's cache is the window `[:rows, :, start:end]`
of them. Rows are aligned at their right end (column `end - 1` is every row's newest
token); the columns before a row's own tokens are masked.

Why: a `DynamicCache` concatenates the whole cache at every decoding step, and joining or
leaving rows had to pad, concatenate or index every layer's tensors again; that copying
was 40 % of a step's time on the CPU. Here a step writes one column in place and hands the
model views; a leaving row's slot is filled by copying one later row into it; joining rows
are written into free rows; columns no row needs any more are dropped by moving `start`.
Only when the buffer is full does it move its window (compacted to column 0, or into a
buffer twice as long), which is rare and amortised.

`SlotLayer` is the transformers cache layer that the model sees: its `update` writes the
new token's keys and values at column `end` and returns the views up to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.cache_utils import DynamicLayer

FIRST_LENGTH_CAPACITY = 64  # columns allocated at least, so short batches never regrow
GPU_CACHE_SHARE = 0.25  # of a GPU's free memory that the first buffers may take


class SlotLayer(DynamicLayer):
    """One model layer's view of the slots: no storage of its own."""

    def __init__(self, slots: KvSlots, index: int):
        super().__init__()
        self.slots = slots
        self.index = index
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots
        rows, end = slots.rows, slots.end
        stop = end + key_states.shape[-2]
        keys, values = slots.keys[self.index], slots.values[self.index]
        keys[:rows, :, end:stop] = key_states
        values[:rows, :, end:stop] = value_states
        self.keys = keys[:rows, :, slots.start : stop]
        self.values = values[:rows, :, slots.start : stop]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.slots.end - self.slots.start


class KvSlots:
    """The batch's keys and values, in buffers that grow rarely and are written in place."""

    def __init__(
        self,
        device: torch.device,
        max_rows: int,
        max_length: int = 0,
        release_when_idle: bool = False,
    ):
        self.device = device
        self.release_when_idle = release_when_idle  # drop the buffers once no row runs
        self.max_rows = max_rows  # rows are never allocated past it
        self.max_length = max_length  # the longest sequence the model takes (0: unknown)
        # a GPU's free bytes (None on a CPU): there the first buffers are made roomy
        self.free_memory = _free_gpu_memory(device)
        self.rows = 0
        self.start = 0  # the first column a row still needs
        self.end = 0  # one past every row's newest token
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self._layers: list[SlotLayer] = []
        self.layout = 0  # counts the buffers' allocations (graphs read their addresses)

    @property
    def mask(self) -> torch.Tensor:
        """The running rows' attention mask over the columns `[start, end)`."""
        return self._mask[: self.rows, self.start : self.end]

    @property
    def row_mask(self) -> torch.Tensor:
        """The whole mask buffer: every row and column allocated, in use or not."""
        return self._mask

    @property
    def capacity(self) -> tuple[int, int]:
        """Rows and columns allocated."""
        return self._mask.shape[0], self._mask.shape[1]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values for the running rows, columns `[start, end)`."""
        window = (slice(None, self.rows), slice(None), slice(self.start, self.end))
        return self.keys[layer][window], self.values[layer][window]

    def join(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor
    ) -> None:
        """Add rows prefilled on their own (`[k, heads, width, dim]` per layer, and their
        `[k, width]` mask) after the running ones, their last column at `end - 1`."""
        count, width = mask.shape
        if not self.keys:
            self._allocate(keys, values, count, width)
        if self.end < width:  # no room on the left: move the window right
            self._rebuild(
                self._mask.shape[0], max(self._mask.shape[1], width + 1), width - self.end
            )
        rows = self.rows + count
        if rows > self._mask.shape[0]:
            grown = max(rows, min(2 * self._mask.shape[0], self.max_rows))
            self._rebuild(grown, self._mask.shape[1], 0)
        first = self.end - width
        if first < self.start:  # the running rows' columns before theirs are not theirs
            self._mask[: self.rows, first : self.start] = 0
            self.start = first
        for buffer, new in zip(self.keys + self.values, keys + values, strict=True):
            buffer[self.rows : rows, :, first : self.end] = new
        self._mask[self.rows : rows, self.start : first] = 0
        self._mask[self.rows : rows, first : self.end] = mask
        self.rows = rows

    def row_columns(
        self, row: int, first: int, stop: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A copy of one row's keys and values over the columns `[first, stop)`, per layer
        `[1, heads, stop - first, dim]` as a prefill makes them (to join another row)."""
        window = (slice(row, row + 1), slice(None), slice(first, stop))
        return [k[window].clone() for k in self.keys], [v[window].clone() for v in self.values]

    def open_column(self) -> tuple[transformers.Cache, torch.Tensor]:
        """Before a decoding step: the cache to hand the model, and the mask with the new
        token's column. `close_column` after the step takes the column in."""
        if self.end == self._mask.shape[1]:
            length = self._mask.shape[1]
            # compact in place when that frees half the buffer, else double it
            grown = length if 2 * self.start >= length else 2 * length
            self._rebuild(self._mask.shape[0], grown, -self.start)
        self._mask[: self.rows, self.end] = 1
        mask = self._mask[: self.rows, self.start : self.end + 1]
        return transformers.Cache(layers=list(self._layers)), mask

    def close_column(self) -> None:
        self.end += 1

    def keep(self, kept: list[bool]) -> tuple[list[int], list[int]]:
        """Drop the rows not kept: each hole below the new row count is filled by copying
        one of the kept rows above it. Returns those moves (holes, rows moved into them)
        for the caller to make in its own per-row lists; then drops the leading columns
        no row needs any more."""
        count = sum(kept)
        holes = [i for i in range(count) if not kept[i]]
        movers = [i for i in range(count, len(kept)) if kept[i]]
        if holes:
            into = torch.tensor(holes, device=self.device)
            source = torch.tensor(movers, device=self.device)
            window = slice(self.start, self.end)
            for buffer in self.keys + self.values:
                buffer[into, :, window] = buffer[source, :, window]
            self._mask[into, window] = self._mask[source, window]
        self.rows = count
        if not count:
            self.start = self.end = 0
            if self.release_when_idle:  # its memory back while no row runs
                self._release()
            return holes, movers
        used = self.mask.any(dim=0).nonzero()
        self.start += int(used[0]) if len(used) else self.end - self.start
        return holes, movers

    def _allocate(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, width: int
    ) -> None:
        length = max(FIRST_LENGTH_CAPACITY, 2 * width)
        if self.free_memory is not None:
            rows, length = self._roomy(keys, rows, length)

        def empty(like: torch.Tensor) -> torch.Tensor:
            heads, dim = like.shape[1], like.shape[3]
            return torch.zeros((rows, heads, length, dim), dtype=like.dtype, device=self.device)

        self.keys = [empty(k) for k in keys]
        self.values = [empty(v) for v in values]
        self._mask = torch.zeros((rows, length), dtype=torch.long, device=self.device)
        self._layers = [SlotLayer(self, i) for i in range(len(keys))]
        self.start = self.end = 0
        self.layout += 1

    def _release(self) -> None:
        """Drop the buffers; the next join allocates them at its own size. For a CPU's,
        which a burst of long prompts grew for good (a tester's tiny model kept 50 MB; a
        0.5B model's 64 rows of 4,096 positions would keep gigabytes) and whose addresses
        nothing reads; a GPU's stay, as the CUDA graphs read them."""
        self.keys, self.values, self._layers = [], [], []
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.layout += 1

    def _roomy(self, keys: list[torch.Tensor], rows: int, length: int) -> tuple[int, int]:
        """On a GPU: every row the batch may hold, and the columns (a power of two times
        `length`) that GPU_CACHE_SHARE of the free memory holds, up to twice the model's
        length (the window is never longer than the model's length, so the buffers then
        compact and never grow); `rows` x `length` if not even that fits. Why: new
        buffers drop the decoding steps' CUDA graphs (they read the old addresses), and
        recording them anew stalls every running sequence."""
        assert self.free_memory is not None
        per_token = 2 * sum(k.shape[1] * k.shape[3] * k.element_size() for k in keys)
        tokens = int(self.free_memory() * GPU_CACHE_SHARE) // per_token
        if self.max_rows * length > tokens:
            return rows, length
        columns = length
        while self.max_rows * columns * 2 <= tokens and columns <= self.max_length:
            columns *= 2
        return self.max_rows, columns

    def _rebuild(self, rows: int, length: int, shift: int) -> None:
        """New buffers of `rows` x `length` holding the running rows' window, `shift`
        columns to the right of where it was."""
        old = self._mask.shape
        if (rows, length) != old:
            window = slice(self.start, self.end)
            moved = slice(self.start + shift, self.end + shift)

            def grown(buffer: torch.Tensor) -> torch.Tensor:
                shape = (rows, buffer.shape[1], length, buffer.shape[3])
                new = torch.zeros(shape, dtype=buffer.dtype, device=self.device)
                new[: self.rows, :, moved] = buffer[: self.rows, :, window]
                return new

            self.keys = [grown(k) for k in self.keys]
            self.values = [grown(v) for v in self.values]
            mask = torch.zeros((rows, length), dtype=torch.long, device=self.device)
            mask[: self.rows, moved] = self._mask[: self.rows, window]
            self._mask = mask
            self.layout += 1
        elif shift:
            self._shift(shift)
            return
        self.start += shift
        self.end += shift

    def _shift(self, shift: int) -> None:
        """Move the running rows' window `shift` columns (either way) in place."""
        if not shift:
            return
        window = slice(self.start, self.end)
        moved = slice(self.start + shift, self.end + shift)
        for buffer in self.keys + self.values:
            buffer[: self.rows, :, moved] = buffer[: self.rows, :, window].clone()
        self._mask[: self.rows, moved] = self._mask[: self.rows, window].clone()
        self.start += shift
        self.end += shift


def _free_gpu_memory(device: torch.device) -> Callable[[], int] | None:
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.mem_get_info(device)[0]
