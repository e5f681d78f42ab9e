"""The TLS handshake of one accepted connection, begun the moment it is accepted.

The listening socket is plain, so that the connection cap counts a connection from its
TCP accept (a client that never finishes its hello holds a seat, as a slow head does);
each connection's protocol then upgrades itself with `loop.start_tls`
(`rawserve.protocol.HttpProtocol`). That upgrade must take the transport before it reads
anything: uvloop starts reading a connection right after `connection_made`, whatever the
protocol paused there, so a task begun there, as usual, would see the client's hello
reach the protocol as plain bytes. `begun_now` runs a coroutine at once up to its first
wait (Python 3.12's eager tasks, on 3.11), and a task finishes it.

Server process; standard library only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def begun_now(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> asyncio.Future[T]:
    """`coro` run now up to its first wait, then on in a task (its outcome, if it waits
    for nothing)."""
    try:
        waiting = coro.send(None)
    except StopIteration as done:
        finished: asyncio.Future[T] = loop.create_future()
        finished.set_result(done.value)
        return finished
    return loop.create_task(_resumed(coro, waiting))


async def _resumed(coro: Coroutine[Any, Any, T], waiting: Any) -> T:
    return await _Resumption(coro, waiting)


class _Resumption:
    """Awaiting it goes on with `coro`, suspended while it yielded `waiting` (a future), as
    its own task would have: what the task sends or throws in is passed on."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any):
        self.coro = coro
        self.waiting = waiting

    def __await__(self) -> Generator[Any, Any, Any]:
        waiting = self.waiting
        while True:
            try:
                try:
                    sent = yield waiting
                except GeneratorExit:
                    self.coro.close()
                    raise
                except BaseException as exc:  # noqa: BLE001 - thrown in (cancelled): passed on
                    waiting = self.coro.throw(exc)
                else:
                    waiting = self.coro.send(sent)
            except StopIteration as done:
                return done.value
