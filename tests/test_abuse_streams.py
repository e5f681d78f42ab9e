"""A streamed generation whose client does not read: its buffered tokens stay bounded,
and the generation is stopped instead of occupying the worker for nobody."""

from __future__ import annotations

import asyncio
import json

from rawserve.streaming import TokenStreams
from tests.test_streaming import FakeExecutor, FakeScheduler, parsed

TOKENS = 100_000  # far more than any bound on what a stream may hold unread


async def test_a_stream_that_is_not_read_is_stopped_with_its_buffer_bounded():
    executor = FakeExecutor()
    scheduler = FakeScheduler(executor, [" a"] * TOKENS, {"generated_text": "", "details": {}})
    response = await TokenStreams(scheduler, executor).open(parsed(), deadline=1e9)
    # The client reads nothing while the worker keeps generating.
    await asyncio.wait_for(scheduler.cancelled.wait(), 10)
    assert executor.closed == [1]
    events = [json.loads(chunk.removeprefix(b"data:")) async for chunk in response.stream]
    assert len(events) < TOKENS / 10
    assert events[-1]["error_type"] == "unavailable"
