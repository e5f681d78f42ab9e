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

from rawserve.tasks.text_generation import SEQUENCE_FREQUENCY_PENALTY

# the least temperature a draw divides by: below it a row's scores could overflow to
# infinities and leave nothing to draw from (at it, the draw is all but greedy)
MIN_TEMPERATURE = 1e-5


def at_least_the_least_temperature(options: dict[str, Any]) -> None:
    """generate() options that sample drawing at no less than MIN_TEMPERATURE, as the
    continuous loop draws (below it every draw was the end: an empty answer); in place."""
    if options.get("do_sample") and options.get("temperature", 1.0) < MIN_TEMPERATURE:
        options["temperature"] = MIN_TEMPERATURE


class Sampling(Protocol):
    """A sampled row's settings (a `continuous.Generation`)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    typical_p: float | None


@dataclass(frozen=True)
class ScoreAdjustments:
    """OpenAI's and TGI's changes to a row's scores before a token is chosen, after the
    repetition penalty (as `generate` applies its own processors first): `logit_bias`
    added to the tokens it names, then `frequency_penalty` taken off a token's score for
    each time it was generated and `presence_penalty` once if it was (the new tokens only,
    not the prompt's, as vLLM counts them); TGI's `sequence_frequency_penalty` taken off
    times the token's share of the whole sequence so far, its prompt's tokens too (as TGI
    reads its `frequency_penalty`)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sequence_frequency_penalty: float = 0.0
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
            float(params.get(SEQUENCE_FREQUENCY_PENALTY) or 0.0),
        )
        return adjustments if adjustments != cls() else None

    @property
    def penalizes(self) -> bool:
        """Whether it reads the tokens each row generated (`made`)."""
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def reads_sequence(self) -> bool:
        """Whether it reads each row's whole sequence, its prompt too (`sequence`)."""
        return bool(self.sequence_frequency_penalty)

    def apply(
        self,
        scores: torch.Tensor,
        made: torch.Tensor,
        sequence: torch.Tensor | None = None,
        counted: torch.Tensor | None = None,
    ) -> None:
        """Rows of scores, in place, given the tokens each row generated so far (`made`: a
        row of ids each) and, where it `reads_sequence`, each row's prompt and new tokens
        (`sequence`, rows of ids; `counted`: True where a place holds one of the row's
        tokens, False where it holds padding; None: every place does)."""
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
        if self.reads_sequence and sequence is not None and sequence.shape[1]:
            self._penalize_shares(scores, sequence, counted)
        if made.shape[1] == 0 or not self.penalizes:
            return
        ones = torch.ones(made.shape, dtype=scores.dtype, device=scores.device)
        # each generated token's count, where it was generated
        counts = torch.zeros_like(scores).scatter_add_(1, made, ones).gather(1, made)
        # only the generated tokens' scores change (taken off the whole vocabulary, a
        # penalty cost a row five passes over it): each is written once for every time it
        # was generated, each time the same
        penalty = counts * self.frequency_penalty + (counts > 0) * self.presence_penalty
        scores.scatter_(1, made, scores.gather(1, made) - penalty)

    def _penalize_shares(
        self, scores: torch.Tensor, sequence: torch.Tensor, counted: torch.Tensor | None
    ) -> None:
        """TGI's frequency penalty: each token of a row's sequence scores lower by the
        penalty times the share of the sequence it makes up. A padding place counts for
        nothing, and its token's score is written with what its count says (the same
        value wherever that token stands)."""
        if counted is None:
            weights = torch.ones(sequence.shape, dtype=scores.dtype, device=scores.device)
        else:
            weights = counted.to(scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, sequence, weights).gather(1, sequence)
        lengths = weights.sum(1, keepdim=True).clamp(min=1.0)
        penalty = counts / lengths * self.sequence_frequency_penalty
        scores.scatter_(1, sequence, scores.gather(1, sequence) - penalty)


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


def sampling_probabilities(logits: torch.Tensor, rows: Sequence[Sampling]) -> torch.Tensor:
    """What each row's token is drawn from, for the rows' logits (rows, vocabulary), each
    with its own settings: its temperature, top-k, top-p, min-p and typical_p, in
    `generate`'s order. The rows go through together, each row's numbers its own whatever
    its batch-mates: a row at a time, sampling cost 7 to 44 operations a row at every step
    (on a GPU as many launches, 11,000 a step at 256 rows of LangChain's TGI settings),
    and sorted a row at a time for top-p, more than the model's step on a CPU."""

    def column(values: Sequence[float]) -> torch.Tensor:  # one value a row, (rows, 1)
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]

    logits = logits / column([max(row.temperature, MIN_TEMPERATURE) for row in rows])
    vocabulary = logits.shape[-1]
    top_ks = [min(row.top_k or 0, vocabulary) for row in rows]
    if any(top_ks):  # (of tied ones, every one as likely as the k-th stays, as there)
        kth = torch.topk(logits, max(top_ks)).values
        kth = kth.gather(1, column([max(k, 1) - 1 for k in top_ks]).long())
        # (a row without top-k: no score is below -inf)
        kth = kth.masked_fill(~column([bool(k) for k in top_ks]).bool(), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = [row.top_p if row.top_p is not None and row.top_p < 1.0 else None for row in rows]
    if any(p is not None for p in top_ps):
        # as transformers' TopPLogitsWarper (and vLLM) cut: the least likely tokens go while
        # their mass stays within 1 - top_p (a token that brings the rest to exactly top_p
        # goes too; of tied ones, the same as there), the likeliest always stays; a row
        # without top-p keeps every token (no mass is within -1)
        ordered, order = torch.sort(logits)
        within = column([1 - p if p is not None else -1.0 for p in top_ps])
        drop = ordered.softmax(-1).cumsum(-1) <= within
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    min_ps = [row.min_p or 0.0 for row in rows]
    if any(min_ps):  # not a token less likely than min_p times the likeliest
        probabilities = logits.softmax(-1)
        likeliest = probabilities.amax(-1, keepdim=True)
        logits = logits.masked_fill(probabilities < column(min_ps) * likeliest, float("-inf"))
    masses = [row.typical_p if row.typical_p is not None and row.typical_p < 1.0 else None
              for row in rows]  # fmt: skip
    if any(mass is not None for mass in masses):  # (a mass past 1 keeps every token)
        logits = typical(logits, column([mass if mass is not None else 2.0 for mass in masses]))
    return logits.softmax(-1)


def typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Typical decoding (Meister et al.) on each row's logits, as transformers'
    `TypicalLogitsWarper` does it: the tokens whose surprise is nearest the row's entropy,
    nearest first, up to the first that brings their probability to the row's `mass`
    (rows, 1), at least one."""
    logprobs = logits.log_softmax(-1)
    entropy = -(logprobs * logprobs.exp()).nansum(-1, keepdim=True)
    distance, order = torch.sort((-logprobs - entropy).abs())
    cumulative = logits.gather(1, order).softmax(-1).cumsum(-1)
    # (kept on the device: read back, it was a round trip to a GPU a row at every step)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    drop = distance > distance.gather(1, last)
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def drawn(probabilities: torch.Tensor, generators: Sequence[Any]) -> torch.Tensor:
    """A token for each row, drawn from its probabilities with its own generator: exactly
    `torch.multinomial(row, 1, generator=generator)`'s draw, which for one sample is the
    likeliest of p / q, q exponential (it draws q from the generator), so a seed draws
    what `generate` draws, whatever the batch-mates. Every row's q is drawn with its own
    generator, the rest at once: a call of multinomial a row also read each row back to
    the host to check it (on a GPU, a wait for the device a sampled row at every step)."""
    noise = torch.empty_like(probabilities)
    for row, generator in zip(noise, generators, strict=True):
        row.exponential_(1, generator=generator)
    return (probabilities / noise).argmax(-1)


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
