"""Token streaming for text-generation: `"stream": true` → text/event-stream, TGI's shape.

Owns the server side of a stream: it opens a stream on the model's serving side, queues
the request like any other with that stream's id (which keeps it out of other requests'
batches and tells the worker to send a `TokenChunk` per new token), and turns the chunks
into server-sent events:

    data: {"index": 1, "token": {"id", "text", "logprob", "special"}, "generated_text": null, "details": null}
    ...
    data: {"index": n, "token": {...}, "generated_text": "...", "details": {...}}

The last token's event carries the full text, as TGI's does: a token the worker says
the generation goes on after is sent at once, any other is held back until the next token
or the batch's result says whether it was the last. When the client leaves, the
protocol closes the event iterator: the listener is removed, the queued item withdrawn,
and the worker told to stop generating. A client that stays connected but does not read
gets the same once `STREAM_BUFFER_TOKENS` tokens have waited for it `UNREAD_SECONDS` with
none read (then an error event), and the protocol's write timeout ends it.

A stream silent for `keepalive` seconds (queued behind others, a long prefill, a grammar
compiling) is sent a comment, `: keep-alive` (SSE clients skip comments, as TGI's do):
proxies and load balancers cut a response silent past their read timeout (nginx's and
AWS ALB's 60 s by default). Its head goes out with the first token, or at the first
comment if that comes first: from then on an error before the first token is an error
event, as one after it is. Never imports torch.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

from rawserve.api.outcomes import unwrap
from rawserve.api.served import ServedModel
from rawserve.http.encoding import dumps
from rawserve.http.errors import (
    HTTPError,
    ServiceUnavailable,
    UnprocessableInput,
    as_http_error,
    error_document,
    tgi_error,
)
from rawserve.http.exchange import HttpResponse
from rawserve.serving.face import Control, ItemResult, Serving, TokenChunk
from rawserve.tasks.text_generation import returns_full_text, tgi_output

log = logging.getLogger("rawserve.streams")

Run = asyncio.Future[list[ItemResult]]
# Tokens a stream holds for a client that does not read them: past it, with none read for
# UNREAD_SECONDS, the generation is stopped (a client that cannot keep up with the model
# would hold the worker, and the tokens its memory, for nobody). Not at once: tokens come
# in bursts where this process paused (an HTTP process stopped for a moment is handed
# those of the seconds it missed in one pass, before the stream's writer could run), and
# a client reading all along lost its stream "for leaving tokens unread".
STREAM_BUFFER_TOKENS = 1024
UNREAD_SECONDS = 1.0
# ... and where the stream's writer waits for room, with its client's bytes taken none for
# this long: a client reading steadily, slower than the tokens come, is seen taking bytes
# only as its receive window opens again (up to 64 KB at a time on loopback: at 10 KB/s,
# every 6 s), and lost its stream "for leaving tokens unread" at one second's look
CLIENT_SILENT_SECONDS = 10.0
CLIENT_LOOK_SECONDS = 0.5  # how often a stream whose writer is behind looks at its client
# ... and whatever the reads, never more than this many wait (the memory they take)
STREAM_HOLD_TOKENS = 4 * STREAM_BUFFER_TOKENS


def overflowed() -> ServiceUnavailable:
    """A stream's end for tokens left unread: made anew each time (one error raised by
    every such stream grew its traceback by each raise's frames, and they held every
    stream it ended, the text sent with it, for the process's life)."""
    return ServiceUnavailable(
        f"the stream was stopped: its client left {STREAM_BUFFER_TOKENS} tokens or more unread"
    )


# What a stream silent for its keep-alive interval is sent: an SSE comment
KEEP_ALIVE = b": keep-alive\n\n"


def sse(document: Any) -> bytes:
    """A TGI event, as TGI writes it (`data:{...}`)."""
    return b"data:" + event_json(document) + b"\n\n"


def spaced_sse(document: Any) -> bytes:
    """An OpenAI event, as OpenAI and vLLM write it (`data: {...}`): valid either way,
    but parsers written by hand look for "data: "."""
    return b"data: " + event_json(document) + b"\n\n"


# What JSON may hold raw in a string that Python's `str.splitlines` ends a line at:
# httpx's line reader (huggingface_hub's streams read with it) cut an event of generated
# text holding U+2028 in two, and its client failed on the halves.
_LINE_ENDS_RAW = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def event_json(document: Any) -> bytes:
    """`document`'s JSON as one line of an event, whatever line reader reads it: SSE ends
    lines at CR and LF only, which JSON escapes; U+0085, U+2028 and U+2029 escaped too."""
    data = dumps(document)
    for raw, escaped in _LINE_ENDS_RAW:
        data = data.replace(raw, escaped)
    return data


class StreamEnd:
    """How an HTTP stream ended, shared by its choices' TokenStreams: its error event is
    logged and counted once for the stream (a client that stopped reading overflowed all
    n of its choices at once: n lines, and n counts on /metrics), with `explain` saying
    more of it (the field at fault). One choice that overflows stops them all: the
    client reads them from one connection."""

    def __init__(self, explain: Callable[[HTTPError], None] | None = None) -> None:
        self.explain = explain
        self.told = False
        self.streams: list[TokenStream] = []  # its choices


class TokenStream:
    """A generation started for one prompt: its token chunks as they come (at most
    `STREAM_HOLD_TOKENS` unread, and `STREAM_BUFFER_TOKENS` for no more than a second
    without a read while it runs), then its result.

    `close()` (idempotent) removes the listener and withdraws the request: the worker is
    told to stop generating if it still is.
    """

    def __init__(
        self,
        model: ServedModel,
        prompt: Any,
        params: Mapping[str, Any],
        deadline: float,
        request_id: str = "-",
        end: StreamEnd | None = None,
    ):
        self.serving: Serving = model.serving
        self.request_id = request_id  # what its error event's log line names
        # how the HTTP stream ends, told once for all its choices (each one a TokenStream)
        self.end = end or StreamEnd()
        self.end.streams.append(self)
        self.count_error = model.count_stream_error
        self.echoed = prompt if returns_full_text(params) else ""  # what the answer starts with
        # its TokenChunks, then None once its request has finished
        self.queue: asyncio.Queue[TokenChunk | None] = asyncio.Queue()
        self.reads = 0  # the chunks its writer has taken
        # bytes of the stream its client has taken (`watched`; None: not told): its writer
        # waits for room while a slow client reads what was written, and takes no chunk
        # meanwhile. The count last seen, and when it last grew.
        self.client_took: Callable[[], int] | None = None
        self.client_seen = (0, 0.0)
        self.client_looked = 0.0  # when it was last looked at
        self.unread_check: asyncio.TimerHandle | None = None
        self.overflowed = False
        self.closed = False
        self.stream_id = self.serving.open_stream(self.on_token)
        running = model.run([prompt], params, deadline, Control(stream_id=self.stream_id))
        self.run: Run = asyncio.ensure_future(running)
        self.run.add_done_callback(self._on_run_end)
        self.started = False  # `start()` has waited for the first token
        self.first: TokenChunk | None = None
        self.sent = False  # its answer is an event stream (`sent_as_events`)

    def _on_run_end(self, run: Run) -> None:
        # `output()` reads a failure where the answer tells it; streams of one answer share
        # a deadline and fail together, and those closed unread must not be logged as
        # errors nobody retrieved
        if not run.cancelled():
            run.exception()
            if self.sent:
                self._tell_failure()
        self.queue.put_nowait(None)

    def sent_as_events(self) -> None:
        """Its answer is an event stream from now (its head says 200): a failure of its
        run is its last event, told as it happens (`_tell_failure`)."""
        self.sent = True
        if self.run.done() and not self.run.cancelled():
            self._tell_failure()

    def _tell_failure(self) -> None:
        """Log and count the run's error (a deadline's 504, a worker lost) as it happens,
        not as the writer reaches its event behind the chunks a slow client has not
        read: told then, a deadline passed seconds before was told late, and never where
        that client left (neither logged nor on /metrics, its access line a 200)."""
        error = self.run.exception()
        if isinstance(error, HTTPError) and not self.overflowed:
            self.ended_with(error)

    def on_token(self, chunk: TokenChunk) -> None:
        if self.overflowed:
            return
        if self.queue.qsize() >= STREAM_HOLD_TOKENS:
            self._overflow()
            return
        self.queue.put_nowait(chunk)
        if self.client_took is not None and self.queue.qsize() > 1:  # (its writer is behind)
            self._look_at_client(CLIENT_LOOK_SECONDS)
        if self.queue.qsize() >= STREAM_BUFFER_TOKENS and self.unread_check is None:
            self._arm_unread_check()

    def _arm_unread_check(self) -> None:
        loop = asyncio.get_running_loop()
        self.unread_check = loop.call_later(UNREAD_SECONDS, self._check_unread, self.reads)

    def watched(self, client_took: Callable[[], int]) -> None:
        """Told, as its answer starts, how to ask what its client has taken of it."""
        self.client_took = client_took
        now = time.monotonic()
        self.client_seen = (client_took(), now)
        self.client_looked = now

    def _look_at_client(self, after: float = 0.0) -> float:
        """Note whether its client has taken more since the last look (looked at no more
        often than every `after` seconds), and say how long it has taken none: timed from
        its last read, not from the first look (a client that stopped reading 20 s before
        the buffer filled was given 10 s more, and met the write timeout first)."""
        assert self.client_took is not None
        now = time.monotonic()
        if now - self.client_looked >= after:
            self.client_looked = now
            took = self.client_took()
            if took != self.client_seen[0]:
                self.client_seen = (took, now)
        return now - self.client_seen[1]

    def _check_unread(self, reads: int) -> None:
        """Stop the stream if its writer took nothing since `reads`, with the buffer full
        and its generation still running (one that has finished holds no worker, and its
        tokens are bounded: its client, back from a pause, reads them whole), unless its
        client took some of what was written within `CLIENT_SILENT_SECONDS` (then it is
        looked at again a second later). A client reading slower than the tokens come is
        stopped only at `STREAM_HOLD_TOKENS`."""
        self.unread_check = None
        if self.run.done() or self.reads != reads or self.queue.qsize() < STREAM_BUFFER_TOKENS:
            return
        if self.client_took is not None and self._look_at_client() < CLIENT_SILENT_SECONDS:
            self._arm_unread_check()
            return
        self._overflow()

    def _overflow(self) -> None:
        """Stop this stream's choices: its client left one's tokens unread, so it reads
        none of them (its other choices ran on, unread, until each overflowed too)."""
        for stream in self.end.streams:
            if not stream.overflowed:
                stream.overflowed = True
                stream.close()  # the end (None) is queued when the run is cancelled
        # told now: a client that never reads again never gets the event
        self.ended_with(overflowed())

    async def start(self, patience: float | None = None) -> None:
        """Wait for the first token, `patience` seconds at most (None: as long as it
        takes); an error before it (the request refused or failed, in the server or by
        the worker) is raised with its status. Past `patience` it returns without it:
        the stream is sent, and an error before the first token is for `output()`."""
        try:
            self.first = await asyncio.wait_for(self.taken(), patience)
            self.started = True
            if self.first is None:
                self.output()  # raises the request's error, with its status
        except TimeoutError:
            return
        except BaseException:
            self.close()
            raise

    async def chunks(self) -> AsyncGenerator[TokenChunk, None]:
        """Every token chunk, the first included, until the request has finished (an
        error before the first token, for a stream not started, is for `output()`)."""
        chunk = self.first if self.started else await self.taken()
        while chunk is not None:
            yield chunk
            chunk = await self.taken()

    async def taken(self) -> TokenChunk | None:
        """The next chunk its writer takes (counted: a writer that takes none is stuck)."""
        chunk = await self.queue.get()
        self.reads += 1
        return chunk

    def output(self) -> Any:
        """The finished request's output; HTTPError if it failed or its client fell behind
        (a failure of the server's own, a bug, as a 500 whose traceback is logged: the
        stream ends with its error event, where it was cut off without one)."""
        if self.overflowed:
            raise overflowed()
        try:
            [result] = self.run.result()
        except HTTPError:
            raise
        except Exception as exc:  # noqa: BLE001 - as_http_error logs what is unexpected
            raise as_http_error(exc, self.request_id) from None
        return unwrap(result)

    def failed(self, exc: Exception) -> HTTPError:
        """`ended_with` the error of whatever ended the stream's events once its head was
        out: the request's own HTTP error, or a bug of the server's as a 500 whose
        traceback is logged (its client gets an error event, not a transfer cut off)."""
        return self.ended_with(as_http_error(exc, self.request_id))

    def ended_with(self, error: HTTPError) -> HTTPError:
        """`error`, which the stream's client gets as its last event, logged with the
        request's id: its head went out as 200, which its access line and /metrics say,
        so this line is where an operator finds how it ended (once for the HTTP stream: an
        overflow is told as it happens, the event sent when the client reads again, and
        the other choices' errors, which its client never sees, are not told)."""
        if self.end.told:
            return error
        self.end.told = True
        log.warning(
            "request %s: its stream ended with an error event: %d %s",
            self.request_id,
            error.status,
            error.message,
            extra={"request_id": self.request_id},
        )
        self.count_error(error.status)
        if self.end.explain is not None:
            self.end.explain(error)
        return error

    def close(self) -> None:
        """Stop the generation and withdraw the request (once; then it does nothing)."""
        if self.closed:
            return
        self.closed = True
        if self.unread_check is not None:
            self.unread_check.cancel()
        self.serving.close_stream(self.stream_id)
        if not self.run.done():
            self.run.cancel()

    def release(self) -> None:
        """`close()`, and drop the chunks nobody will read now (its HTTP stream is over).
        The stream's own objects are caught in reference cycles (its tasks' frames, the
        CancelledError that ended them), which only the collector's full pass frees, and
        a server idle after a burst may not run one for long (and one that frees 50
        unread streams' chunks, about 100 MB, holds the event loop 0.4 s): the chunks,
        most of that memory, are freed at once instead."""
        self.close()
        while not self.queue.empty():
            self.queue.get_nowait()


async def start_choices(streams: Sequence[TokenStream], patience: float | None) -> None:
    """Wait for the first stream's first token (`TokenStream.start`), and raise at once the
    error of any other that fails before it, with its status: a choice refused at
    admission refuses the request whole (503 with Retry-After), as it refuses one not
    streamed, and does not wait for the first choice's row meanwhile (a queue place held
    for nobody). Every stream is closed where one raises."""
    first = asyncio.ensure_future(streams[0].start(patience))
    waiting: set[asyncio.Future[Any]] = {first, *(stream.run for stream in streams[1:])}
    try:
        while not first.done():
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for stream in streams[1:]:
                if stream.run in done and not stream.run.cancelled() and stream.run.exception():
                    stream.output()  # raises its error, with its status
        first.result()
        for stream in streams[1:]:
            if stream.run.done():
                stream.output()  # raises its error, with its status
    except BaseException:
        first.cancel()
        # its outcome read whenever it ends: a cancellation that comes as its wait for the
        # first token ends is lost (asyncio.wait_for before 3.12), and it ends with the
        # request's refusal, logged as an error nobody retrieved
        first.add_done_callback(_read_outcome)
        for stream in streams:
            stream.close()
        raise


def _read_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def merged(
    streams: Sequence[TokenStream],
) -> AsyncGenerator[tuple[int, TokenChunk | None], None]:
    """Each stream's chunks as they come, with the stream's index, and (index, None) where
    a stream has finished. A stream read for its client here still stops when that
    client leaves its tokens unread: the hand-over between them is bounded too."""
    if len(streams) == 1:
        async for chunk in streams[0].chunks():
            yield 0, chunk
        yield 0, None
        return
    handed: asyncio.Queue[tuple[int, TokenChunk | None]] = asyncio.Queue(len(streams))

    async def pump(index: int, stream: TokenStream) -> None:
        async for chunk in stream.chunks():
            await handed.put((index, chunk))
        await handed.put((index, None))

    pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        finished = 0
        while finished < len(streams):
            index, next_chunk = await handed.get()
            finished += next_chunk is None
            yield index, next_chunk
    finally:
        for task in pumps:
            task.cancel()


async def open_token_stream(
    model: ServedModel,
    prompt: Any,
    params: Mapping[str, Any],
    deadline: float,
    keepalive: float | None = None,
    request_id: str = "-",
) -> HttpResponse:
    """Start a streamed generation; errors before its first token keep their status
    unless `keepalive` seconds pass before it (None: never a keep-alive comment)."""
    if params.get("decoder_input_details"):  # TGI refuses it the same way
        raise UnprocessableInput("decoder_input_details is not supported when streaming tokens")
    stream = TokenStream(model, prompt, params, deadline, request_id)
    await stream.start(keepalive)
    return event_stream(_events(stream), keepalive, [stream])


def event_stream(
    events: AsyncGenerator[bytes, None], keepalive: float | None, streams: Sequence[TokenStream]
) -> HttpResponse:
    """The response of `events`; as it is closed, however it ended, `streams` are closed
    (their generations stopped: events never begun would not close them) and their
    unread chunks dropped."""

    def close() -> None:
        for stream in streams:
            stream.release()

    def watched(taken: Callable[[], int]) -> None:
        for stream in streams:
            stream.watched(taken)

    for stream in streams:
        stream.sent_as_events()

    # a first token that did not come within the interval: the head goes with a comment
    # (else the first came only after a second interval of silence)
    waited = bool(streams) and not streams[0].started
    return HttpResponse(
        200,
        # X-Accel-Buffering: nginx passes each event on as it comes, even where its
        # configuration buffers proxied answers (its default)
        headers=[("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")],
        content_type="text/event-stream",
        stream=events if keepalive is None else kept_alive(events, keepalive, waited),
        on_stream_close=close,
        on_stream_start=watched,
    )


async def kept_alive(
    events: AsyncGenerator[bytes, None], interval: float, waited: bool = False
) -> AsyncGenerator[bytes, None]:
    """`events`, with `KEEP_ALIVE` after every `interval` seconds none came, and first
    where the stream `waited` one interval already."""
    silence = Silence(interval)
    following: asyncio.Future[bytes] | None = None
    try:
        following = asyncio.ensure_future(events.__anext__())
        if waited:
            yield KEEP_ALIVE
        while True:
            while not await silence.outwait(following):
                yield KEEP_ALIVE
            try:
                event = following.result()
            except StopAsyncIteration:
                return
            yield event
            following = asyncio.ensure_future(events.__anext__())
    finally:  # the client left (or the events failed): the events are closed too
        silence.end()
        if following is not None:
            if not following.done():
                following.cancel()
                await asyncio.wait({following})
            if not following.cancelled():
                # read: the events may have ended (or failed) as the client left, in the
                # same turn of the loop, with no one left to tell
                following.exception()
        await events.aclose()


class Silence:
    """How long a stream has waited for its next event: `outwait` returns False once
    `interval` seconds passed (time for a keep-alive), True as soon as the event came.

    One timer for the whole stream, moved on only when it fires: a stream's events come
    far more often than its interval passes, and a timer set and cancelled (with a wait
    on a set of futures, `asyncio.wait`'s) for each event cost its stream more than the
    rest of the event's way through the server."""

    def __init__(self, interval: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.interval = interval
        self.since = self.loop.time()  # when the wait now under way began
        self.waiter: asyncio.Future[None] | None = None
        self.timer = self.loop.call_at(self.since + interval, self._on_timer)

    async def outwait(self, following: asyncio.Future[bytes]) -> bool:
        """Wait for `following`, `interval` seconds at most: whether it is done."""
        if following.done():
            return True
        self.since = self.loop.time()
        waiter = self.waiter = self.loop.create_future()
        following.add_done_callback(self._wake)
        try:
            await waiter
        finally:
            self.waiter = None
            following.remove_done_callback(self._wake)
        return following.done()

    def _wake(self, _: object = None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _on_timer(self) -> None:
        due = self.since + self.interval
        if self.loop.time() >= due:  # a wait as long as the interval: wake it, if any
            self._wake()
            due = self.loop.time() + self.interval
        self.timer = self.loop.call_at(due, self._on_timer)

    def end(self) -> None:
        self.timer.cancel()


async def _events(stream: TokenStream) -> AsyncGenerator[bytes, None]:
    """TGI's events: a token each, one that may be the last held back until the result
    says it was, and then sent with the whole text."""
    try:
        held: TokenChunk | None = None
        index = 1  # TGI numbers a stream's tokens from 1
        emitted = ""  # the text of the tokens sent so far, special ones left out as the answer's
        async for chunk in stream.chunks():
            ready = [held] if held is not None else []  # a token came after it: not the last
            held = chunk
            if chunk.more:  # more follow: no need to wait for the next to know
                ready.append(chunk)
                held = None
            for sent in ready:
                yield sse(_event(index, sent.token))
                emitted += "" if sent.token["special"] else sent.token["text"]
                index += 1
        output = stream.output()
        last_token = dict(held.token) if held is not None else None
        text = output["generated_text"]
        generated = text.removeprefix(stream.echoed)  # the tokens' part of the text
        if last_token is not None and not last_token["special"] and generated.startswith(emitted):
            # the last token carries whatever a cut multi-byte character held back
            last_token["text"] = generated[len(emitted) :]
        details = tgi_output(output, streamed=True).get("details")
        yield sse(_event(index, last_token, text, details))
    except Exception as exc:  # noqa: BLE001 - the request's error or a bug: TGI's event
        yield sse(error_document(tgi_error(stream.failed(exc))))
    finally:
        stream.close()


def _event(
    index: int,
    token: Any,
    generated_text: str | None = None,
    details: Any = None,
) -> dict[str, Any]:
    token = dict(token) if token is not None else None
    event = {"index": index, "token": token, "generated_text": generated_text, "details": details}
    if token is not None and "top_tokens" in token:  # TGI's: beside the token, when asked
        event["top_tokens"] = token.pop("top_tokens")
    return event
