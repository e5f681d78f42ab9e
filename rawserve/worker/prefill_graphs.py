"""The prefill of sequences joining a continuous batch, replayed from CUDA graphs.

Once the decoding steps are replayed (rawserve.worker.decode_graphs), a joining
sequence's prefill is what a small model's loop spends most on: on an H100 a
GPT-2-small-sized forward pass over one short prompt takes ~6 ms from Python against
~1 ms for a replayed step, and a closed-loop client joins whenever another finishes. So
the prefill of short prompts is recorded too, a graph per bucket of rows and tokens
(powers of two: 36 shapes at most, each recorded once).

The joining prompts come left-padded (their last tokens aligned); a bucket pads them
further on the left to its tokens, and adds rows. Inside the graph each row's positions
come from its mask, and the attention mask (causal, padding hidden) is built from it; a
padded position also attends to itself, so nothing it computes is NaN. Each layer's new
keys and values are the graph's outputs; the loop copies the batch's part of them into
its cache (`KvSlots.join`), as it does with the prefill run as it is.

A graph's outputs keep their memory (keys and values for every padded token), so only
small prefills are recorded (`MAX_PREFILL_TOKENS`, and no more than `MAX_PREFILL_BYTES`
of keys and values for one): larger ones are bound by their arithmetic, not by their
launches, and run as they are.

Worker process only (imports torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers.cache_utils import DynamicLayer

from rawserve.worker.cuda_graphs import GraphShelf, check_close

log = logging.getLogger("rawserve.generation")

MAX_PREFILL_TOKENS = 1024  # padded rows x tokens recorded at most
MAX_PREFILL_BYTES = 64 << 20  # keys and values one graph keeps, at most
MIN_PREFILL_TOKENS = 8
# every shape of powers of two within MAX_PREFILL_TOKENS: recorded once each, so the
# stalls of recording are bounded over a server's life
MAX_PREFILL_GRAPHS = 36
CHECK_TOLERANCE = 5e-2  # a first replay's logits against the prefill as it is (fp16)


class OutputLayer(DynamicLayer):
    """A layer's cache in a prefill with no past: the new keys and values are kept as
    they come (the graph's outputs), nothing is concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0  # no past: the prompt is all there is


@dataclass
class Captured:
    graph: Any  # torch.cuda.CUDAGraph (or, in tests, whatever replays the prefill)
    ids: torch.Tensor  # what the graph reads: [rows, tokens]
    mask: torch.Tensor
    logits: torch.Tensor  # what it writes: the last position's, [rows, 1, vocabulary]
    layers: list[OutputLayer]  # and each layer's keys and values, [rows, heads, tokens, dim]


Prefilled = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]


class GraphedPrefill:
    """`prefill(ids, mask)` → each layer's keys and values and the last position's logits
    for the joining rows (left-padded `[rows, width]`), replayed from a graph; None where
    no graph serves (run the prefill as it is). One thread calls it (the loop's)."""

    def __init__(
        self,
        model: Any,
        cache_name: str,
        max_positions: int,
        as_is: Callable[[torch.Tensor, torch.Tensor], Prefilled],
    ):
        self.model = model
        self.as_is = as_is  # the prefill run as it is: a first replay is checked against it
        self.cache_name = cache_name
        self.max_positions = max_positions
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.shelf = GraphShelf(self.device, "a prefill", MAX_PREFILL_GRAPHS)
        self.layers = model.config.num_hidden_layers
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.bytes_per_token = 2 * self.layers * model.config.hidden_size * itemsize

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Prefilled | None:
        rows, width = ids.shape
        shape = self._shape(rows, width)
        if shape is None:
            return None
        captured = self.shelf.replay(
            shape,
            lambda: self._capture(shape, ids, mask),
            lambda captured: fill(ids, mask, captured.ids, captured.mask),
        )
        if captured is None:
            return None
        columns = slice(shape[1] - width, None)
        keys = [layer.keys[:rows, :, columns] for layer in captured.layers]
        values = [layer.values[:rows, :, columns] for layer in captured.layers]
        return keys, values, captured.logits[:rows, -1, :]

    def _shape(self, rows: int, width: int) -> tuple[int, int] | None:
        """Rows and tokens padded to powers of two (tokens no more than the model
        reads): few shapes, each recorded once, for at most twice the arithmetic of a
        pass that its launches outweigh; None: run as it is."""
        if width > self.max_positions:
            return None
        shape = (
            power_of_two(rows),
            min(power_of_two(max(width, MIN_PREFILL_TOKENS)), self.max_positions),
        )
        if shape[0] * shape[1] > MAX_PREFILL_TOKENS:
            return None
        if shape[0] * shape[1] * self.bytes_per_token > MAX_PREFILL_BYTES:
            return None
        return shape if self.shelf.has_room(shape) else None

    def fixed_prefill(
        self, ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[OutputLayer]]:
        """The prefill of a bucket's `ids` and `mask`: what a graph records."""
        tokens = ids.shape[1]
        position = torch.arange(tokens, device=self.device)
        causal = position[None, :] <= position[:, None]  # [query, key]
        seen = (causal[None] & (mask[:, None, :] != 0)) | torch.eye(
            tokens, dtype=torch.bool, device=self.device
        )
        additive = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        additive = additive.masked_fill(~seen, torch.finfo(self.dtype).min)[:, None]
        layers = [OutputLayer() for _ in range(self.layers)]
        out = self.model(
            input_ids=ids,
            attention_mask=additive,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            **{self.cache_name: transformers.Cache(layers=layers)},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits, layers

    def _capture(self, shape: tuple[int, int], ids: torch.Tensor, mask: torch.Tensor) -> Captured:
        """Record the bucket's graph on the joining rows, padded, and check its first
        replay against the prefill run as it is."""
        bucket_ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        bucket_mask = torch.zeros(shape, dtype=torch.long, device=self.device)
        fill(ids, mask, bucket_ids, bucket_mask)
        graph, (logits, layers) = self._record(bucket_ids, bucket_mask)
        expected = self.as_is(ids, mask)[2]
        graph.replay()
        difference = check_close(logits[: len(ids), -1, :], expected, CHECK_TOLERANCE)
        log.info("CUDA graphs: recorded a prefill of %d rows x %d tokens "
                 "(first replay within %.2g)", *shape, difference)  # fmt: skip
        return Captured(graph, bucket_ids, bucket_mask, logits, layers)

    def _record(
        self, ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[Any, tuple[torch.Tensor, list[OutputLayer]]]:
        """The fixed prefill recorded: the graph, and the logits and layers it writes."""
        return self.shelf.record(lambda: self.fixed_prefill(ids, mask))


def power_of_two(count: int) -> int:
    """The smallest power of two at least `count`."""
    return 1 << (count - 1).bit_length()


def fill(ids: torch.Tensor, mask: torch.Tensor, into_ids: torch.Tensor, into_mask: torch.Tensor):
    """The joining rows into a bucket's tensors, aligned at the right (the last token in
    the last column); zeros elsewhere, and each padded row attending to its last column."""
    rows, width = ids.shape
    into_ids.zero_()
    into_mask.zero_()
    into_ids[:rows, -width:].copy_(ids)
    into_mask[:rows, -width:].copy_(mask)
    into_mask[rows:, -1] = 1
