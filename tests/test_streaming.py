"""Token streaming's server side, with a fake scheduler and executor: the event shapes,
the held-back last token, errors before and after the first token, and cleanup."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref

import pytest

from rawserve.api import streaming
from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.api.streaming import (
    KEEP_ALIVE,
    STREAM_BUFFER_TOKENS,
    TokenStream,
    event_stream,
    kept_alive,
    open_token_stream,
    start_choices,
)
from rawserve.http.errors import ServiceUnavailable
from rawserve.http.exchange import HttpRequest
from rawserve.protocol import _close_stream
from rawserve.serving.face import ItemResult, Reason, Refused
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState
from rawserve.shared.messages import FailureKind, ItemFailure, TokenChunk, WorkerReady


class FakeExecutor:
    def __init__(self):
        self.listeners = {}
        self.closed = []

    def open_stream(self, on_token):
        stream_id = len(self.listeners) + 1
        self.listeners[stream_id] = on_token
        return stream_id

    def close_stream(self, stream_id):
        self.closed.append(stream_id)
        self.listeners.pop(stream_id, None)


class FakeScheduler:
    """Sends the given token texts to the stream (a `(text, True)` pair: a special
    token), then answers `output`."""

    most_admitted = None  # no bound of its own

    def __init__(self, executor, texts, output, *, fail_first=None):
        self.executor, self.texts, self.output, self.fail_first = (
            executor,
            texts,
            output,
            fail_first,
        )
        self.cancelled = asyncio.Event()

    def admission(self, deadline=None):
        return None  # room, at a glance: its refusals come from `run`

    async def run(self, inputs, params, deadline, control):
        if self.fail_first is not None:
            raise self.fail_first
        listener = self.executor.listeners[control.stream_id]
        try:
            for index, text in enumerate(self.texts):
                text, special = text if isinstance(text, tuple) else (text, False)
                token = {"id": index, "text": text, "logprob": -0.5, "special": special}
                listener(TokenChunk(control.stream_id, 0, token))
                await asyncio.sleep(0)  # the worker's tokens arrive one loop turn apart
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return [ItemResult(self.output, 0.0, 1, 0.0)]


async def open_stream(scheduler, executor):
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    return await open_token_stream(model, "hello", {"max_new_tokens": 3}, deadline=1e9)


async def collect(response):
    return [json.loads(chunk.removeprefix(b"data:")) async for chunk in response.stream]


async def test_a_stream_closed_before_it_is_sent_stops_its_generation():
    """The client left between the answer's making and its sending: the protocol closes
    the events unsent, and an async generator closed before its first step runs none of
    its code, so the generation went on for nobody (until it filled its buffer)."""
    from rawserve.protocol import _close_stream

    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"] * 100_000, {"generated_text": ""})
    response = await open_stream(scheduler, executor)
    await _close_stream(response)  # as the protocol does, for a client gone
    assert executor.closed == [1]


async def test_one_event_per_token_and_the_last_carries_the_text():
    executor = FakeExecutor()
    output = {"generated_text": " a b", "details": {"finish_reason": "length"}}
    scheduler = FakeScheduler(executor, [" a", " b", ""], output)
    response = await open_stream(scheduler, executor)
    assert response.status == 200 and response.content_type == "text/event-stream"
    events = await collect(response)
    assert [e["index"] for e in events] == [1, 2, 3]  # from 1, as TGI numbers them
    assert [e["generated_text"] for e in events] == [None, None, " a b"]
    assert events[-1]["details"] == {"finish_reason": "length"}
    assert "".join(e["token"]["text"] for e in events) == " a b"
    assert executor.closed == [1]


async def test_a_stream_asks_proxies_not_to_buffer_it():
    # nginx buffers a proxied answer unless its configuration or the answer says not to
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"], {"generated_text": " a", "details": {}})
    response = await open_stream(scheduler, executor)
    await collect(response)
    assert ("X-Accel-Buffering", "no") in response.headers


async def test_a_stream_tells_caches_to_keep_none_of_it():
    """`Cache-Control: no-cache`, as TGI's streams (axum's Sse) say it: a proxy or a
    browser's cache is not to keep a stream of tokens, nor answer it again."""
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"], {"generated_text": " a", "details": {}})
    response = await open_stream(scheduler, executor)
    await collect(response)
    assert ("Cache-Control", "no-cache") in response.headers


class OneThenTheRest(FakeScheduler):
    """Sends a first token the worker says more follow, and the rest once told to."""

    def __init__(self, executor, texts, output):
        super().__init__(executor, texts, output)
        self.go_on = asyncio.Event()

    async def run(self, inputs, params, deadline, control):
        listener = self.executor.listeners[control.stream_id]
        for index, text in enumerate(self.texts):
            token = {"id": index, "text": text, "logprob": -0.5, "special": False}
            more = index < len(self.texts) - 1
            listener(TokenChunk(control.stream_id, 0, token, more))
            await self.go_on.wait()
        return [ItemResult(self.output, 0.0, 1, 0.0)]


async def test_a_token_more_follow_is_sent_without_waiting_for_the_next():
    executor = FakeExecutor()
    output = {"generated_text": " a b", "details": {}}
    scheduler = OneThenTheRest(executor, [" a", " b"], output)
    response = await open_stream(scheduler, executor)
    events = response.stream.__aiter__()
    first = json.loads((await asyncio.wait_for(anext(events), 5)).removeprefix(b"data:"))
    assert first["token"]["text"] == " a" and first["generated_text"] is None
    scheduler.go_on.set()
    rest = [json.loads(chunk.removeprefix(b"data:")) async for chunk in events]
    assert [e["token"]["text"] for e in rest] == [" b"]
    assert [e["index"] for e in rest] == [2] and rest[-1]["generated_text"] == " a b"


async def test_a_cut_character_held_back_arrives_with_the_last_token():
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a", ""], {"generated_text": " a\ufffd", "details": {}})
    events = await collect(await open_stream(scheduler, executor))
    assert events[-1]["token"]["text"] == "\ufffd"


async def test_a_cut_character_arrives_with_the_last_token_after_a_special_token():
    # the answer's text leaves special tokens out: so does the text matched against it
    executor = FakeExecutor()
    texts = [" a", ("<s>", True), ""]
    scheduler = FakeScheduler(executor, texts, {"generated_text": " a\ufffd", "details": {}})
    events = await collect(await open_stream(scheduler, executor))
    assert [e["token"]["text"] for e in events] == [" a", "<s>", "\ufffd"]


async def test_the_last_token_carries_only_its_own_text_when_the_answer_holds_the_prompt():
    executor = FakeExecutor()
    output = {"generated_text": "hello a\ufffd", "details": {}}
    scheduler = FakeScheduler(executor, [" a", ""], output)
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    params = {"max_new_tokens": 2, "return_full_text": True}
    events = await collect(await open_token_stream(model, "hello", params, deadline=1e9))
    assert [e["token"]["text"] for e in events] == [" a", "\ufffd"]
    assert events[-1]["generated_text"] == "hello a\ufffd"


async def test_an_error_before_the_first_token_keeps_its_status():
    executor = FakeExecutor()
    full = Refused.because(Reason.QUEUE_FULL, "server busy: queue full", 3.0)
    scheduler = FakeScheduler(executor, [], None, fail_first=full)
    with pytest.raises(ServiceUnavailable) as refused:
        await open_stream(scheduler, executor)
    assert refused.value.status == 503 and 3 <= refused.value.retry_after <= 6  # spread
    assert executor.closed == [1]


async def test_a_failure_after_the_first_token_is_an_error_event():
    executor = FakeExecutor()
    failure = ItemFailure(FailureKind.INTERNAL, "the model failed on this input")
    scheduler = FakeScheduler(executor, [" a", " b"], failure)
    events = await collect(await open_stream(scheduler, executor))
    assert events[0]["token"]["text"] == " a"
    # TGI's type for a model's failure: its clients raise it as GenerationError
    assert events[-1] == {"error": "the model failed on this input", "error_type": "generation"}


async def test_a_stream_ending_with_an_error_event_says_so_in_a_line_naming_its_request(caplog):
    """Its head went out as 200, which is what its access line and the request counts
    say; the client's last event is the error. A warning names the request and the error,
    and `rawserve_stream_errors_total` counts it, so an operator finds streams that
    failed once begun (a deadline, a worker's failure)."""
    executor = FakeExecutor()
    failure = ItemFailure(FailureKind.INTERNAL, "the model failed on this input")
    counted: list[int] = []
    model = ServedModel(
        "tiny-gpt",
        ModelService(FakeScheduler(executor, [" a"], failure), executor),
        count_stream_error=counted.append,
    )
    with caplog.at_level("WARNING", logger="rawserve.streams"):
        response = await open_token_stream(model, "hello", {}, 1e9, request_id="stream-9")
        events = await collect(response)
    assert response.status == 200 and events[-1]["error_type"] == "generation"
    [record] = caplog.records
    assert record.getMessage() == (
        "request stream-9: its stream ended with an error event: 500 the model failed on this input"
    )
    assert getattr(record, "request_id", None) == "stream-9"
    assert counted == [500]


async def test_an_input_the_worker_refuses_after_the_first_token_is_typed_as_tgi_types_it():
    executor = FakeExecutor()
    failure = ItemFailure(FailureKind.INPUT, "the grammar cannot go on")
    scheduler = FakeScheduler(executor, [" a"], failure)
    events = await collect(await open_stream(scheduler, executor))
    assert events[-1] == {"error": "the grammar cannot go on", "error_type": "validation"}


async def test_closing_the_stream_cancels_the_request_and_the_generation():
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"] * 1000, {"generated_text": "", "details": {}})
    response = await open_stream(scheduler, executor)
    first = await anext(response.stream)
    assert json.loads(first.removeprefix(b"data:"))["index"] == 1
    await response.stream.aclose()  # what the protocol does when the client leaves
    assert executor.closed == [1]
    await asyncio.wait_for(scheduler.cancelled.wait(), 5)


async def test_a_stream_stopped_for_tokens_left_unread_is_freed_after(monkeypatch):
    """Each stream stopped for tokens its client left unread raised one error made once
    for all: a raise adds its frames to the error's traceback, so every such stream, and
    the text sent with it, was held for the process's life (37 KiB each, by a tester)."""

    made: list[weakref.ref[TokenStream]] = []

    class Kept(TokenStream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(streaming, "TokenStream", Kept)
    for _ in range(3):
        executor = FakeExecutor()
        output = {"generated_text": "", "details": {}}
        scheduler = FakeScheduler(executor, [" a"] * 100_000, output)  # (runs on, unread)
        response = await open_stream(scheduler, executor)
        await asyncio.wait_for(scheduler.cancelled.wait(), 10)  # nothing read: stopped
        events = await collect(response)
        assert events[-1]["error_type"] == "unavailable"
        assert "tokens or more unread" in events[-1]["error"]
        del response, events
    gc.collect()
    assert len(made) == 3 and not [stream for stream in made if stream() is not None]


class KeptChunks(FakeExecutor):
    """Keeps a weak reference to every token chunk its streams are sent."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def open_stream(self, on_token):
        def kept(chunk):
            self.sent.append(weakref.ref(chunk))
            on_token(chunk)

        return super().open_stream(kept)


async def test_a_stream_closed_with_tokens_unread_frees_them_at_once():
    """Their stream's objects are caught in reference cycles (its tasks' frames, the
    CancelledError that ended them), which only the collector's full pass frees: 50
    clients that stopped reading left about 100 MB of tokens queued for that pass, which
    a server idle after the burst did not run (and which, when it came, held the event
    loop 0.4 s). The queue is emptied as the HTTP stream closes."""
    executor = KeptChunks()
    scheduler = FakeScheduler(executor, [" a"] * 50, {"generated_text": "", "details": {}})
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    stream = TokenStream(model, "hello", {"max_new_tokens": 50}, deadline=1e9)
    response = event_stream((b"data" async for _ in stream.chunks()), None, [stream])
    await asyncio.wait([stream.run])  # every token queued, none read
    assert len(executor.sent) == 50 and stream.queue.qsize() == 51  # and its end
    gc.disable()  # freed without the collector
    try:
        await _close_stream(response)  # as the protocol does, for a client gone
        assert [ref for ref in executor.sent if ref() is not None] == []
    finally:
        gc.enable()
    assert executor.closed == [1]


async def test_a_stream_closed_unread_after_its_request_failed_leaves_no_error_to_log():
    """Streams of one answer (OpenAI's `n`, a list of prompts) share a deadline: when it
    passes they all fail, the answer reads one failure and closes the rest unread. Those
    failures are the answer's, told already: asyncio must find none left unretrieved."""
    unretrieved = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context["message"]))
    executor = FakeExecutor()
    late = Refused.because(Reason.DEADLINE_PASSED, "the request's deadline passed")
    scheduler = FakeScheduler(executor, [], None, fail_first=late)
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    streams = [TokenStream(model, "hello", {"max_new_tokens": 3}, deadline=1e9) for _ in "ab"]
    await asyncio.wait([stream.run for stream in streams])
    for stream in streams:
        stream.close()
    del streams, stream
    gc.collect()
    loop.set_exception_handler(None)
    assert unretrieved == []


class RefusedApart(FakeScheduler):
    """Refuses every generation, the second `turns` loop turns after the first."""

    def __init__(self, executor, refusal, turns):
        super().__init__(executor, [], None, fail_first=refusal)
        self.turns, self.calls = turns, 0

    async def run(self, inputs, params, deadline, control):
        self.calls += 1
        for _ in range(self.turns if self.calls > 1 else 0):
            await asyncio.sleep(0)
        return await super().run(inputs, params, deadline, control)


async def test_choices_refused_as_the_first_one_starts_leave_no_error_to_log():
    """OpenAI's `n` streamed, each choice refused (the queue full): another choice's
    refusal was raised and the first choice's start cancelled just as its wait for a token
    ended (asyncio.wait_for, on 3.11, then drops the cancellation), so it ended with its own
    refusal, unread, logged by asyncio as an error with its traceback."""
    unretrieved = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context["message"]))
    busy = Refused.because(Reason.QUEUE_FULL, "server busy")
    for turns in range(4):  # (which turn the first's start ends in is the loop's doing)
        executor = FakeExecutor()
        model = ServedModel("tiny-gpt", ModelService(RefusedApart(executor, busy, turns), executor))
        streams = [TokenStream(model, "hello", {"max_new_tokens": 3}, deadline=1e9) for _ in "ab"]
        with pytest.raises(ServiceUnavailable):
            await start_choices(streams, 15.0)  # the keep-alive interval: a timed wait
        del streams
    await asyncio.sleep(0)
    gc.collect()
    loop.set_exception_handler(None)
    assert unretrieved == []


class OneRow(FakeScheduler):
    """A worker with one row: each generation sends `texts` once it holds the row."""

    def __init__(self, executor, texts, output):
        super().__init__(executor, texts, output)
        self.row = asyncio.Lock()

    async def run(self, inputs, params, deadline, control):
        async with self.row:
            return await super().run(inputs, params, deadline, control)


class StreamingWorkers(FakeExecutor):
    ready = healthy = True
    loaded = WorkerReady(1, "text-generation", "cpu", "float32", load_seconds=0)

    def load_state(self):
        return LoadState.READY, None

    def back_in(self):
        return None

    def status(self):
        return []


async def test_choices_waiting_for_a_row_do_not_make_the_first_ones_tokens_overflow():
    """OpenAI's `n` streams a choice each; with rows for fewer, the others wait for one
    while the first one's tokens come: those are read as they come, not held back (past
    STREAM_BUFFER_TOKENS unread, a stream is stopped as if its client fell behind)."""
    workers = StreamingWorkers()
    tokens = STREAM_BUFFER_TOKENS + 10
    output = {"generated_text": "", "details": {"finish_reason": "length"}}
    queue = OneRow(workers, [" a"] * tokens, output)
    models = ServedModels([ServedModel("tiny-gpt", ModelService(queue, workers))])
    document = {"prompt": "hello", "n": 2, "max_tokens": tokens, "stream": True}
    body = json.dumps(document).encode()
    request = HttpRequest(
        "POST", "/v1/completions", "", [("content-type", "application/json")], body, "id"
    )
    response = await App(models, AppSettings()).handle(request)
    assert response is not None and response.stream is not None
    chunks = [chunk async for chunk in response.stream]
    assert chunks[-1] == b"data: [DONE]\n\n"
    events = [json.loads(chunk.removeprefix(b"data:")) for chunk in chunks[:-1]]
    assert not [event for event in events if "error" in event]
    ends = [
        event["choices"][0]["index"] for event in events if event["choices"][0]["finish_reason"]
    ]
    assert sorted(ends) == [0, 1]


class RoomForOne(FakeScheduler):
    """A queue with room for one item: a second run while the first runs is refused."""

    def __init__(self, executor, texts, output):
        super().__init__(executor, texts, output)
        self.running = 0

    async def run(self, inputs, params, deadline, control):
        if self.running:
            raise Refused.because(Reason.QUEUE_FULL, "server busy: queue full", 3.0)
        self.running += 1
        try:
            return await super().run(inputs, params, deadline, control)
        finally:
            self.running -= 1


async def test_a_stream_of_several_choices_the_queue_cannot_hold_is_503_not_a_torn_stream():
    """A request is admitted whole: a choice refused at admission refuses the request
    with 503 and Retry-After (what OpenAI's clients retry), not a stream of one choice's
    tokens ending in an error event."""
    workers = StreamingWorkers()
    output = {"generated_text": " a b", "details": {"finish_reason": "length"}}
    queue = RoomForOne(workers, [" a", " b"], output)
    models = ServedModels([ServedModel("tiny-gpt", ModelService(queue, workers))])
    document = {"prompt": "hello", "n": 2, "max_tokens": 2, "stream": True}
    body = json.dumps(document).encode()
    request = HttpRequest(
        "POST", "/v1/completions", "", [("content-type", "application/json")], body, "id"
    )
    response = await App(models, AppSettings()).handle(request)
    assert response is not None and response.status == 503, response.status
    assert 3 <= int(dict(response.headers)["Retry-After"]) <= 6  # 3 s spread
    assert response.stream is None
    assert sorted(workers.closed) == [1, 2]


class Gated(OneRow):
    """A generation that starts once `gate` opens: a stream queued behind others."""

    def __init__(self, executor, texts, output, *, fail_first=None):
        super().__init__(executor, texts, output)
        self.fail_first = fail_first
        self.gate = asyncio.Event()

    async def run(self, inputs, params, deadline, control):
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return await super().run(inputs, params, deadline, control)


async def open_waiting_stream(scheduler, executor):
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    params = {"max_new_tokens": 3}
    return await open_token_stream(model, "hello", params, deadline=1e9, keepalive=0.01)


async def test_a_stream_waiting_for_its_first_token_is_sent_keep_alive_comments():
    """Proxies cut a response silent past their read timeout (nginx's 60 s by default):
    a stream waiting for its first token goes out, kept alive with SSE comments."""
    executor = FakeExecutor()
    output = {"generated_text": " a b", "details": {"finish_reason": "length"}}
    scheduler = Gated(executor, [" a", " b"], output)
    response = await open_waiting_stream(scheduler, executor)  # no token came yet
    assert await anext(response.stream) == KEEP_ALIVE
    assert await anext(response.stream) == KEEP_ALIVE
    scheduler.gate.set()
    chunks = [chunk async for chunk in response.stream]
    events = [json.loads(chunk.removeprefix(b"data:")) for chunk in chunks if chunk != KEEP_ALIVE]
    assert [event["index"] for event in events] == [1, 2]
    assert events[-1]["generated_text"] == " a b"


async def test_a_stream_that_waited_one_interval_goes_out_with_its_first_comment():
    """Its head went out alone after one interval and the first comment after a second
    one: a proxy's read timeout of 1.5 intervals cut it."""
    executor = FakeExecutor()
    scheduler = Gated(executor, [" a"], {"generated_text": " a", "details": {}})
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    loop = asyncio.get_running_loop()
    response = await open_token_stream(model, "hello", {}, deadline=1e9, keepalive=2.0)
    headed = loop.time()  # (its head goes as the response is returned)
    assert await anext(response.stream) == KEEP_ALIVE
    assert loop.time() - headed < 1.0  # with the head, not another interval later
    await response.stream.aclose()


async def test_an_error_after_keep_alive_comments_is_an_error_event():
    executor = FakeExecutor()
    full = Refused.because(Reason.QUEUE_FULL, "server busy: queue full", 3.0)
    scheduler = Gated(executor, [], None, fail_first=full)
    response = await open_waiting_stream(scheduler, executor)
    assert await anext(response.stream) == KEEP_ALIVE
    scheduler.gate.set()
    chunks = [chunk async for chunk in response.stream if chunk != KEEP_ALIVE]
    assert [json.loads(chunk.removeprefix(b"data:")) for chunk in chunks] == [
        {"error": "server busy: queue full", "error_type": "overloaded"}  # TGI's type for it
    ]
    assert executor.closed == [1]


async def test_a_client_leaving_during_keep_alive_comments_withdraws_its_request():
    executor = FakeExecutor()
    scheduler = Gated(executor, [" a"], {"generated_text": " a", "details": {}})
    response = await open_waiting_stream(scheduler, executor)
    assert await anext(response.stream) == KEEP_ALIVE
    await _close_stream(response)  # what the protocol does when the client leaves
    assert executor.closed == [1]
    await asyncio.wait_for(scheduler.cancelled.wait(), 5)


async def test_an_openai_stream_waiting_for_its_first_token_is_kept_alive():
    workers = StreamingWorkers()
    output = {"generated_text": " a", "details": {"finish_reason": "length"}}
    scheduler = Gated(workers, [" a"], output)
    models = ServedModels([ServedModel("tiny-gpt", ModelService(scheduler, workers))])
    document = {"prompt": "hello", "stream": True}
    body = json.dumps(document).encode()
    request = HttpRequest(
        "POST", "/v1/completions", "", [("content-type", "application/json")], body, "id"
    )
    response = await App(models, AppSettings(stream_keepalive=0.01)).handle(request)
    assert response is not None and response.stream is not None
    assert await anext(response.stream) == KEEP_ALIVE
    scheduler.gate.set()
    chunks = [chunk async for chunk in response.stream if chunk != KEEP_ALIVE]
    assert chunks[-1] == b"data: [DONE]\n\n"
    assert json.loads(chunks[-2].removeprefix(b"data:"))["choices"][0]["finish_reason"]


async def test_a_stream_whose_events_end_as_its_client_leaves_leaves_no_error_to_log():
    """A client that reads the last event and hangs up at once (OpenAI's SDK, at `[DONE]`):
    the events' end and the response's cancellation came in one turn of the loop, and the
    end (a StopAsyncIteration) was left unread, logged by asyncio as an error."""
    unretrieved = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context["message"]))
    for _ in range(3):  # (whichever runs first in that turn)
        await _events_end_as_the_client_leaves()
    gc.collect()
    loop.set_exception_handler(None)
    assert unretrieved == []


async def _events_end_as_the_client_leaves():
    last = asyncio.Event()

    async def events():
        yield b"data: [DONE]\n\n"
        await last.wait()

    async def respond():
        async for _ in kept_alive(events(), 60):
            pass

    responding = asyncio.ensure_future(respond())
    for _ in range(5):
        await asyncio.sleep(0)  # the last event sent; the next one awaited
    last.set()  # the events end...
    responding.cancel()  # ...as the client leaves
    await asyncio.wait({responding})


async def test_a_stream_silent_after_its_first_events_is_kept_alive_too():
    """The keep-alive timer runs on past the events that came: silence later in a
    stream (a long tool call's grammar compiling) is met the same as before its first."""
    resumed = asyncio.Event()

    async def events():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"
        await resumed.wait()
        yield b"data: 3\n\n"

    stream = kept_alive(events(), 0.01)
    assert [await anext(stream), await anext(stream)] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert await anext(stream) == KEEP_ALIVE
    assert await anext(stream) == KEEP_ALIVE
    resumed.set()
    assert [event async for event in stream if event != KEEP_ALIVE] == [b"data: 3\n\n"]


async def test_keeping_a_stream_alive_sets_no_timer_per_event(monkeypatch):
    """A stream's events come far more often than its keep-alive interval passes: one
    timer for the whole stream, not one set and cancelled for each event (with a wait
    on a set of futures, that cost a streamed token more than its JSON and its write)."""
    loop = asyncio.get_running_loop()
    timers = []

    def counted(schedule):
        def counting(*args, **kwargs):
            timers.append(args)
            return schedule(*args, **kwargs)

        return counting

    monkeypatch.setattr(loop, "call_at", counted(loop.call_at))
    monkeypatch.setattr(loop, "call_later", counted(loop.call_later))

    async def events():
        for index in range(100):
            await asyncio.sleep(0)  # each after a turn of the loop, as tokens come
            yield b"data: %d\n\n" % index

    sent = [event async for event in kept_alive(events(), 60)]
    assert sent == [b"data: %d\n\n" % index for index in range(100)]
    assert len(timers) == 1


class FailsMidway(FakeScheduler):
    """Sends its tokens, then fails as a bug in the server would (not an HTTP error)."""

    async def run(self, inputs, params, deadline, control):
        await super().run(inputs, params, deadline, control)
        raise RuntimeError("the serving process failed it")


def failing(*args, **kwargs):
    raise KeyError("details")


@pytest.mark.parametrize("where", ["serving", "last event"])
async def test_a_failure_mid_stream_ends_it_with_an_error_event(where, monkeypatch, caplog):
    """A failure that was no HTTP error cut the stream off without its last chunk: the
    client saw a broken transfer, not an error. In the serving (an HTTP process told that
    the serving process failed a request), or a bug in forming the last event (its
    generation done)."""
    from rawserve.api import streaming

    executor = FakeExecutor()
    if where == "serving":
        scheduler = FailsMidway(executor, [" a", " b"], {"generated_text": "", "details": {}})
    else:
        monkeypatch.setattr(streaming, "tgi_output", failing)
        output = {"generated_text": " a b", "details": {}}
        scheduler = FakeScheduler(executor, [" a", " b"], output)
    response = await open_stream(scheduler, executor)
    with caplog.at_level("ERROR", logger="rawserve.errors"):
        events = await collect(response)
    assert [event["token"]["text"] for event in events[:-1]] == [" a"]  # " b" held back
    assert events[-1] == {"error": "internal server error", "error_type": "generation"}
    assert "unexpected error while handling request" in caplog.text  # its traceback, logged


async def test_tgis_last_event_keeps_the_text_of_a_special_last_token():
    """An end of sequence that ends the stream comes with its own text, as TGI's does."""
    executor = FakeExecutor()
    output = {"generated_text": " a b", "details": {"finish_reason": "eos_token"}}
    scheduler = FakeScheduler(executor, [" a", " b", ("</s>", True)], output)
    events = await collect(await open_stream(scheduler, executor))
    assert events[-1]["token"]["text"] == "</s>" and events[-1]["token"]["special"]


class ListingScheduler(FakeScheduler):
    """Sends each token with its likeliest alternatives, as `top_n_tokens` asks them."""

    async def run(self, inputs, params, deadline, control):
        listener = self.executor.listeners[control.stream_id]
        for index, text in enumerate(self.texts):
            top = [{"id": index, "text": text, "logprob": -0.5, "special": False}]
            token = {**top[0], "top_tokens": top}
            listener(TokenChunk(control.stream_id, 0, token))
            await asyncio.sleep(0)
        return [ItemResult(self.output, 0.0, 1, 0.0)]


async def test_tgis_events_list_the_alternatives_beside_the_token_not_inside_it():
    """TGI's StreamResponse: `top_tokens` beside `token`, whose own fields are id, text,
    logprob and special (TGI's client parses `token` as its Token: a list in it was
    sent twice)."""
    executor = FakeExecutor()
    output = {"generated_text": " a b", "details": {"finish_reason": "length"}}
    scheduler = ListingScheduler(executor, [" a", " b"], output)
    events = await collect(await open_stream(scheduler, executor))
    assert [sorted(event["token"]) for event in events] == [
        ["id", "logprob", "special", "text"]
    ] * 2
    assert [[top["text"] for top in event["top_tokens"]] for event in events] == [[" a"], [" b"]]
