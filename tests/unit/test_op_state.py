"""What an operation reports about itself when it is cancelled or times out (no I/O: the
receive futures are set by hand)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aiocollect.engine.fabric import Fabric
from aiocollect.engine.op import Op
from aiocollect.transport.wire import DATA


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()  # only to make futures; never run
    yield loop
    loop.close()


def _op(loop: asyncio.AbstractEventLoop, states: list[str]) -> Op:
    """An op of rank 0 in a 4-rank group with one posted receive per peer 1.., in the
    given states: pending, landed, failed or cancelled."""
    op = Op(Fabric(0, 4, 64), 0, 0, (1, 1, 1, 0, -1), [0, 1, 2, 3], 0, 64, DATA)
    for peer, state in enumerate(states, start=1):
        fut: asyncio.Future[None] = loop.create_future()
        if state == "landed":
            fut.set_result(None)
        elif state == "failed":
            fut.set_exception(ConnectionError())
            fut.exception()  # retrieved
        elif state == "cancelled":
            fut.cancel()
        op.pending.append((peer, (DATA, 0, 0, 0, 0), fut))  # type: ignore[arg-type]
    return op


@pytest.mark.parametrize(
    ("states", "moved"),
    [
        (["pending", "pending"], False),
        (["cancelled", "pending"], False),  # the receive a cancelled task was awaiting
        (["failed", "pending"], False),
        (["landed", "pending"], True),
        (["cancelled", "landed"], True),
    ],
)
def test_moved_data_counts_only_landed_receives(
    loop: asyncio.AbstractEventLoop, states: list[str], moved: bool
) -> None:
    assert _op(loop, states).moved_data() is moved


def test_silent_peers_include_the_receive_the_timeout_cancelled(
    loop: asyncio.AbstractEventLoop,
) -> None:
    op = _op(loop, ["landed", "cancelled", "pending"])
    assert op.silent_peers() == [2, 3]
