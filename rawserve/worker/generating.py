"""The worker's loop for text generation with continuous batching.

A worker serving a causal LM with `WorkerConfig.generation == "continuous"` runs this loop
instead of one batch after another (rawserve.worker.process). It takes any number of
batches at a time: each item becomes a sequence of the running batch
(rawserve.worker.continuous), joining between decoding steps and leaving when it finishes,
so a short request never waits for a long one. Between two steps it takes every message
the server has sent (rawserve.worker.feeder): new batches, a `Cancel(batch_id)` (that
batch's sequences end at the next step, finish_reason "cancelled"), or `Shutdown`. A
batch is answered (`BatchResult`, its compute seconds counted from its arrival) the
moment its last item is done, in whatever order batches finish; streamed tokens go out
once per forward pass, every stream's in one message (`TokenChunks`). With nothing running
it blocks on the pipe.

Items are turned into sequences, and finished sequences into outputs, by the runner
(rawserve.worker.causal_lm), so an item gets here what one `generate` call gives it: an
input that cannot run fails alone, at once, with the same message. A step that raises
fails the sequences it was running (the runner's `describe_failure`) and the loop goes
on; after an out-of-memory error it runs half as many rows at once for a while. Where
the joining sequences' own prefill raised, the running rows go on untouched; joiners
that ran out of memory, together or beside running rows, wait and join again, fewer at
a time, so that only one too large even alone, with no row running, fails; joiners
whose prefill failed otherwise join again in halves, as the static path bisects a
failing batch, down to the prompts that fail alone. Where a decoding step ran out, the
sequences it was running start again from their prompts, as the static path splits a
batch and retries its halves (not one that ran out of memory alone, nor a stream that
has sent tokens: those fail).

Worker process only (it drives the model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rawserve.shared.memory import FreeMemoryReleaser
from rawserve.shared.messages import (
    PASSES_EVERY,
    PROGRESS_EVERY,
    Batch,
    BatchResult,
    Cancel,
    FailureKind,
    ItemFailure,
    Progress,
    Shutdown,
    TokenChunk,
    TokenChunks,
    WorkerConfig,
)
from rawserve.worker.batch_runs import BatchCap, release_memory, sample_token_counts
from rawserve.worker.causal_lm import CausalLMRunner
from rawserve.worker.continuous import ContinuousBatcher, Generation
from rawserve.worker.cuda_graphs import said_after_warm_up
from rawserve.worker.feeder import Feeder
from rawserve.worker.library_panics import panics_as_errors
from rawserve.worker.runner import NotNumbers, Runner
from rawserve.worker.text_pieces import HeldTokens
from rawserve.worker.token_times import TokenTimes

log = logging.getLogger("rawserve.generation")

ROWS_ON_CUDA = 256  # sequences at once by default: a GPU's step costs little more with more
ROWS_ON_CPU = 64
ROWS_RESTORE_AFTER = 200  # good steps at lowered rows (after out of memory) before doubling


def continuous_loop(
    runner: Runner, config: WorkerConfig, send: Callable[[Any], None], cancelled_stream: Any
) -> GenerationLoop | None:
    """The loop this worker serves with, if it batches continuously (a causal LM, not
    `--generation static`, whose forward pass returns a KV cache and whose generation
    config asks for nothing the loop does not apply); None when it runs one batch after
    another. What was chosen, and why, is the runner's `generation_mode` (/info)."""
    if not isinstance(runner, CausalLMRunner):
        return None
    if config.generation != "continuous":
        runner.generation_mode = "static: --generation static"
        log.info("generation: %s", runner.generation_mode)
        return None
    why = runner.uncached
    if not why and (unapplied := runner.unapplied_settings):
        why = (
            f"the model's generation config sets {', '.join(unapplied)}, which continuous "
            "batching does not apply"
        )
    if why:
        log.warning("generation: static (one generate call per batch), not continuous: %s", why)
        runner.generation_mode = f"static (one generate call per batch): {why}"
        return None
    rows = config.max_sequences or (ROWS_ON_CUDA if runner.on_cuda else ROWS_ON_CPU)
    runner.generation_mode = f"continuous: up to {rows} sequences at once"
    # (the server's "batch limits" line speaks of batches, which such a worker makes not)
    log.info("generation: %s (--max-sequences)", runner.generation_mode)
    loop = GenerationLoop(
        runner, send, rows, cancelled_stream, config.threads, config.join_wait_steps
    )
    if config.warmup_batch and runner.decode_graphs:
        record_graphs(loop.batcher, runner)
    return loop


def record_graphs(batcher: ContinuousBatcher, runner: CausalLMRunner) -> None:
    """The warm-up's recording of the loop's CUDA graphs; a failure (out of memory, say)
    leaves them to be recorded as shapes come, and the worker starts all the same."""
    started = time.monotonic()
    prompt = runner.tokenizer("the first requests find their graphs")["input_ids"]
    try:
        recorded = batcher.record_graphs(prompt)
    except Exception:  # noqa: BLE001 - logged; the worker serves without them
        log.warning("CUDA graphs: recording at the warm-up failed", exc_info=True)
        batcher.drop_running()
        batcher.waiting.clear()
        return
    log.info("CUDA graphs: %d recorded at the warm-up in %.1f s", recorded,
             time.monotonic() - started)  # fmt: skip
    graphed = [batcher.decode_graphs, batcher.prefill_graphs]
    shelves = [graphs.shelf for graphs in graphed if graphs is not None]
    runner.cuda_graphs = said_after_warm_up(runner.cuda_graphs, shelves)


@dataclass(eq=False)
class OpenBatch:
    """A batch with items still running: what its answer needs."""

    batch: Batch
    params: dict[str, Any]
    arrived: float
    outputs: list[Any]  # one per item; None while the item runs
    generations: dict[int, Generation] = field(default_factory=dict)  # item index: its own
    tokens: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # details' tokens
    # item index: its tokens waiting for their texts (a run of byte tokens' end)
    held: dict[int, HeldTokens] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(output is not None for output in self.outputs)


class GenerationLoop:
    """Runs the batches that come through a `Feeder` as one continuous batch, `rows`
    sequences at most at once, and writes each batch's answer and streamed tokens with
    `send` (the worker's pipe)."""

    def __init__(
        self,
        runner: CausalLMRunner,
        send: Callable[[Any], None],
        rows: int,
        cancelled_stream: Any = None,
        threads: int | None = None,
        join_wait_steps: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.runner = runner
        self.send = send
        self.rows = rows
        self.cancelled_stream = cancelled_stream  # a shared integer: a stream to stop
        self.clock = clock
        self.batcher = ContinuousBatcher(
            runner.model,
            runner.tokenizer,
            runner.max_positions,
            rows,
            self._on_token,
            self._send_streamed,
            cuda_graphs=runner.decode_graphs,
            join_wait_steps=join_wait_steps,
        )
        self.streamed: list[TokenChunk] = []  # this forward pass's tokens for their streams
        self.progress_at = 0.0  # when a pass's end was last sent (tokens, or `Progress`)
        self.passes_at = 0.0  # when the passes were last counted to the server
        self.open: dict[int, OpenBatch] = {}  # by batch id
        self.times = TokenTimes()  # the sequences' latencies, for the server's metrics
        self.cap = BatchCap(ROWS_RESTORE_AFTER)
        self.releaser = FreeMemoryReleaser()
        self.threads = threads  # intra-op threads now (a batch may ask for others)
        self.server_gone = False

    def run(self, feeder: Feeder) -> None:
        """Serve what `feeder` brings until `Shutdown` (or until the server is gone)."""
        self.batcher.passes.taken()  # the warm-up's are no work of the server's
        while not self.server_gone:
            # running: take what came during the step; idle: wait for the server
            messages = feeder.drain() if self.batcher.busy else [feeder.next(), *feeder.drain()]
            for message in messages:
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, Batch):
                    self._take(message)
                elif isinstance(message, Cancel):
                    self._cancel(message.batch_id)
            self._stop_cancelled_streams()
            if self.batcher.busy:
                self._step()
            if not self.batcher.busy:
                self._count_passes()  # idle: the counts are whole till work comes
                self.releaser.after_batch()  # idle: the heap's free pages go back

    # --- messages in ------------------------------------------------------------------------

    def _take(self, batch: Batch) -> None:
        """A new batch: each item joins as a sequence, or fails alone at once."""
        if batch.threads and batch.threads != self.threads:
            self.runner.set_threads(batch.threads)
            self.threads = batch.threads
        params = dict(batch.params)
        opened = OpenBatch(batch, params, self.clock(), [None] * len(batch.inputs))
        self.open[batch.batch_id] = opened
        for index, item in enumerate(batch.inputs):
            try:
                with panics_as_errors():
                    generation = self.runner.generation(
                        (batch.batch_id, index), item, params, batch.control
                    )
                if generation.max_new_tokens:
                    self.batcher.add(generation)
                    admitted = batch.admitted[index] if index < len(batch.admitted) else None
                    self.times.admitted(generation, admitted)
                elif generation.scoring is not None:  # scored a few windows a step
                    self.batcher.add(generation)
            except Exception as exc:  # noqa: BLE001 - every failure becomes data
                self._fail(opened, index, self.runner.describe_failure(exc), exc)
                continue
            opened.generations[index] = generation
            opened.held[index] = HeldTokens()
            if generation.logprobs is not None and batch.control.stream_id is None:
                opened.tokens[index] = []  # details list the tokens
            if not (generation.max_new_tokens or generation.scoring):  # nothing to run
                generation.finish_reason = "length"
                self._output(opened, index, generation)
        self._answer_if_done(opened)

    def _cancel(self, batch_id: int) -> None:
        opened = self.open.get(batch_id)
        if opened is None:  # already answered: nothing to stop
            return
        for generation in opened.generations.values():
            self.batcher.cancel(generation.key)

    def _stop_cancelled_streams(self) -> None:
        """The server's older way to stop a stream: a shared integer naming its id."""
        if self.cancelled_stream is None:
            return
        stream_id = self.cancelled_stream.value
        if not stream_id:
            return
        for opened in self.open.values():
            if opened.batch.control.stream_id == stream_id:
                self._cancel(opened.batch.batch_id)

    # --- steps ------------------------------------------------------------------------------

    def _step(self) -> None:
        self.batcher.cap_rows(self.cap.limit or self.rows)
        self.times.step_begins()
        try:
            with panics_as_errors():
                finished = self.batcher.step()
        except Exception as exc:  # noqa: BLE001 - the worker goes on without those rows
            self._on_step_failure(exc)
            finished = self.batcher.take_finished()  # (ended before the pass that raised)
        else:
            self.cap.on_success()
        for generation in finished:
            self._finish(generation)

    def _on_step_failure(self, exc: Exception) -> None:
        self.streamed = []  # a failed pass's tokens: its sequences fail instead
        prefill = self.batcher.prefilling  # the joiners' own pass failed: the rows go on
        running = self.batcher.drop_failed()
        failure = self.runner.describe_failure(exc)
        prompts = {tuple(generation.prompt_ids) for generation in running}
        if prefill and len(prompts) > 1 and failure.kind is not FailureKind.OUT_OF_MEMORY:
            # the model failed on one of their prompts, maybe: as the static path bisects
            # a failing batch, they join again in halves, down to the prompts that fail
            # alone (each prefilled once more at most for every halving: it ends). Copies
            # of one prompt (a request's n choices; a long one's chunks) fail together:
            # halves of them failed again, and those of a prompt prefilled in chunks
            # joined its chunks again whole, failing and halved for good
            at_most = len(running) // 2
            log.warning(
                "a prefill of %d sequences failed (%s): they join again, %d at a time",
                len(running),
                failure.message,
                at_most,
            )
            self.batcher.wait_again(running, at_most)
            return
        if failure.kind is FailureKind.OUT_OF_MEMORY:
            release_memory()
            sequences = len(self.batcher.rows) + len(running)  # (the rows go on after a prefill)
            self.cap.lower(max(sequences, 2))
            log.warning(
                "out of memory running %d sequences: %d at once for a while",
                sequences,
                self.cap.limit,
            )
            # joiners with no token yet, run out of memory together or beside rows that
            # hold memory: they join again, fewer at a time (the cap), until one that does
            # not fit even alone, no row running, fails alone
            beside_rows = prefill and bool(self.batcher.rows)
            fewer = len(running) > 1 or beside_rows
            if fewer and not any(generation.tokens for generation in running):
                for generation in running:
                    self._score_again(generation)
                self.batcher.wait_again(running)
                return
        retry = failure.kind is FailureKind.OUT_OF_MEMORY and len(running) > 1
        traced: BaseException | None = exc  # (the first to fail logs it: one traceback)
        for generation in running:
            batch_id, item = generation.key
            opened = self.open.get(batch_id)
            if opened is None:
                continue
            if retry and self._start_again(opened, item, generation):
                continue
            self._fail(opened, item, failure, traced)
            traced = None
            self._answer_if_done(opened)

    def _score_again(self, generation: Generation) -> None:
        """A sequence whose prompt's scoring pass (`scoring`) ran out of memory scores it
        from the start when it is back (its pass, a generator, ended with the error: it
        joined with no `prefill`, a 200 listing none of the prompt's tokens)."""
        opened = self.open.get(generation.key[0])
        if generation.scoring is not None and opened is not None:
            generation.scoring = self.runner.listing_prefill(generation, opened.params)

    def _start_again(self, opened: OpenBatch, index: int, generation: Generation) -> bool:
        """A sequence that ran out of memory beside others queued again from its prompt
        (the same seed: the same sample); False where it cannot be: a stream that has
        sent tokens, or its item fails now."""
        batch = opened.batch
        if batch.control.stream_id is not None and generation.tokens:
            return False
        try:
            with panics_as_errors():
                again = self.runner.generation(
                    generation.key, batch.inputs[index], opened.params, batch.control
                )
                again.seed = generation.seed
                self.batcher.add(again)
        except Exception:  # noqa: BLE001 - it fails as it was going to
            return False
        opened.generations[index] = again
        self.times.forget(generation, again)
        if index in opened.tokens:
            opened.tokens[index] = []
        opened.held[index] = HeldTokens()
        return True

    def _on_token(self, generation: Generation, token_id: int, pieces: list[str]) -> None:
        """A new token: timed, and streamed to its client or kept for the details, if
        wanted, with those before it that waited for their texts (`HeldTokens`)."""
        self.times.token(generation)
        if generation.logprobs is None:
            return
        batch_id, index = generation.key
        opened = self.open[batch_id]
        token = self.runner.token(token_id, generation.logprobs[-1], generation.top)
        let_out = opened.held[index].add(token, pieces)
        stream_id = opened.batch.control.stream_id
        if stream_id is None:
            opened.tokens[index] += let_out
            return
        ends = generation.finish_reason is not None  # decided before the token is heard
        first = len(let_out) == len(generation.tokens)  # (none was sent before them)
        chat = opened.batch.inputs[index]
        for at, token in enumerate(let_out):
            more = not (ends and at == len(let_out) - 1)
            opening = first and at == 0
            thinking = (
                self.runner.opened(opened.params, generation.prompt_ids, chat) if opening else None
            )
            self.streamed.append(TokenChunk(stream_id, index, token, more, thinking))

    def _send_streamed(self) -> None:
        """A forward pass is over: its streamed tokens go in one message, before the next
        pass starts (a joiner's first token does not wait for the decoding step); with
        none, a `Progress` now and then says the worker is not hung; and now and then the
        passes run so far, for the server's metrics."""
        self.times.pass_ends()
        now = self.clock()
        if self.streamed:
            self._tell(TokenChunks(tuple(self.streamed)))
            self.streamed, self.progress_at = [], now
        elif now - self.progress_at >= PROGRESS_EVERY:
            self._tell(Progress())
            self.progress_at = now
        if now - self.passes_at >= PASSES_EVERY:
            self._count_passes()

    def _count_passes(self) -> None:
        """The passes run since they were last counted, to the server (its metrics)."""
        passes = self.batcher.passes.taken()
        if passes is not None:
            self.passes_at = self.clock()
            self._tell(self.times.taken(passes))

    def _tell(self, message: Any) -> None:
        try:
            self.send(message)
        except (OSError, ValueError):  # the server is gone
            self.server_gone = True

    # --- answers out ------------------------------------------------------------------------

    def _finish(self, generation: Generation) -> None:
        batch_id, index = generation.key
        opened = self.open.get(batch_id)
        if opened is None:
            return
        if generation.failure is not None:  # its settings, grammar or scores: it alone fails
            failure = ItemFailure(generation.failure_kind, generation.failure)
            if failure.kind is not FailureKind.INPUT:
                request = opened.batch.request_id(index)
                named = {"request_id": request}  # a JSON line's field, as the access log's
                log.warning("a sequence failed (request %s): %s", request, failure.message,
                            extra=named)  # fmt: skip
            self._fail(opened, index, failure, None)
            self._answer_if_done(opened)
            return
        if generation.finish_reason == "cancelled":
            request = opened.batch.request_id(index)  # (to be found beside its access line)
            log.info(
                "generation stopped after %d tokens (request %s): the client left or "
                "stopped reading, or its deadline passed",
                len(generation.tokens),
                request,
                extra={"request_id": request},
            )
        self._output(opened, index, generation)
        self._answer_if_done(opened)

    def _output(self, opened: OpenBatch, index: int, generation: Generation) -> None:
        """A finished sequence's output, in its place in its batch's answer."""
        batch = opened.batch
        tokens = opened.tokens.get(index)
        if tokens is not None and generation.pieces is not None:  # a cancel cut a run short
            tokens += opened.held[index].let_out(generation.pieces.rest(generation.tokens))
        try:
            with panics_as_errors():
                output = self.runner.finished(
                    generation, batch.inputs[index], opened.params, batch.control, tokens
                )
        except Exception as exc:  # noqa: BLE001 - a failure becomes data
            output = self.runner.describe_failure(exc)
            request = batch.request_id(index)
            log.error("an item's output failed (request %s)", request, exc_info=exc,
                      extra={"request_id": request})  # fmt: skip
        opened.outputs[index] = output

    def _fail(
        self, opened: OpenBatch, index: int, failure: ItemFailure, exc: BaseException | None
    ) -> None:
        if failure.kind is not FailureKind.INPUT and exc is not None:
            request = opened.batch.request_id(index)
            named = {"request_id": request}
            if isinstance(exc, NotNumbers):  # the model's numbers, not a bug to trace
                log.warning("generation failed (request %s): %s", request, exc, extra=named)
            else:
                log.error("generation failed (request %s)", request, exc_info=exc, extra=named)
        opened.outputs[index] = failure
        generation = opened.generations.pop(index, None)
        if generation is not None:  # it never finishes: its times are forgotten
            self.times.forget(generation)

    def _answer_if_done(self, opened: OpenBatch) -> None:
        if not opened.done:
            return
        batch = opened.batch
        del self.open[batch.batch_id]
        result = BatchResult(
            batch.batch_id,
            tuple(opened.outputs),
            self.clock() - opened.arrived,
            token_counts=sample_token_counts(self.runner, batch),
            made=tuple(
                len(ran.tokens) if (ran := opened.generations.get(i)) is not None else 0
                for i in range(len(opened.outputs))
            ),
        )
        if not self._answer(result):  # it fails alone, where the worker would die of it
            why = "the model's answer to this input cannot be sent (out of memory)"
            failed = ItemFailure(FailureKind.OUT_OF_MEMORY, why)
            self._answer(replace(result, outputs=(failed,) * len(result.outputs)))

    def _answer(self, result: BatchResult) -> bool:
        """Send a batch's answer; False where there is no memory to write it (pickling
        comes first: nothing was written)."""
        try:
            self.send(result)
        except MemoryError:
            log.error("out of memory writing the answer to a batch of %d", len(result.outputs))
            return False
        except (OSError, ValueError):  # the server is gone
            self.server_gone = True
        return True
