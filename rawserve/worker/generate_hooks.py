"""What a `generate` call is given to do rawserve's part at each decoding step (the
static path of causal_lm): logits processors that record the step's log probabilities
(`ScoreRecorder`), mark the text with TGI's watermark (`Watermarker`), apply OpenAI's
logit bias and penalties (`Adjuster`) and hold each row
to its grammar (`GrammarFollower`), and the stopping criterion that watches each new
token (`TokenWatcher`: its text, stop sequences, streaming, cancellation), with the token
in TGI's shape (`tgi_token`), which the continuous loop's tokens take too.

Worker process only (imports torch and transformers).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

from rawserve.tasks.text_generation import stop_tail
from rawserve.worker.continuous import stopped_pieces
from rawserve.worker.grammars import Held, constrain
from rawserve.worker.runner import MODEL_SCORES_FAILED_MESSAGE, NotNumbers
from rawserve.worker.scores import ScoreAdjustments, likeliest, unusable
from rawserve.worker.text_pieces import HeldTokens, TextPieces, alternative_text
from rawserve.worker.watermark import mark

log = logging.getLogger("rawserve.generation")


class ScoreRecorder(transformers.LogitsProcessor):
    """Keeps the last step's log-probabilities, for the tokens' `logprob`."""

    def __init__(self) -> None:
        self.logprobs: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.logprobs = scores.float().log_softmax(-1)
        return scores


class Watermarker(transformers.LogitsProcessor):
    """TGI's watermark (rawserve.worker.watermark) on `generate`'s scores: each row's
    green tokens after its last token (left padding leaves every row's last place its
    own; a beam search's rows are its beams)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mark(scores, input_ids[:, -1].tolist())
        return scores


class Adjuster(transformers.LogitsProcessor):
    """OpenAI's logit bias and penalties and TGI's frequency penalty (`ScoreAdjustments`)
    on `generate`'s scores."""

    def __init__(
        self,
        adjustments: ScoreAdjustments,
        prompt_width: int,
        prompt_mask: torch.Tensor | None = None,
    ):
        self.adjustments = adjustments
        self.prompt_width = prompt_width  # where each row's new tokens start
        # how many of each row's first places are padding (prompts are padded on the left;
        # `prompt_mask`: the batch's attention mask, None: no row is padded)
        self.padding = None if prompt_mask is None else prompt_width - prompt_mask.sum(1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sequence = counted = None
        if self.adjustments.reads_sequence:
            sequence = input_ids
            if self.padding is not None:
                padding = self.padding.to(input_ids.device)
                # (a beam search's rows: each prompt's beams one after another)
                padding = padding.repeat_interleave(len(input_ids) // len(padding))
                places = torch.arange(input_ids.shape[1], device=input_ids.device)
                counted = places[None, :] >= padding[:, None]
        self.adjustments.apply(scores, input_ids[:, self.prompt_width :], sequence, counted)
        return scores


class GrammarFollower(transformers.LogitsProcessor):
    """Each running row's grammar on `generate`'s scores: the row's last token moves its
    matcher on, then only what the grammar allows next may be chosen. A grammar that
    cannot go on fails the batch (ValueError), which is then run in halves down to its
    request, alone. (A finished row goes on with padding: its grammar is left be.)"""

    def __init__(self, matchers: list[Held], watcher: TokenWatcher):
        self.matchers = matchers
        self.watcher = watcher
        self.started = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        running = [i for i, done in enumerate(self.watcher.done) if not done]
        if self.started:  # (the first call follows the prompt: nothing generated yet)
            last = input_ids[:, -1].tolist()
            for index in running:
                if not self.matchers[index].matcher.is_stopped():
                    self.matchers[index].consume_token(last[index])
        self.started = True
        stuck = constrain(scores, [(index, self.matchers[index]) for index in running])
        if stuck:
            for index, _ in stuck:
                self.matchers[index].failed()
            raise ValueError(stuck[0][1])
        return scores


def refuse_broken_scores(watcher: TokenWatcher) -> Callable[[Any, Any, torch.Tensor], None]:
    """A forward hook for the model's output layer during a `generate` call: `NotNumbers`
    where a running row's scores for its next token are NaN or +inf (or none finite),
    read before `generate`'s processors (a temperature, a repetition penalty) touch them,
    so that their own overflow stays the client's. Greedy took token 0 from such a row
    and sampling blamed a temperature the client never set."""

    def check(_module: Any, _args: Any, output: torch.Tensor) -> None:
        broken = unusable(output[:, -1].float())
        if len(broken) == len(watcher.done):  # a finished row goes on with padding
            broken &= ~torch.tensor(watcher.done, device=broken.device)
        if bool(broken.any()):
            raise NotNumbers(MODEL_SCORES_FAILED_MESSAGE)

    return check


class TokenWatcher(transformers.StoppingCriteria):
    """Watches each new token: text, stop sequences, streaming, cancellation."""

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: set[int],  # the tokens that end a row (the model's own list, a chat's end of turn)
        *,
        prompt_length: int,
        batch_size: int,
        stop: Sequence[str],
        recorder: ScoreRecorder,
        on_token: Callable[[int, dict[str, Any]], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        keep_tokens: bool = False,
        top_n: int = 0,
        ignore_eos: bool = False,
        stops_after: int = 0,
        max_new_tokens: int | None = None,
        contexts: Sequence[Sequence[int]] = (),
    ):
        self.tokenizer = tokenizer
        # each row's last token (the cap's, or a replayed beam search answer's) adds what
        # its text held back
        self.lengths = [max_new_tokens or sys.maxsize] * batch_size
        self.prompt_length = prompt_length
        self.stop = list(stop)
        self.recorder = recorder
        self.on_token = on_token
        self.cancelled = cancelled
        self.special_ids = set(tokenizer.all_special_ids)
        self.eos_ids = set() if ignore_eos else eos_ids
        self.top_n = top_n  # the likeliest tokens listed beside each new one
        self.token_ids: list[list[int]] = [[] for _ in range(batch_size)]
        # each row's text's end that a stop sequence may begin in (`stop_tail`: its whole
        # text, copied at every token, would cost each step more as it grows)
        self.tails = [""] * batch_size
        # each row's text decoded after the end of its prompt (`prompt_context`)
        self.pieces = [
            TextPieces(tokenizer, contexts[row] if contexts else ()) for row in range(batch_size)
        ]
        # each row's tokens waiting for their texts (a run of byte tokens' end)
        self.held = [HeldTokens() for _ in range(batch_size)]
        self.stops_after = stops_after  # the first new token a stop sequence may end in
        self.done = [False] * batch_size
        self.finish_reasons = ["length"] * batch_size
        # each row's tokens as TGI's details list them (when asked: they cost a dict each)
        self.tokens: list[list[dict[str, Any]]] | None = (
            [[] for _ in range(batch_size)] if keep_tokens else None
        )

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new_tokens = input_ids[:, -1].tolist()
        logprobs = self.recorder.logprobs
        listed = self.on_token is not None or self.tokens is not None
        top = likeliest(logprobs, self.top_n) if listed and logprobs is not None else None
        # each row's new token's, read back at once: a read a row was a round trip to
        # the device a row at every step
        chosen = None
        if listed and logprobs is not None:
            chosen = logprobs.gather(1, input_ids[:, -1:])[:, 0].tolist()
        for row, token_id in enumerate(new_tokens):
            if self.done[row]:
                continue
            self.token_ids[row].append(token_id)
            ends = token_id in self.eos_ids
            last = ends or len(self.token_ids[row]) >= self.lengths[row]
            pieces = self.pieces[row].next_pieces(self.token_ids[row], last)
            before = self.tails[row]
            self.tails[row] = stop_tail(before + "".join(pieces), self.stop)
            made = len(self.token_ids[row])
            readable = self.pieces[row].readable
            stopped = stopped_pieces(before, pieces, readable, made, self.stops_after, self.stop)
            if stopped is not None:  # (before an end of sequence that let out the run)
                self.done[row], self.finish_reasons[row] = True, "stop_sequence"
                if past := len(pieces) - len(stopped):  # (tokens after the stop's)
                    del self.token_ids[row][-past:]
                pieces = stopped
            elif ends:
                self.done[row], self.finish_reasons[row] = True, "eos_token"
            if listed:
                logprob = chosen[row] if chosen is not None else 0.0
                token = tgi_token(
                    self.tokenizer,
                    self.special_ids,
                    token_id,
                    logprob,
                    top[row] if top is not None else None,
                )
                self._list(row, self.held[row].add(token, pieces))
        if not all(self.done) and self.cancelled():
            log.info(
                "generation stopped after %d tokens: the client left or stopped reading, or "
                "its deadline passed",
                len(self.token_ids[0]),
            )
            self.done = [True] * len(self.done)
            self.finish_reasons = ["cancelled"] * len(self.done)
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)

    def let_out_the_rest(self) -> None:
        """After the `generate` call: the tokens that still wait for their texts (a row
        whose answer a beam's end or a cancel cut inside a run of byte tokens) listed,
        their texts as the row's text ends there."""
        for row, ids in enumerate(self.token_ids):
            self._list(row, self.held[row].let_out(self.pieces[row].rest(ids)))

    def _list(self, row: int, tokens: list[dict[str, Any]]) -> None:
        for token in tokens:
            if self.tokens is not None:
                self.tokens[row].append(token)
            if self.on_token is not None:
                self.on_token(row, token)


def tgi_token(
    tokenizer: Any,
    special_ids: set[int],
    token_id: int,
    logprob: float | None,
    top: list[tuple[int, float]] | None = None,
) -> dict[str, Any]:
    """A new token as TGI's streams and details list it (a special token shows its own
    text, which the running text skips; a prompt's first token has no log probability),
    with the likeliest tokens at its step under "top_tokens" where they were asked for
    (each token's own text as it reads after a word, `alternative_text`: an alternative
    has no place in the running text).

    Its text is filled in once it is known (`HeldTokens`): here only a special token's
    own."""
    special = token_id in special_ids
    token: dict[str, Any] = {
        "id": token_id,
        "text": tokenizer.decode([token_id]) if special else "",
        "logprob": logprob,
        "special": special,
    }
    if top is not None:
        token["top_tokens"] = top_tokens(tokenizer, special_ids, top)
    return token


def top_tokens(
    tokenizer: Any, special_ids: set[int], top: list[tuple[int, float]]
) -> list[dict[str, Any]]:
    """The likeliest tokens at a step, (id, log probability), as TGI's `top_tokens` list
    them."""
    return [
        {
            "id": i,
            "text": alternative_text(tokenizer, i),
            "logprob": p,
            "special": i in special_ids,
        }
        for i, p in top
    ]
