"""Beam search on causal_lm's static path. A model whose generation config sets
`num_beams` above 1 is batched statically, and `generate`'s beam search hands its hooks
candidates, not the batch's rows: batch × beams of them (twice that for its stopping
criteria), picked anew at each step. `TokenWatcher` follows each row a token at a time
and cannot watch them (it failed every request: a 500). So a stop sequence is looked for
in each candidate's whole text (`BeamStops`), and once `generate` is done the watcher
follows the answers it returns, a token at a time (`replay`): their texts, stop
sequences, finish reasons and TGI's tokens come as every other answer's do.

Worker process only (imports torch and transformers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

from rawserve.tasks.text_generation import GRAMMAR_REFUSED, first_stop_end
from rawserve.worker.generate_hooks import TokenWatcher
from rawserve.worker.text_pieces import generated_text

# what a request with a grammar is told: each candidate would need its own matcher,
# carried over to whichever candidates continue it
BEAMS_REFUSE_GRAMMARS = (
    GRAMMAR_REFUSED + "the model's generation config sets num_beams={}, and a beam search's "
    "candidates cannot be held to a grammar"
)


def beam_count(model: Any) -> int:
    """The beams `generate` searches with: the model's generation config's (a request
    cannot set them for text-generation)."""
    return int(getattr(model.generation_config, "num_beams", None) or 1)


class BeamStops(transformers.StoppingCriteria):
    """Ends each beam-search candidate whose text holds a stop sequence (ending in its
    `stops_after`th token or later, as `TokenWatcher` counts them), and every candidate
    once the batch is cancelled. A candidate continues a different one at each step, so
    each is read whole: nothing carries over."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_width: int,
        contexts: Sequence[Sequence[int]],  # each prompt's (`prompt_context`), in order
        stop: Sequence[str],
        stops_after: int,
        cancelled: Callable[[], bool],
    ):
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width
        self.contexts = contexts
        self.stop = list(stop)
        self.stops_after = stops_after
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        rows = input_ids.shape[0]
        if self.cancelled():
            ended = [True] * rows
        elif self.stop:
            per_prompt = rows // len(self.contexts)  # each prompt's candidates, together
            made = input_ids[:, self.prompt_width :].tolist()
            ended = [
                self.stopped(ids, self.contexts[row // per_prompt]) for row, ids in enumerate(made)
            ]
        else:
            ended = [False] * rows
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)

    def stopped(self, ids: list[int], context: Sequence[int]) -> bool:
        if len(ids) < self.stops_after:
            return False
        before = ids[: self.stops_after - 1]  # (min_new_tokens: no stop ends in them)
        past = len(generated_text(self.tokenizer, before, context)) if before else 0
        text = generated_text(self.tokenizer, ids, context)
        return first_stop_end(text, self.stop, past) is not None


def replay(watcher: TokenWatcher, answers: torch.Tensor, lengths: Sequence[int]) -> None:
    """Walk `generate`'s answers (their new tokens: each row's first `lengths[row]`, then
    padding) through `watcher` a token at a time, as its steps would have been: each row
    ends where its answer does (an end token, a stop sequence, else its length). Each
    answer's last token is told so: the text it held back (a space a clean-up may yet
    take) may hold the stop sequence that ended it."""
    watcher.lengths = [
        min(length, cap) for length, cap in zip(lengths, watcher.lengths, strict=True)
    ]
    for step in range(answers.shape[1]):
        for row, length in enumerate(lengths):
            if step >= length:
                watcher.done[row] = True  # (its finish reason stays "length")
        if all(watcher.done):
            return
        watcher(answers[:, : step + 1], None)
