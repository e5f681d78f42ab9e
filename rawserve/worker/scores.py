"""A row's scores before a token is chosen, and what is read from them after: the
repetition penalty, OpenAI's logit bias and penalties (`ScoreAdjustments`), the
probabilities a sampled token is drawn from, and the likeliest tokens listed beside it.

Worker process only (imports torch). Shared by both generation paths: the continuous
loop (`continuous`) applies them step by step, `causal_lm` hands `generate` the
adjustments as a logits processor and lists the likeliest tokens from its scores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# the least temperature a draw divides by: below it a row's scores could overflow to
# infinities and leave nothing to draw from (at it, the draw is all but greedy)
MIN_TEMPERATURE = 1e-5


class Sampling(Protocol):
    """A sampled row's settings (a `continuous.Generation`)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    typical_p: float | None


@dataclass(frozen=True)
class ScoreAdjustments:
    """OpenAI's changes to a row's scores before a token is chosen, after the repetition
    penalty (as `generate` applies its own processors first): `logit_bias` added to the
    tokens it names, then `frequency_penalty` taken off a token's score for each time it
    was generated and `presence_penalty` once if it was (the new tokens only, not the
    prompt's, as vLLM counts them)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # the bias's tokens and values on the scores' device, copied there at the first step:
    # copied at every step, each copy waited for the device (a GPU's queue), a row at a time
    biased: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def asked(cls, params: Mapping[str, Any], vocabulary: int) -> ScoreAdjustments | None:
        """The adjustments `params` ask for (None: none); ValueError for a biased token
        the model does not have."""
        bias = tuple((int(k), float(v)) for k, v in (params.get("logit_bias") or {}).items())
        unknown = [token for token, _ in bias if not 0 <= token < vocabulary]
        if unknown:
            raise ValueError(
                f"logit_bias names the token id {unknown[0]}, which is not in the model's "
                f"vocabulary (ids run from 0 to {vocabulary - 1})"
            )
        adjustments = cls(
            bias,
            float(params.get("frequency_penalty") or 0.0),
            float(params.get("presence_penalty") or 0.0),
        )
        return adjustments if adjustments != cls() else None

    @property
    def penalizes(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    def apply(self, scores: torch.Tensor, made: torch.Tensor) -> None:
        """Rows of scores, in place, given the tokens each row generated so far (`made`: a
        row of ids each)."""
        if self.logit_bias:
            key = scores.device, scores.dtype
            if key not in self.biased:
                tokens, biases = zip(*self.logit_bias, strict=True)
                self.biased[key] = (
                    torch.tensor(tokens, device=scores.device),
                    torch.tensor(biases, dtype=scores.dtype, device=scores.device),
                )
            tokens_on, biases_on = self.biased[key]
            scores.index_add_(1, tokens_on, biases_on.expand(len(scores), -1))
        if made.shape[1] == 0 or not self.penalizes:
            return
        counts = torch.zeros_like(scores).scatter_add_(
            1, made, torch.ones(made.shape, dtype=scores.dtype, device=scores.device)
        )
        scores -= counts * self.frequency_penalty + (counts > 0) * self.presence_penalty


def unusable(scores: torch.Tensor) -> torch.Tensor:
    """Which rows of a model's own scores (batch, vocabulary), before any setting of the
    request touched them, no token can be chosen from: one NaN or +inf, or no finite
    score at all. One reduction tells all three: a row's maximum is NaN where it holds a
    NaN (max propagates it), +inf where it holds +inf, and -inf where nothing is finite;
    it runs at every step of every row, over the whole vocabulary."""
    return ~scores.amax(-1).isfinite()


class TokenRun:
    """A sequence's token ids as a tensor on the device, grown by its new tokens at each
    step (in a buffer that doubles when full). Why: made anew from the Python lists at
    every step, a penalized row's tensor cost it time that grew with its sequence, ~0.2 ms
    a step at 1,000 tokens on a CPU, more than a small model's decoding step on a GPU."""

    def __init__(self, first: Sequence[int], device: torch.device):
        self.device = device
        self._buffer = torch.tensor(list(first), dtype=torch.long, device=device)
        self.length = len(first)
        self.taken = 0  # of the new tokens

    def after(self, tokens: Sequence[int]) -> torch.Tensor:
        """The ids: the first ones, then `tokens` (the sequence's new tokens so far, of
        which those not taken yet are added)."""
        new = tokens[self.taken :]
        if new:
            length = self.length + len(new)
            if length > len(self._buffer):
                grown = torch.empty(2 * length, dtype=torch.long, device=self.device)
                grown[: self.length] = self._buffer[: self.length]
                self._buffer = grown
            if len(new) == 1:  # (a step's: one write)
                self._buffer[self.length] = new[0]
            else:
                self._buffer[self.length : length] = torch.tensor(new, device=self.device)
            self.length, self.taken = length, len(tokens)
        return self._buffer[: self.length]


def penalize_repetition(scores: torch.Tensor, penalty: float, seen: torch.Tensor) -> None:
    """transformers' repetition penalty on one row's scores, in place: every token already
    in the sequence (`seen`: its prompt's and new tokens' ids) scores lower."""
    score = scores.gather(0, seen)
    scores.scatter_(0, seen, torch.where(score < 0, score * penalty, score / penalty))


def sampling_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """What a token is drawn from, for one row's logits: its temperature, top-k, top-p,
    min-p and typical_p, in `generate`'s order."""
    logits = logits / max(sampling.temperature, MIN_TEMPERATURE)
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        # as transformers' TopPLogitsWarper (and vLLM) cut: the least likely tokens go while
        # their mass stays within 1 - top_p (a token that brings the rest to exactly top_p
        # goes too; of tied ones, the same as there), the likeliest always stays
        ordered, order = torch.sort(logits)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        drop[-1] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if sampling.min_p:  # not a token less likely than min_p times the likeliest
        probabilities = logits.softmax(-1)
        unlikely = probabilities < sampling.min_p * probabilities.max()
        logits = logits.masked_fill(unlikely, float("-inf"))
    if sampling.typical_p is not None and sampling.typical_p < 1.0:
        logits = typical(logits, sampling.typical_p)
    return logits.softmax(-1)


def typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Typical decoding (Meister et al.) on one row's logits, as transformers'
    `TypicalLogitsWarper` does it: the tokens whose surprise is nearest the row's entropy,
    nearest first, up to the first that brings their probability to `mass` (at least one)."""
    logprobs = logits.log_softmax(-1)
    entropy = -(logprobs * logprobs.exp()).nansum()
    distance, order = torch.sort((-logprobs - entropy).abs())
    cumulative = logits[order].softmax(-1).cumsum(-1)
    # (kept on the device: read back, it was a round trip to a GPU a row at every step)
    last = (cumulative < mass).sum().clamp(max=len(order) - 1)
    drop = distance > distance[last[None]]  # (a 0-d index would be read back too)
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))


def likeliest(logprobs: torch.Tensor, count: int) -> list[list[tuple[int, float]]] | None:
    """Each row's `count` likeliest tokens, (id, log-probability), likeliest first; None
    for a count of 0. A token that cannot be chosen (a grammar or min_new_tokens rules it
    out: its log probability is -inf, which JSON cannot carry) is not listed."""
    if count <= 0:
        return None
    values, ids = logprobs.topk(min(count, logprobs.shape[-1]), dim=-1)
    return [
        [(i, value) for i, value in zip(row_ids, row_values, strict=True) if value > -math.inf]
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]
