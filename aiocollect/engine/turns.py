"""Giving the event loop back between the pieces of long local work.

A collective that copies or reduces a large buffer does it in pieces (about a
millisecond each) so that the loop stays responsive. How it yields between pieces
decides who runs next. ``await asyncio.sleep(0)`` puts the collective's next step at
the end of the loop's ready queue *before* the loop polls for I/O, so the callbacks
that I/O brings (a small frame that landed, the task it wakes) queue behind that step,
and the next piece runs first: a reply to a small message waited a whole piece on each
side (0.2-0.6 ms per hop during 64 MiB allreduces, against 0.08-0.11 ms with
:func:`give_way`: ``python -m aiocollect.bench.hol -n 2 --size 64M``; docs/design.md, *Long
local work gives the loop way*).

:func:`give_way` resumes the caller two loop turns later instead: everything the next
poll delivers, and the tasks it wakes, run before the next piece. It costs one more
loop turn per piece (a few microseconds against a piece of about a millisecond).
"""

from __future__ import annotations

import asyncio


def give_way() -> asyncio.Future[None]:
    """A future that completes two turns of the running loop from now: awaiting it lets
    the I/O of the next poll, and whatever that wakes, run before the caller goes on.
    Usable on any event loop (asyncio's or uvloop's).

    Raises:
        RuntimeError: no event loop is running in this thread.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    loop.call_soon(loop.call_soon, _resolve, fut)
    return fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # (the awaiting task may have been cancelled meanwhile)
        fut.set_result(None)
