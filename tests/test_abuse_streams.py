"""A streamed generation whose client does not read: its buffered tokens stay bounded,
and the generation is stopped instead of occupying the worker for nobody."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rawserve.api import streaming
from rawserve.api.served import ServedModel
from rawserve.api.streaming import (
    STREAM_BUFFER_TOKENS,
    UNREAD_SECONDS,
    StreamEnd,
    TokenStream,
    open_token_stream,
)
from rawserve.http.errors import GatewayTimeout
from rawserve.serving.face import ItemResult, TokenChunk
from rawserve.serving.service import ModelService
from tests.test_streaming import FakeExecutor, FakeScheduler, open_stream

TOKENS = 100_000  # far more than any bound on what a stream may hold unread


async def test_a_stream_that_is_not_read_is_stopped_with_its_buffer_bounded(caplog):
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"] * TOKENS, {"generated_text": "", "details": {}})
    response = await open_stream(scheduler, executor)
    # The client reads nothing while the worker keeps generating.
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        await asyncio.wait_for(scheduler.cancelled.wait(), 10)
        assert executor.closed == [1]
        # told as it is stopped: a client that never reads again would leave no trace
        assert told_unread(caplog) == 1
        events = [json.loads(chunk.removeprefix(b"data:")) async for chunk in response.stream]
    assert len(events) < TOKENS / 10
    assert events[-1]["error_type"] == "unavailable"
    assert told_unread(caplog) == 1  # the event its client read at last is not told twice


def told_unread(caplog) -> int:
    return sum("more unread" in record.getMessage() for record in caplog.records)


class BurstScheduler(FakeScheduler):
    """Hands the stream every token in one pass of the loop: the tokens an HTTP process
    is given at once after it was stopped for a moment (its writer had no turn)."""

    goes_on = 0.0  # seconds the generation runs on after the burst (its worker busy)

    async def run(self, inputs, params, deadline, control):
        listener = self.executor.listeners[control.stream_id]
        await asyncio.sleep(0.05)  # the stream's head goes out first, with no token yet
        for index, text in enumerate(self.texts):
            token = {"id": index, "text": text, "logprob": -0.5, "special": False}
            listener(TokenChunk(control.stream_id, 0, token))
        await asyncio.sleep(self.goes_on)
        return [ItemResult(self.output, 0.0, 1, 0.0)]


async def test_a_burst_of_tokens_for_a_client_that_reads_is_not_an_overflow(caplog):
    """Past the buffer, a stream is stopped only once its client has read nothing for a
    while: after an HTTP process was stopped for 2 s, the tokens it had missed came in
    one pass, and a client reading all along lost its stream "for leaving 1024 tokens
    unread" (a tester)."""
    burst = 3 * STREAM_BUFFER_TOKENS
    executor = FakeExecutor()
    output = {"generated_text": " a" * burst, "details": {"finish_reason": "length"}}
    scheduler = BurstScheduler(executor, [" a"] * burst, output)
    response = await open_stream(scheduler, executor)
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        events = [json.loads(chunk.removeprefix(b"data:")) async for chunk in response.stream]
    assert not told_unread(caplog) and "error" not in events[-1]
    assert len(events) == burst and events[-1]["generated_text"] == " a" * burst


async def test_a_client_reading_slower_than_a_burst_came_keeps_its_stream(caplog):
    """The same burst, its generation still running while the client reads it, a token
    a millisecond: above the buffer for 2 s, but read all along, so never "unread"."""
    burst = 3 * STREAM_BUFFER_TOKENS
    executor = FakeExecutor()
    output = {"generated_text": " a" * burst, "details": {"finish_reason": "length"}}
    scheduler = BurstScheduler(executor, [" a"] * burst, output)
    scheduler.goes_on = 2 * UNREAD_SECONDS + 0.5
    response = await open_stream(scheduler, executor)
    events = []
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        async for chunk in response.stream:
            events.append(json.loads(chunk.removeprefix(b"data:")))
            await asyncio.sleep(0.001)
    assert not told_unread(caplog) and "error" not in events[-1]
    assert len(events) == burst


class SteadyScheduler(FakeScheduler):
    """A token a millisecond, faster than its client reads them."""

    async def run(self, inputs, params, deadline, control):
        listener = self.executor.listeners[control.stream_id]
        try:
            for index, text in enumerate(self.texts):
                token = {"id": index, "text": text, "logprob": -0.5, "special": False}
                listener(TokenChunk(control.stream_id, 0, token))
                await asyncio.sleep(0.001 if index else 0.05)  # (the head goes out first)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return [ItemResult(self.output, 0.0, 1, 0.0)]


async def stalled_writer(caplog, taken_every: float | None, seconds: float) -> list[dict]:
    """Tokens coming faster than the stream's writer takes them: it takes one, then
    none for `seconds` (it waits for room in the transport), with the generation running
    on; meanwhile its client takes bytes of what was written every `taken_every` seconds
    (as its receive window opens again), or (None) none."""
    tokens = 2 * STREAM_BUFFER_TOKENS
    executor = FakeExecutor()
    output = {"generated_text": " a" * tokens, "details": {"finish_reason": "length"}}
    scheduler = SteadyScheduler(executor, [" a"] * tokens, output)
    response = await open_stream(scheduler, executor)
    taken = [0]
    response.on_stream_start(lambda: taken[0])  # as the protocol does, starting to write
    events = []

    async def client_reads() -> None:
        while taken_every is not None:
            await asyncio.sleep(taken_every)
            taken[0] += 65536

    reading = asyncio.ensure_future(client_reads())
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        async for chunk in response.stream:
            events.append(json.loads(chunk.removeprefix(b"data:")))
            if len(events) == 1:  # the writer waits for room
                await asyncio.sleep(seconds)
    reading.cancel()
    return events


@pytest.mark.parametrize("taken_every", [0.1, 2.5 * UNREAD_SECONDS])
async def test_a_client_reading_while_its_writer_waits_for_room_keeps_its_stream(
    caplog, taken_every
):
    """A client reading on, slower than the tokens came, emptied the transport's buffer
    while the stream's writer waited for room and took no chunk: its stream was stopped
    "for leaving 1024 tokens unread" (a tester: 4 of 8 runs), while a client that read
    nothing for 8 s, its burst come before, kept its own. Its bytes are seen taken only
    as its window opens again, 64 KB at a time on loopback: more than a second apart
    for a steady reader of 2 choices (another tester: 8 of 12 runs over TLS)."""
    events = await stalled_writer(caplog, taken_every, 4 * UNREAD_SECONDS)
    assert not told_unread(caplog) and "error" not in events[-1]
    assert len(events) == 2 * STREAM_BUFFER_TOKENS


async def test_a_client_taking_nothing_while_its_writer_waits_is_stopped(caplog, monkeypatch):
    monkeypatch.setattr(streaming, "CLIENT_SILENT_SECONDS", 1.5 * UNREAD_SECONDS)
    events = await stalled_writer(caplog, None, 3 * UNREAD_SECONDS)
    assert told_unread(caplog) == 1 and events[-1]["error_type"] == "unavailable"


async def test_a_client_that_stopped_reading_is_timed_from_its_last_read(monkeypatch):
    """Its silence was timed from the first look, once the buffer had filled: a client
    that stopped reading 20 s before was given the whole silence again, and met the
    write timeout first, the generation running on for nobody (a tester)."""
    monkeypatch.setattr(streaming, "CLIENT_SILENT_SECONDS", 1.5 * UNREAD_SECONDS)
    tokens = 8 * STREAM_BUFFER_TOKENS
    executor = FakeExecutor()
    scheduler = SteadyScheduler(executor, [" a"] * tokens, {"generated_text": ""})
    response = await open_stream(scheduler, executor)
    taken = [0]
    response.on_stream_start(lambda: taken[0])
    started = time.monotonic()

    async def reads_then_stops() -> None:
        for _ in range(3):
            await asyncio.sleep(0.1)
            taken[0] += 65536

    reading = asyncio.ensure_future(reads_then_stops())
    events = response.stream
    await anext(events)  # the writer takes one, then waits for room
    await asyncio.wait_for(scheduler.cancelled.wait(), 10)
    # the buffer full about 1.1 s in, looked at a second later: silent 1.8 s by then
    # (timed from that look, the silence ran out a second look and more later)
    assert time.monotonic() - started < 2 * UNREAD_SECONDS + 1.0
    await events.aclose()
    reading.cancel()


async def test_choices_that_all_overflow_are_told_once_for_their_stream(caplog):
    """A client that stops reading a stream of n choices overflows every one of them at
    once: told as each overflowed, one stream made n error lines and n counts on
    /metrics; its client sees one error event."""
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"] * TOKENS, {"generated_text": "", "details": {}})
    counted: list[int] = []
    service = ModelService(scheduler, executor)
    model = ServedModel("tiny-gpt", service, count_stream_error=counted.append)
    end = StreamEnd()
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        choices = [TokenStream(model, "hello", {}, 1e9, "r-1", end) for _ in range(4)]
        while not all(choice.overflowed for choice in choices):
            await asyncio.sleep(0.01)
    assert told_unread(caplog) == 1 and counted == [503]
    for choice in choices:
        choice.close()


class MissesItsDeadline(FakeScheduler):
    """Sends its tokens, then fails as a deadline ends a generation: a 504."""

    async def run(self, inputs, params, deadline, control):
        await super().run(inputs, params, deadline, control)
        raise GatewayTimeout("deadline passed while generating")


async def test_a_deadline_that_ends_an_unread_stream_is_told_as_it_passes(caplog):
    """Its client reads nothing: the 504 was logged and counted only once the writer
    reached its event behind the unread tokens (seconds late), and never where that
    client then left (its access line a 200, nothing on /metrics). It is told as the
    deadline ends the generation, and once, though its client reads the event later."""
    executor = FakeExecutor()
    scheduler = MissesItsDeadline(executor, [" a"] * 50, {"generated_text": "", "details": {}})
    counted: list[int] = []
    model = ServedModel(
        "tiny-gpt", ModelService(scheduler, executor), count_stream_error=counted.append
    )
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        response = await open_token_stream(model, "hello", {}, deadline=1e9)
        for _ in range(100):  # the client reads nothing meanwhile
            await asyncio.sleep(0)
        assert counted == [504]
        assert sum("error event: 504" in r.getMessage() for r in caplog.records) == 1
        events = [json.loads(chunk.removeprefix(b"data:")) async for chunk in response.stream]
    assert events[-1]["error_type"] == "timeout" and len(events) > 1  # (tokens before it)
    assert counted == [504]  # not told again as its client reads it
    assert sum("error event: 504" in r.getMessage() for r in caplog.records) == 1


class OneFastChoice(FakeScheduler):
    """The first choice's tokens come every loop turn, the others' once a second."""

    async def run(self, inputs, params, deadline, control):
        if control.stream_id != 1:
            await asyncio.sleep(1.0)  # cancelled where the fast one overflows
        return await super().run(inputs, params, deadline, control)


async def test_one_choice_that_overflows_stops_every_choice_of_its_stream(caplog):
    """The client reads all n choices from one connection: one that overflowed left the
    others generating, unread, until each overflowed in turn (0.4-0.5 s more)."""
    executor = FakeExecutor()
    scheduler = OneFastChoice(executor, [" a"] * TOKENS, {"generated_text": "", "details": {}})
    model = ServedModel("tiny-gpt", ModelService(scheduler, executor))
    end = StreamEnd()
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        choices = [TokenStream(model, "hello", {}, 1e9, "r-1", end) for _ in range(3)]
        while not choices[0].overflowed:
            await asyncio.sleep(0.01)
    assert all(choice.overflowed and choice.closed for choice in choices)
    assert sorted(executor.closed) == [1, 2, 3]  # each generation told to stop
    await asyncio.sleep(0)
    assert all(choice.run.cancelled() for choice in choices)
    assert told_unread(caplog) == 1


async def test_a_finished_generation_waits_for_a_client_that_pauses_past_the_buffer(caplog):
    """Its tokens all came while the client paused, past the buffer: once the generation
    had finished (no worker held, its tokens bounded), the pause still ended the stream
    with an error event in place of its text."""
    executor = FakeExecutor()
    tokens = STREAM_BUFFER_TOKENS + 100
    output = {"generated_text": " a" * tokens, "details": {"finish_reason": "length"}}
    scheduler = FakeScheduler(executor, [" a"] * tokens, output)
    response = await open_stream(scheduler, executor)
    with caplog.at_level("WARNING", logger="rawserve.api.streaming"):
        await asyncio.sleep(UNREAD_SECONDS + 0.5)  # the client pauses, reading nothing
        events = [json.loads(chunk.removeprefix(b"data:")) async for chunk in response.stream]
    assert not told_unread(caplog) and "error" not in events[-1]
    assert events[-1]["generated_text"] == " a" * tokens
