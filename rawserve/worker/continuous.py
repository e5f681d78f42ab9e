"""Continuous batching for a causal LM: an iteration-level loop over the model's forward pass.

Worker process only (imports torch). Sequences join the running batch between decoding
steps and leave it when they finish, so a short request never waits for the longest one
beside it. Each keeps its own new-token cap (and its own room in the model's positions),
stop sequences, sampling settings and random generator (its seed), so its output never
depends on its batch-mates.

How: one KV cache for the batch (`kv_slots.KvSlots`: per layer one preallocated buffer
that each step writes a column of in place and hands the model views of), rows aligned at
their right end with left padding that the attention mask hides, and each row's own
position ids. The sequences joining at a step are prefilled (in passes of like lengths,
so that a long prompt's padding is not every short one's) and written into free rows of
the buffers (a prompt longer than `PREFILL_CHUNK` is prefilled a chunk a step in a cache
of its own, the rows decoding between its chunks, and joins after its last); a leaving
row's slot is taken by the last row (in the cache and in every per-row list here, kept in
the same order), and padding columns no row needs any more are skipped. Why not a
`DynamicCache` rebuilt each step: concatenating the whole cache every step, and padding
or index-selecting it on every join and leave, was 40 % of the loop's time on the CPU and
held it below static batching on mixed lengths.

Why our own loop and not transformers' continuous-batching manager: measured on an H100
with a GPT-2-small-sized model, the manager took ~110 ms a decoding step whatever the
batch against 12 ms for static `generate` at batch 64 (its per-step overhead dominates at
this model size); bench/generation.py compares this loop with static batching.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from rawserve.shared.messages import FailureKind, GenerationPasses
from rawserve.tasks.text_generation import first_stop_end, stop_tail
from rawserve.worker.cuda_graphs import ROW_BUCKETS
from rawserve.worker.decode_graphs import GraphedDecode
from rawserve.worker.grammars import constrain
from rawserve.worker.kv_slots import KvSlots
from rawserve.worker.library_panics import panics_as_errors
from rawserve.worker.prefill_graphs import (
    MAX_PREFILL_TOKENS,
    MIN_PREFILL_TOKENS,
    GraphedPrefill,
    Prefilled,
)
from rawserve.worker.runner import MODEL_SCORES_FAILED_MESSAGE, SAMPLING_FAILED_MESSAGE
from rawserve.worker.scores import (
    ScoreAdjustments,
    TokenRun,
    drawn,
    likeliest,
    penalize_repetition,
    sampling_probabilities,
    unusable,
)
from rawserve.worker.text_pieces import TextPieces, counted_text, prompt_context
from rawserve.worker.watermark import mark

# how long a step with nothing to run but grammars compiling waits for one, before the
# loop looks at its messages again (a new request, a client gone)
GRAMMAR_WAIT = 0.02
MASK_64 = 2**64 - 1
SEEDS = 2**32  # a drawn seed is below it (so that an OpenAI client may send it back)
# a prompt of no tokens (a chat template that renders no text), refused as the input's fault
NO_TOKENS = "the prompt reads as no tokens: there is nothing to continue"
RECORDING_TOKENS = 3  # a prefill and two steps at each bucket of rows, to record them
# the latest prompts prefilled whose last scores are kept, so that a copy of one that joins
# later (a request's `n` choices reach the loop a step apart) takes its keys and values
# from a running row instead of a prefill of its own
FORKABLE_PROMPTS = 8
# Prompts joining at one step are prefilled in passes of like lengths, each padding its rows
# to at most this many times their own tokens, or to this many tokens in all (a pass that
# small costs less than another): padded together to the longest, one prompt of 3,500
# tokens beside 31 short ones took a tiny model's CPU worker 5 s instead of 0.12 s apart,
# and every running row waited for it.
PREFILL_PADDING = 1.25
PREFILL_SMALL = 4096
# A prompt longer than a chunk is prefilled a chunk a step, in a KV cache of its own, the
# running rows decoding a token between its chunks (vLLM's and SGLang's chunked prefill),
# and joins them once its last chunk is done: in one pass, a prompt holds every running
# stream for its whole prefill. A chunk bounds that hold; a smaller one costs the long
# prompt more passes before its first token. A tiny model's CPU worker (4,096 positions,
# 8 streams, a 3,500-token prompt joining) saw its streams' longest gap between tokens
# go from 77 to 41 ms (medians of 9) with chunks of 512, the prompt's first token from 73
# to 127 ms; 256 gained nothing more. On a GPU a step of 2,048 tokens is within what vLLM
# and SGLang budget a step by default.
PREFILL_CHUNK = 512
GPU_PREFILL_CHUNK = 2048
# Sequences that come while rows run may wait a few decoding steps for others to join with
# them (`join_wait_steps`, 0: none wait). Where a prefill costs about what a step costs
# whatever its rows (a GPU, its passes replayed from CUDA graphs), closed-loop clients whose
# answers have spread out join about one a step, each with a prefill of its own: every step
# then costs two passes. Joining k at a time costs one prefill every k steps, for up to k
# steps more before their first tokens (TGI's `--max-waiting-tokens`). Joiners at least this
# share of the running rows (a wave of requests) join at once, as do those with no pass to
# share (a prompt a running row holds, one prefilled in chunks) and any while more wait than
# there are free rows (a row left empty for company would only idle).
JOIN_AT_ONCE_SHARE = 0.25


# prompts with the keys and values of their prefill (per layer `[1, heads, tokens, dim]`)
# and their last scores, to join without a prefill of their own
Forked = dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]]


@dataclass(eq=False)
class Generation:
    """One sequence: its prompt, its settings, and what it has made so far."""

    key: Any  # the caller's name for it
    prompt_ids: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None  # None or 0.0: none
    typical_p: float | None = None  # None or 1.0: none
    seed: int | None = None  # a sampled one's, drawn when not given
    stop: Sequence[str] = ()
    repetition_penalty: float | None = None  # None or 1.0: none
    watermark: bool = False  # TGI's (rawserve.worker.watermark), before the penalty as TGI's
    min_new_tokens: int = 0  # no end of sequence before this many new tokens
    # asked min_tokens (OpenAI's, as vLLM reads it): a stop sequence counts only where it
    # ends in the text of this new token or a later one
    stops_after: int = 0
    ignore_eos: bool = False  # an end of sequence does not end it (it runs to its cap)
    adjustments: ScoreAdjustments | None = None  # OpenAI's logit bias and penalties, TGI's
    grammar: Any = None  # what it may generate: a `Held` grammar (rawserve.worker.grammars)
    # its grammar while it compiles (a `PendingMatcher`): it joins once the grammar is ready
    compiling: Any = None
    # the log-probability of each chosen token (after the penalties and biases, before
    # temperature and top-k/top-p, as generate's logits processors see it); None: not kept
    logprobs: list[float] | None = None
    # with `logprobs`: the `top_n` likeliest tokens at its latest step, (id, log-probability)
    # each, likeliest first, from the same scores (TGI's top_n_tokens, OpenAI's top_logprobs)
    top_n: int = 0
    top: list[tuple[int, float]] | None = None
    # the prompt's tokens with their log probabilities (TGI's details' `prefill`), if asked
    prefill: list[dict[str, Any]] | None = None
    # what makes `prefill` while it waits, a few windows of its scoring pass a step (the
    # rows decoding between), yielding each window's positions: it joins once done
    scoring: Iterator[int] | None = None
    tokens: list[int] = field(default_factory=list)
    # the end of its text that a stop sequence ending in a later piece may begin in
    # (`stop_tail`): the whole text, copied at every token, would cost each step more as
    # the text grows
    tail: str = ""
    finish_reason: str | None = None  # None while it runs
    failure: str | None = None  # why it failed alone (finish_reason "failed"), for its client
    failure_kind: FailureKind = FailureKind.INPUT  # whose fault: its settings' or the model's
    cap: int = 0  # its own new-token cap: asked, and what its positions allow
    # the most sequences it may be prefilled with (0: any): lowered each time a prefill
    # it joined in failed, so that a prompt the model fails on ends up failing alone
    joins_at_most: int = 0
    waited_steps: int = 0  # decoding steps it waited for company (`join_wait_steps`)
    generator: torch.Generator | None = None
    pieces: TextPieces | None = None
    # its ids on the device, for its repetition penalty and TGI's frequency penalty (prompt
    # and new tokens) and OpenAI's frequency and presence penalties (new tokens): grown a
    # step at a time
    seen: TokenRun | None = None
    made: TokenRun | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def sequence(self, device: torch.device) -> torch.Tensor:
        """Its prompt's and new tokens' ids on `device` (`seen`, grown to this step)."""
        if self.seen is None:
            self.seen = TokenRun(self.prompt_ids, device)
        return self.seen.after(self.tokens)

    @property
    def takes_the_likeliest(self) -> bool:
        """Whether its next token is the likeliest of the model's own scores: greedy, and
        nothing (a penalty, a bias, an end held back, a grammar) changes them first."""
        return not (
            self.do_sample
            or self.repetition_penalty not in (None, 1.0)
            or self.watermark
            or self.adjustments is not None
            or len(self.tokens) < self.min_new_tokens
            or self.grammar is not None
        )

    def fail(self, why: str, kind: FailureKind = FailureKind.INPUT) -> None:
        """End it alone: its own settings or grammar cannot go on, or the model's scores
        for it are not numbers (the rows beside it go on)."""
        self.failure = why
        self.failure_kind = kind
        self.finish_reason = "failed"


@dataclass(eq=False)
class ChunkedPrefill:
    """A long prompt prefilled a chunk a step, in a KV cache of its own, for the sequences
    that share it (a request's `n` choices): they join the rows after its last chunk."""

    prompt: tuple[int, ...]
    generations: list[Generation]
    cache: Any = field(default_factory=transformers.DynamicCache)
    done: int = 0  # its tokens prefilled so far


@dataclass
class Passes:
    """What a batcher's forward passes ran (`GenerationPasses`, for the server's metrics)."""

    prefills: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    rows: int = 0

    def taken(self) -> GenerationPasses | None:
        """The counts so far as a message, and zeroed; None where there are none."""
        if not (self.prefills or self.steps):
            return None
        counted = GenerationPasses(self.prefills, self.prompt_tokens, self.steps, self.rows)
        self.prefills = self.prompt_tokens = self.steps = self.rows = 0
        return counted


class ContinuousBatcher:
    """Runs any number of `Generation`s, at most `max_rows` at a time, a step at a time.

    `add` queues a sequence, `cancel` ends one (it leaves at the next step), `step` lets waiting
    sequences join (prefill; a long prompt a chunk a step), runs one decoding step for every
    running row, and returns the sequences that finished in it. `on_token(generation, token,
    pieces)` hears every new token with the texts of the tokens it lets out
    (`TextPieces.next_pieces`: none while a run of byte tokens goes on; the generation's
    `finish_reason` already set where the token ends it), and `after_pass()` is called
    once a forward pass's tokens are all heard (the joiners' prefill, a decoding step), so
    a listener can send them together before the next pass. When a step raises (the model
    failed, or ran out of memory), `drop_failed` takes the sequences it failed out of the
    batch: only the joining ones where their own prefill raised (the rows run on), else
    every one it ran; `wait_again` puts sequences that have no token yet back in the queue
    (fewer of them prefilled at once, if asked).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_positions: int,
        max_rows: int = 64,
        on_token: Callable[[Generation, int, list[str]], None] | None = None,
        after_pass: Callable[[], None] | None = None,
        cuda_graphs: bool = False,
        join_wait_steps: int = 0,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_positions = max_positions
        self.max_rows = max_rows
        self.join_wait_steps = join_wait_steps  # (JOIN_AT_ONCE_SHARE)
        self.on_token = on_token
        self.after_pass = after_pass
        self._cache_name = cache_keyword(model)
        self.eos_ids = end_ids(tokenizer, model)
        # on the device once: a list made into an index at every step of every row held
        # to min_new_tokens was a copy from the host, which waits for a GPU's queue
        self._eos_index = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=self.device)
        self.waiting: list[Generation] = []
        self.rows: list[Generation] = []
        self.passes = Passes()
        self._joining: list[Generation] = []  # being prefilled: neither waiting nor a row
        self._prefilling = False  # the joiners' own forward pass runs: the rows untouched
        # the long prompt prefilled a chunk a step (PREFILL_CHUNK), if any
        self.prefill_chunk = GPU_PREFILL_CHUNK if self.device.type == "cuda" else PREFILL_CHUNK
        self._chunked: ChunkedPrefill | None = None
        # out of the batch in this step: kept here, where a later pass of it may raise
        self._finished: list[Generation] = []
        graphs = cuda_graphs and GraphedDecode.supports(model)
        # a CPU's buffers go while no row runs (nothing reads their addresses but graphs)
        self._release_when_idle = self.device.type == "cpu" and not graphs
        self._slots = self._new_slots()
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        # the last prefilled prompts' scores for the token after them (FORKABLE_PROMPTS)
        self._prompt_scores: dict[tuple[int, ...], torch.Tensor] = {}
        # decoding steps and prefills replayed from CUDA graphs (rawserve.worker.decode_graphs,
        # prefill_graphs)
        self.decode_graphs = GraphedDecode(model, self._cache_name) if graphs else None
        self.prefill_graphs = (
            GraphedPrefill(model, self._cache_name, max_positions, self._prefill)
            if graphs
            else None
        )

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.rows or self._chunked)

    def add(self, generation: Generation) -> None:
        """Queue `generation` to join; one that generates nothing (max_new_tokens 0) is only
        scored, and ends once its `scoring` has run (it may fill the positions)."""
        room = self.max_positions - len(generation.prompt_ids)
        if not generation.prompt_ids:  # (a chat template that renders no text)
            raise ValueError(NO_TOKENS)
        if room < (1 if generation.max_new_tokens else 0):
            raise ValueError(
                f"the prompt is {len(generation.prompt_ids)} tokens, which is longer than the "
                f"model's context length: it takes at most {self.max_positions - 1} to leave "
                "room for one new token"
            )
        generation.cap = min(generation.max_new_tokens, room)
        context = prompt_context(self.tokenizer, generation.prompt_ids)
        generation.pieces = TextPieces(self.tokenizer, context)
        if generation.do_sample:
            if generation.seed is None:  # drawn, so that its details name what repeats it
                generation.seed = secrets.randbelow(SEEDS)
            generation.generator = torch.Generator(device=self.device)
            generation.generator.manual_seed(generator_seed(generation.seed))
        self.waiting.append(generation)

    def cancel(self, key: Any) -> None:
        """End a sequence (its client left): it leaves the batch at the next step."""
        for generation in self.waiting:
            if generation.key == key:
                generation.finish_reason = "cancelled"
        for generation in self.rows + (self._chunked.generations if self._chunked else []):
            if generation.key == key:
                generation.finish_reason = "cancelled"

    @torch.inference_mode()
    def step(self) -> list[Generation]:
        """Join, decode one token for every row, leave; the sequences that finished."""
        self._take_compiled_grammars()
        finished = self._finished
        # cancelled before they joined, or their grammar cannot be used
        finished += [g for g in self.waiting if g.done]
        self.waiting = [g for g in self.waiting if not g.done]
        finished += self._leave()
        finished += self._drop_cancelled_chunked()
        scored = self._score_windows()
        finished += self._scored_only()
        # fewer after running out of memory; a prompt prefilled in chunks has its rows
        chunked = len(self._chunked.generations) if self._chunked else 0
        free = max(0, self.max_rows - len(self.rows) - chunked)
        ready = [g for g in self.waiting if g.compiling is None and g.scoring is None]
        joining = ready[:free]
        if joining and (at_most := joining[0].joins_at_most):  # after a failed prefill
            joining = joining[:at_most]
            joining = joining[: min(g.joins_at_most or at_most for g in joining)]
        if len(ready) <= free:  # (a backlog joins at once)
            joining = self._joining_now(joining)
        joining = self._set_long_ones_aside(joining)
        if joining:
            self._joining = joining
            self.waiting = [g for g in self.waiting if g not in joining]
            self._join(self._joining)
            self._joining = []
        if self._chunked is not None:
            self._prefill_a_chunk(self._chunked)
        elif not (joining or scored) and self.waiting and not self.rows:  # grammars compiling
            compiling = [g.compiling.compiling for g in self.waiting if g.compiling]
            wait_for_futures(compiling, timeout=GRAMMAR_WAIT, return_when=FIRST_COMPLETED)
        finished += self._leave()  # a sequence may finish on its first token
        if self.rows:
            self._decode()
            finished += self._leave()
        return self.take_finished()

    def take_finished(self) -> list[Generation]:
        """The sequences that finished in the last step, out of the batch; after a step
        raised, those that finished before it did (a short answer, a cancelled one): the
        failure's sequences are `drop_failed`'s, these were lost with the step's list."""
        finished, self._finished = self._finished, []
        return finished

    def _joining_now(self, joining: list[Generation]) -> list[Generation]:
        """Those of `joining` that join this step: the others, beside running rows, wait
        a step for company (`join_wait_steps`, JOIN_AT_ONCE_SHARE), unless they are a
        wave, or one of them has waited its steps."""
        if not (joining and self.join_wait_steps and self.rows):
            return joining
        sharing = [generation for generation in joining if self._prefilled_with_others(generation)]
        if not sharing or len(sharing) >= JOIN_AT_ONCE_SHARE * len(self.rows):
            return joining
        if max(generation.waited_steps for generation in sharing) >= self.join_wait_steps:
            return joining
        for generation in sharing:
            generation.waited_steps += 1
        return [generation for generation in joining if generation not in sharing]

    def _prefilled_with_others(self, generation: Generation) -> bool:
        """Whether its prompt would be prefilled in a pass others may share: not one a
        running row holds (its keys and values are copied), nor one prefilled in chunks."""
        prompt = tuple(generation.prompt_ids)
        return len(prompt) <= self.prefill_chunk and self._holder(prompt) is None

    def record_graphs(self, prompt: list[int]) -> int:
        """Where steps are replayed from CUDA graphs: run a few tokens of `prompt` at
        every bucket of rows up to `max_rows`, then of one prompt at every power of two
        of tokens the prefill graphs take, so that the first requests find their steps'
        and prefills' graphs recorded (recording one stalls every running sequence); no
        listener hears those tokens. How many graphs there are after."""
        if self.decode_graphs is None or self.prefill_graphs is None:
            return 0
        listeners = self.on_token, self.after_pass
        self.on_token = self.after_pass = None
        # each row's prompt its own (its first token): copies of one would be prefilled
        # as one row, and the prefills of more rows would go unrecorded
        vocabulary = self.model.get_input_embeddings().num_embeddings
        try:
            for rows in ROW_BUCKETS:
                if rows > self.max_rows:
                    break
                self._run_through([[row % vocabulary, *prompt[1:]] for row in range(rows)])
            length = 2 * MIN_PREFILL_TOKENS
            while length <= min(MAX_PREFILL_TOKENS, self.max_positions - RECORDING_TOKENS):
                self._run_through([(prompt * length)[:length]])
                length *= 2
        finally:
            self.on_token, self.after_pass = listeners
        return len(self.decode_graphs.shelf.graphs) + len(self.prefill_graphs.shelf.graphs)

    def _take_compiled_grammars(self) -> None:
        """The waiting sequences whose grammar has compiled take their matcher (or fail,
        where it cannot be used: raised out of the step, a compiling that ran out of
        memory failed every step after, the sequence never leaving)."""
        for generation in self.waiting:
            if generation.compiling is None or not generation.compiling.ready:
                continue
            try:
                with panics_as_errors():  # (the compiling thread's library panic too)
                    generation.grammar = generation.compiling.held()
            except ValueError as exc:
                generation.fail(str(exc))
            except Exception as exc:  # noqa: BLE001 - not the client's: it fails alone too
                memory = isinstance(exc, MemoryError)
                generation.fail(
                    f"its grammar could not be compiled ({type(exc).__name__})",
                    FailureKind.OUT_OF_MEMORY if memory else FailureKind.INTERNAL,
                )
            generation.compiling = None

    def _run_through(self, prompts: list[list[int]]) -> None:
        for index, prompt in enumerate(prompts):
            self.add(Generation(("record", len(prompts), index), prompt, RECORDING_TOKENS))
        while self.busy:
            self.step()

    def _score_windows(self) -> bool:
        """Windows of the waiting sequences' prompt scoring (`scoring`), first come first,
        up to a chunk's positions (`prefill_chunk`); whether any ran. A sequence whose
        scoring fails fails alone, as a joiner whose prefill fails."""
        budget = self.prefill_chunk
        for generation in self.waiting:
            while generation.scoring is not None and not generation.done and budget > 0:
                self._joining, self._prefilling = [generation], True
                positions = next(generation.scoring, 0)
                if not positions:  # done (copies of a prompt scored: at once)
                    generation.scoring = None
                else:
                    self.passes.prefills += 1
                    self.passes.prompt_tokens += positions
                budget -= positions
                self._joining, self._prefilling = [], False
        return budget < self.prefill_chunk

    def _scored_only(self) -> list[Generation]:
        """The waiting sequences that only score their prompt (max_new_tokens 0) and are
        done scoring: they end here, with no row."""
        ended = [g for g in self.waiting if g.scoring is None and not g.max_new_tokens]
        for generation in ended:
            generation.finish_reason = generation.finish_reason or "length"
        self.waiting = [g for g in self.waiting if g not in ended]
        return ended

    def _drop_cancelled_chunked(self) -> list[Generation]:
        """The sequences of the prompt prefilled in chunks that were cancelled (their
        clients left, their deadlines passed); its cache goes once none is left."""
        chunked = self._chunked
        if chunked is None:
            return []
        gone = [g for g in chunked.generations if g.done]
        chunked.generations = [g for g in chunked.generations if not g.done]
        if not chunked.generations:
            self._chunked = None
        return gone

    def _set_long_ones_aside(self, joining: list[Generation]) -> list[Generation]:
        """Those of `joining` to prefill now: a prompt longer than a chunk that no running
        row holds is prefilled in chunks instead (at most one at a time: the others wait),
        with its copies."""
        now = []
        for generation in joining:
            prompt = tuple(generation.prompt_ids)
            if len(prompt) <= self.prefill_chunk or self._holder(prompt) is not None:
                now.append(generation)
                continue
            if self._chunked is None:
                self._chunked = ChunkedPrefill(prompt, [])
            if self._chunked.prompt == prompt:
                self._chunked.generations.append(generation)
                self.waiting.remove(generation)
        return now

    def _prefill_a_chunk(self, chunked: ChunkedPrefill) -> None:
        """The next chunk of the long prompt's prefill, in its own cache; after the last,
        its sequences join the rows, their first token from that chunk's scores."""
        self._joining, self._prefilling = chunked.generations, True
        first, prompt = chunked.done, chunked.prompt
        stop = min(first + self.prefill_chunk, len(prompt))
        out = self.model(
            input_ids=torch.tensor([prompt[first:stop]], device=self.device),
            attention_mask=torch.ones((1, stop), dtype=torch.long, device=self.device),
            position_ids=torch.arange(first, stop, device=self.device)[None],
            **{self._cache_name: chunked.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        chunked.done = stop
        self.passes.prefills += 1
        self.passes.prompt_tokens += stop - first
        self._joining, self._prefilling = [], False
        if stop < len(prompt):
            return
        self._chunked = None
        layers = chunked.cache.layers
        keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
        scores = out.logits[0, -1, :]
        self._keep_scores(prompt, scores)
        self._joining = chunked.generations
        self._join(self._joining, {prompt: (keys, values, scores)})
        self._joining = []

    def drop_failed(self) -> list[Generation]:
        """After a step raised: the sequences it failed, taken out of the batch. Where the
        joining sequences' own prefill raised, the rows had not been touched: only the
        joiners go, and the rows run on; elsewhere every sequence it ran (`drop_running`)."""
        if not self._prefilling:
            return self.drop_running()
        joining, self._joining, self._prefilling = self._joining, [], False
        self.waiting = [g for g in self.waiting if g not in joining]  # (one still scoring)
        if self._chunked is not None and self._chunked.generations is joining:
            self._chunked = None  # its chunk failed: its cache goes with it
        return joining

    @property
    def prefilling(self) -> bool:
        """The joiners' own prefill is running (read after a step raised, before
        `drop_failed`: the step failed in it, not in the rows' decoding)."""
        return self._prefilling

    def wait_again(self, generations: list[Generation], at_most: int = 0) -> None:
        """Sequences with no token yet (joiners whose prefill failed) back at the head of
        the queue: they join later, exactly as if they had come then; `at_most` of them
        prefilled together (0: as many as there is room for). They have waited: none waits
        again for company."""
        for generation in generations:
            generation.waited_steps = self.join_wait_steps
            if at_most:
                generation.joins_at_most = at_most
        self.waiting = [*generations, *self.waiting]

    def cap_rows(self, rows: int) -> None:
        """At most `rows` sequences at a time from now, in the cache's buffers too: a
        cap lowered after running out of memory sizes the next ones."""
        self.max_rows = self._slots.max_rows = rows

    def _new_slots(self) -> KvSlots:
        return KvSlots(
            self.device,
            self.max_rows,
            self.max_positions,
            release_when_idle=self._release_when_idle,
        )

    def drop_running(self) -> list[Generation]:
        """After a step raised: the sequences it was running (rows, and those joining),
        taken out of the batch with its cache; the waiting ones stay to run later."""
        running = self.rows + [g for g in self._joining if g not in self.rows]
        if self._chunked is not None:  # not run yet: it starts again, its cache gone
            aside = [g for g in self._chunked.generations if g not in running]
            self.waiting = [*aside, *self.waiting]
            self._chunked = None
        self.rows, self._joining, self._prefilling = [], [], False
        # its buffers go too: the step may have run out of memory
        self._slots = self._new_slots()
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._prompt_scores = {}
        return running

    # --- the batch's cache ----------------------------------------------------------------

    def _join(self, generations: list[Generation], prefilled: Forked | None = None) -> None:
        """Prefill the joining sequences together (left-padded, each with its own
        positions) and add their rows to the batch's cache, aligned at the right end.

        A prompt that several of them share (a request's `n` choices) is prefilled once:
        its keys, values and scores are copied into each of their rows, which then go on
        on their own (each sampling with its own generator), as vLLM forks a prompt's
        cache for its `n` sequences. A prompt that a running row holds (copies a step
        apart) is not prefilled again: its keys and values are that row's first columns;
        nor one `prefilled` already (in chunks)."""
        self._prefilling = True  # till the joiners' pass is done, the rows are as they were
        prompts = list(dict.fromkeys(tuple(g.prompt_ids) for g in generations))
        forked = {**self._forked(prompts), **(prefilled or {})}
        passes = like_lengths([prompt for prompt in prompts if prompt not in forked])
        # the rows of `keys`, `values` and `logits` below
        prompts = [prompt for group in passes for prompt in group] + list(forked)
        lengths = [len(prompt) for prompt in prompts]
        width = max(lengths)
        mask = self._left_mask(lengths, width)
        parts = [self._prefilled(group, width) for group in passes]
        for prompt, (their_keys, their_values, scores) in forked.items():
            pad = (0, 0, width - len(prompt), 0)  # left, in the columns
            padded = [F.pad(k, pad) for k in their_keys], [F.pad(v, pad) for v in their_values]
            parts.append((*padded, scores[None].clone()))  # (choosing writes over scores)
        keys, values, logits = parts[0]
        if len(parts) > 1:
            keys = [torch.cat(layer) for layer in zip(*(p[0] for p in parts), strict=True)]
            values = [torch.cat(layer) for layer in zip(*(p[1] for p in parts), strict=True)]
            logits = torch.cat([p[2] for p in parts])
        row_of = {prompt: row for row, prompt in enumerate(prompts)}
        sources = [row_of[tuple(g.prompt_ids)] for g in generations]
        if sources != list(range(len(prompts))):  # each sequence's row of its prompt's
            lengths = [lengths[row] for row in sources]
            index = torch.tensor(sources, device=self.device)
            keys = [k.index_select(0, index) for k in keys]
            values = [v.index_select(0, index) for v in values]
            logits, mask = logits.index_select(0, index), mask.index_select(0, index)
        self._prefilling = False
        self._slots.join(keys, values, mask)
        positions = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self._positions = torch.cat([self._positions, positions])
        self.rows += generations
        tokens = self._choose(logits, generations)
        self._last = torch.cat([self._last, tokens])

    def _prefilled(self, prompts: list[tuple[int, ...]], width: int) -> Prefilled:
        """The prompts' forward pass, its keys and values left-padded to `width` columns;
        their last scores are kept for copies that join later."""
        longest = max(len(prompt) for prompt in prompts)
        ids = torch.tensor(
            [[0] * (longest - len(prompt)) + list(prompt) for prompt in prompts],
            device=self.device,
        )
        mask = self._left_mask([len(prompt) for prompt in prompts], longest)
        graphed = self.prefill_graphs
        prefilled = graphed.prefill(ids, mask) if graphed else None
        keys, values, logits = prefilled or self._prefill(ids, mask)
        self.passes.prefills += 1
        self.passes.prompt_tokens += sum(len(prompt) for prompt in prompts)
        for prompt, scores in zip(prompts, logits, strict=True):
            self._keep_scores(prompt, scores)
        pad = (0, 0, width - longest, 0)
        if width > longest:
            keys, values = [F.pad(k, pad) for k in keys], [F.pad(v, pad) for v in values]
        return keys, values, logits

    def _keep_scores(self, prompt: tuple[int, ...], scores: torch.Tensor) -> None:
        """A prefilled prompt's last scores, kept for copies that join later."""
        self._prompt_scores.pop(prompt, None)  # the latest last
        self._prompt_scores[prompt] = scores.clone()  # (choosing writes over its scores)
        for old in list(self._prompt_scores)[:-FORKABLE_PROMPTS]:
            del self._prompt_scores[old]

    def _left_mask(self, lengths: list[int], width: int) -> torch.Tensor:
        """The attention mask of rows of `lengths` tokens, left-padded to `width`."""
        rows = [[0] * (width - n) + [1] * n for n in lengths]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _forked(self, prompts: list[tuple[int, ...]]) -> Forked:
        """The prompts that a running row holds, with its keys and values over them and
        their scores: its cache holds the prompt, then its tokens but the latest."""
        forked = {}
        for prompt in prompts:
            row = self._holder(prompt)
            if row is None:
                continue
            stop = self._slots.end - (len(self.rows[row].tokens) - 1)
            keys, values = self._slots.row_columns(row, stop - len(prompt), stop)
            forked[prompt] = keys, values, self._prompt_scores[prompt]
        return forked

    def _holder(self, prompt: tuple[int, ...]) -> int | None:
        """The running row whose cache holds `prompt` with its scores kept, if any."""
        if prompt not in self._prompt_scores:
            return None
        for row, generation in enumerate(self.rows):
            same = len(generation.prompt_ids) == len(prompt) and generation.tokens
            if same and tuple(generation.prompt_ids) == prompt:
                return row
        return None

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> Prefilled:
        """The joining rows' forward pass as it is: each layer's keys and values, and the
        last position's logits. The cache is every layer's whole keys and values, even
        for a layer that attends to a sliding window: the model's own cache keeps only
        the window's last tokens for those, while the slots hold every row's tokens from
        its first (the window is the attention mask's, which the model builds from its
        config at every step)."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            **{self._cache_name: transformers.DynamicCache()},
            use_cache=True,
            logits_to_keep=1,  # only the last position's scores: the vocabulary is wide
        )
        layers = cache_of(out).layers
        return (
            [layer.keys for layer in layers],
            [layer.values for layer in layers],
            out.logits[:, -1, :],
        )

    def _decode(self) -> None:
        cache, mask = self._slots.open_column()

        def as_is() -> torch.Tensor:  # the step run as it is: the window's views
            out = self.model(
                input_ids=self._last[:, None],
                attention_mask=mask,
                position_ids=self._positions[:, None],
                **{self._cache_name: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            return out.logits[:, -1, :]

        graphed = self.decode_graphs
        logits = graphed.step(self._slots, self._last, self._positions, as_is) if graphed else None
        if logits is None:
            logits = as_is()
        self._slots.close_column()
        self.passes.steps += 1
        self.passes.rows += len(self.rows)
        self._positions = self._positions + 1
        self._last = self._choose(logits, self.rows)

    def _leave(self) -> list[Generation]:
        """Take the finished rows out: a later row moves into each one's slot (in the cache
        and in every per-row list), so only that row's keys and values are copied."""
        done = [g for g in self.rows if g.done]
        if not done:
            return []
        holes, movers = self._slots.keep([not g.done for g in self.rows])
        count = len(self.rows) - len(done)
        if holes:
            into = torch.tensor(holes, device=self.device)
            source = torch.tensor(movers, device=self.device)
            self._positions[into] = self._positions[source]
            self._last[into] = self._last[source]
            for hole, mover in zip(holes, movers, strict=True):
                self.rows[hole] = self.rows[mover]
        del self.rows[count:]
        self._positions = self._positions[:count]
        self._last = self._last[:count]
        return done

    # --- tokens -----------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, rows: Sequence[Generation]) -> torch.Tensor:
        """Each row's next token (greedy, or sampled with its own settings and generator),
        taken into its sequence."""
        scores = logits.float()  # as generate scores them
        # a row whose scores hold NaN or +inf, or no finite score at all, is the model's
        # fault, not its settings': greedy would take token 0 as if it were an answer, and
        # sampling would blame the temperature; the row fails alone, saying so. It is read
        # with the step's first look at the device (read here, the sampling work would be
        # queued only once the forward pass is done); till then its scores are zeros,
        # which rank and draw without failing the step.
        plain = all(g.takes_the_likeliest for g in rows)
        if plain:  # (one pass: the likeliest score tells a broken row, its place the token)
            best, greedy = scores.max(dim=-1)
            broken = ~best.isfinite()
        else:
            broken = unusable(scores)
            scores.masked_fill_(broken[:, None], 0.0)
        for index, generation in enumerate(rows):
            if generation.done:
                continue
            if generation.watermark:
                previous = generation.tokens[-1] if generation.tokens else generation.prompt_ids[-1]
                mark(scores[index : index + 1], [previous])
            penalty = generation.repetition_penalty
            if penalty is not None and penalty != 1.0:
                penalize_repetition(scores[index], penalty, generation.sequence(scores.device))
            if (adjustments := generation.adjustments) is not None:
                if generation.made is None:
                    generation.made = TokenRun((), scores.device)
                made = generation.made.after(generation.tokens if adjustments.penalizes else ())
                reads = adjustments.reads_sequence
                sequence = generation.sequence(scores.device)[None] if reads else None
                adjustments.apply(scores[index : index + 1], made[None], sequence)
            # (a grammar says itself when the end may come; with ignore_eos the end token
            # ends nothing, so there is no end to hold back, as `generate` has none)
            holds_end = generation.grammar is None and not generation.ignore_eos
            if holds_end and len(generation.tokens) < generation.min_new_tokens:
                scores[index].index_fill_(0, self._eos_index, float("-inf"))
        held = [(i, g.grammar) for i, g in enumerate(rows) if g.grammar is not None and not g.done]
        for index, why in constrain(scores, held):
            rows[index].fail(why)
            rows[index].grammar.failed()
        sampled = [i for i, g in enumerate(rows) if g.do_sample and not g.done]
        # every row drawn: its scores as they are, not a copy of them, and no greedy choice
        # (each a pass over the vocabulary a row)
        every = bool(sampled) and len(sampled) == len(rows)
        if not every:
            tokens = greedy if plain else scores.argmax(dim=-1)
        if sampled:
            which = None if every else torch.tensor(sampled, device=scores.device)
            probabilities = sampling_probabilities(
                scores if which is None else scores.index_select(0, which),
                [rows[i] for i in sampled],
            )
            # a row whose settings leave nothing to draw from fails alone (its draw would
            # be no token of its distribution); one look for every row. A softmax's row is
            # numbers summing to 1 exactly where its likeliest is above 0 (else NaN)
            drawable = probabilities.amax(-1) > 0
            draws = drawn(probabilities, [rows[i].generator for i in sampled])
            if which is None:  # (a row that cannot draw fails: its token is never taken)
                tokens = draws
            else:
                tokens.index_copy_(
                    0, which, torch.where(drawable, draws, tokens.index_select(0, which))
                )
        for generation, fault in zip(rows, broken.tolist(), strict=True):
            if fault and not generation.done:
                generation.fail(MODEL_SCORES_FAILED_MESSAGE, FailureKind.INTERNAL)
        if sampled:
            for index, fine in zip(sampled, drawable.tolist(), strict=True):
                if not fine and not rows[index].done:  # (done: its scores were not numbers)
                    rows[index].fail(SAMPLING_FAILED_MESSAGE)
        chosen = tokens.tolist()
        logprobs: list[float] | None = None
        top: list[list[tuple[int, float]]] | None = None
        if any(g.logprobs is not None for g in rows):
            all_logprobs = scores.log_softmax(-1)
            logprobs = all_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            top = likeliest(all_logprobs, max(g.top_n for g in rows))
        self._accept(rows, chosen, logprobs, top)
        if self.after_pass is not None:
            self.after_pass()
        return tokens

    def _accept(
        self,
        rows: Sequence[Generation],
        tokens: list[int],
        logprobs: list[float] | None,
        top: list[list[tuple[int, float]]] | None = None,
    ) -> None:
        """Each row's new token: its text, then whether it ends the sequence (end of
        sequence, a stop sequence in the text's tail, or the row's cap)."""
        for index, (generation, token) in enumerate(zip(rows, tokens, strict=True)):
            if generation.done:
                continue
            generation.tokens.append(token)
            if generation.grammar is not None:
                generation.grammar.consume_token(token)
            assert generation.pieces is not None  # set by add()
            ends = token in self.eos_ids and not generation.ignore_eos
            last = ends or len(generation.tokens) >= generation.cap
            pieces = generation.pieces.next_pieces(generation.tokens, last)
            before = generation.tail
            generation.tail = stop_tail(before + "".join(pieces), generation.stop)
            if generation.logprobs is not None and logprobs is not None:
                generation.logprobs.append(logprobs[index])
                if generation.top_n and top is not None:
                    generation.top = top[index][: generation.top_n]
            stopped = stopped_pieces(
                before,
                pieces,
                generation.pieces.readable,
                len(generation.tokens),
                generation.stops_after,
                generation.stop,
            )
            if stopped is not None:  # (before an end of sequence that let out the run)
                generation.finish_reason = "stop_sequence"
                if past := len(pieces) - len(stopped):
                    del generation.tokens[-past:]
                    if generation.logprobs is not None:
                        del generation.logprobs[-past:]
                pieces = stopped
            elif ends:
                generation.finish_reason = "eos_token"
            elif len(generation.tokens) >= generation.cap:
                generation.finish_reason = "length"
            if self.on_token is not None:  # told once it is known whether the token ends it
                self.on_token(generation, token, pieces)


def generator_seed(seed: int) -> int:
    """The seed to give torch's generator for a request's `seed` (TGI's take 0 to 2**64 - 1).
    A CPU generator reads only a seed's low 32 bits, so that 7 and 7 + 2**32 would sample
    alike: a larger seed is mixed down (splitmix64's finaliser) to 32 bits that all of its
    own bits decide; a seed below 2**32 is taken as it is."""
    if seed < SEEDS:
        return seed
    mixed = seed & MASK_64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & MASK_64
    return (mixed ^ (mixed >> 31)) % SEEDS


def like_lengths(prompts: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """The prompts in groups of one forward pass each, longest first: a prompt joins the
    group before it while the group padded to its longest stays within `PREFILL_PADDING`
    times its tokens, or within `PREFILL_SMALL` tokens."""
    groups: list[list[tuple[int, ...]]] = []
    tokens = 0  # the last group's own
    for prompt in sorted(prompts, key=len, reverse=True):
        padded = len(groups[-1][0]) * (len(groups[-1]) + 1) if groups else 0
        if groups and padded <= max(PREFILL_SMALL, PREFILL_PADDING * (tokens + len(prompt))):
            groups[-1].append(prompt)
            tokens += len(prompt)
        else:
            groups.append([prompt])
            tokens = len(prompt)
    return groups


def stopped_pieces(
    before: str,
    pieces: Sequence[str],
    readable: Sequence[str] | None,
    made: int,
    stops_after: int,
    stops: Sequence[str],
) -> list[str] | None:
    """The texts of the tokens through the one the first stop sequence ends in, of
    `pieces` (the texts the last of `made` tokens let out, after the text's end
    `before`); None where none ends in them. Where they let out a run of byte tokens
    that is not UTF-8 as a whole, a stop may end where it reads as UTF-8 (`readable`),
    as TGI reads the text token by token: the run cut there is UTF-8, and its texts are
    those. (No stop holds its U+FFFDs: `text_generation.stop_sequences`.)"""
    first = made - len(pieces)  # (the tokens before them)
    if readable is not None:
        text = before + "".join(readable)
        if kept := pieces_through_stop(text, readable, first + len(readable), stops_after, stops):
            return list(readable[:kept])
    kept = pieces_through_stop(before + "".join(pieces), pieces, made, stops_after, stops)
    return list(pieces[:kept]) if kept else None


def pieces_through_stop(
    text: str, pieces: Sequence[str], made: int, stops_after: int, stops: Sequence[str]
) -> int:
    """How many of `pieces` (the texts the last of `made` tokens let out, at the end of
    `text`) run through the first stop sequence to end in them; 0 where none ends. A run
    of byte tokens is let out at once, as it ends, so a stop may end in one of its first
    tokens: those let out after that one are no part of the answer (TGI stops at the
    token a stop ends in; they were listed, streamed and counted)."""
    counted = counted_text(pieces, made, stops_after)
    through = stop_in_piece(text, counted, stops)
    if not through:
        return 0
    end = sum(map(len, pieces)) - len(counted) + through  # (in the pieces' text)
    reached = 0
    for kept, piece in enumerate(pieces, 1):
        reached += len(piece)
        if reached >= end:
            return kept
    return len(pieces)


def stop_in_piece(text: str, piece: str, stops: Sequence[str]) -> int:
    """How much of `piece`, the newest piece at the end of `text`, runs through the first
    stop sequence to end in it (0: none ends in it; one that ended earlier was found
    then, or did not count yet)."""
    if not stops or not piece:  # (most rows, at every step: nothing to look for)
        return 0
    starts = len(text) - len(piece)
    end = first_stop_end(text, stops, past=starts)
    return 0 if end is None else end - starts


def end_ids(tokenizer: Any, model: Any) -> set[int]:
    """The tokens that end a sequence: the tokenizer's, and those the model's generation
    config names (`generate` stops there too: a chat model's end of turn)."""
    named = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(named if isinstance(named, (list, tuple)) else [named])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward pass takes its KV cache by: `cache` since
    transformers renamed it (`past_key_values`, still taken, now warns)."""
    forward = inspect.signature(model.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


def cache_of(out: Any) -> Any:
    """A forward pass's KV cache, under its name in this transformers (`cache`, or the
    older `past_key_values`; asking for that name where `cache` is the field warns it
    deprecated, as it did at the load of every model that returns no cache)."""
    if "cache" in getattr(out, "__dataclass_fields__", ()):
        return out.get("cache")
    return out.get("past_key_values")
