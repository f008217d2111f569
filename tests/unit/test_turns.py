"""give_way: long local work in pieces lets what the next poll delivers run first.

Real event loops (asyncio's and uvloop's) and real I/O (a socket pair): a task works in
pieces; during its first piece a byte is written to a socket whose reader wakes a second
task. With ``give_way`` between pieces the woken task runs before the next piece (with
``asyncio.sleep(0)`` it ran after it: a reply to a small frame waited a whole piece)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import uvloop

from aiocollect.engine.turns import give_way

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


async def _scenario() -> list[str]:
    loop = asyncio.get_running_loop()
    rx, tx = socket.socketpair()
    rx.setblocking(False)
    log: list[str] = []
    woken: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        rx.recv(16)
        loop.remove_reader(rx)
        woken.set_result(None)

    async def replier() -> None:
        await woken
        log.append("reply")

    async def worker() -> None:
        for i in range(3):
            log.append(f"piece {i}")
            if i == 0:
                tx.send(b"x")  # a small frame arrives while the piece runs
            await give_way()

    loop.add_reader(rx, readable)
    try:
        await asyncio.gather(worker(), replier())
    finally:
        loop.remove_reader(rx)
        rx.close()
        tx.close()
    return log


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_what_io_wakes_runs_before_the_next_piece(name: str) -> None:
    loop = LOOPS[name]()
    try:
        log = loop.run_until_complete(_scenario())
    finally:
        loop.close()
    assert log == ["piece 0", "reply", "piece 1", "piece 2"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_cancelled_while_giving_way(name: str) -> None:
    """A task cancelled while it gives way is cancelled cleanly: the pending resolution
    finds its future done and reports nothing to the loop."""
    errors: list[dict[str, object]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))

        async def piecework() -> None:
            await give_way()

        task = asyncio.ensure_future(piecework())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3):  # let the scheduled resolution run
            await asyncio.sleep(0)

    loop = LOOPS[name]()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert errors == []
