"""A small operation ends once its own frame has left user memory, not once the whole
link has drained: with another operation's bulk frames still unread or
unpulled on the same link, a 1 KiB send and a one-frame broadcast complete (before, each
waited for the bulk operation's last pull; docs/benchmarks.md, *Head-of-line blocking*,
"Over shared memory, second round"). Real processes, ``shm``, ``auto`` and ``tcp``,
asyncio and uvloop; the peer is made to fall behind by construction (it reads nothing
from its ring or socket until the sender is done), so nothing depends on timing."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import spawn_ranks

pytestmark = pytest.mark.timeout(120)

BULK = 16 * 1024 * 1024  # bytes of the allreduce: several 1 MiB frames, under the ring
#: Over TCP: more than the kernel's socket buffers take (4 MiB a side, doubled), so that
#: the rest stays queued in user space
TCP_BULK = 64 * 1024 * 1024
#: The bulk operation: the ring, whose chunks are the bulk frames on the link (the default
#: over shared memory with pulls from 1 MiB, the pull allreduce, sends none: it reads)
RING = "ring"


async def small_ops_ahead_of_bulk(g: ac.Group, bulk_bytes: int = BULK) -> dict[str, Any]:
    """Rank 1 stops reading its ring; rank 0 starts a 16 MiB allreduce (its frames then
    stay unread or unpulled), sends 1 KiB to rank 1 and broadcasts 4 bytes, and reports
    the bulk bytes outstanding on the link when each of those ended. Then rank 1 reads
    on, takes part, and every result is checked."""
    link: Any = g._fabric.links[1 - g.rank]
    shm = getattr(link, "shm", False)
    data = np.full(bulk_bytes // 4, g.rank + 1, dtype=np.float32)
    msg = np.full(256, 1.5, dtype=np.float32)
    small = np.full(1, 7.0 if g.rank == 0 else 0.0, dtype=np.float32)
    await g.barrier()
    if g.rank == 1:
        if shm:
            link._rx_paused = True  # the staging cap's pause: frames stay in the ring
        else:
            link.transport.pause_reading()  # frames stay in the kernel, then in user space
        await g.store.set("hol-shm/paused", b"1")
        await g.store.wait(["hol-shm/sent"], timeout=60)
        if shm:
            link._staging_relieved()  # reads on (the loop's next turn)
        else:
            link.transport.resume_reading()
        bulk = asyncio.ensure_future(g.allreduce(data, algorithm=RING))
        await g.broadcast(small, root=0)
        got = np.empty_like(msg)
        await g.recv(got, 0, tag=5)
        await bulk
        assert np.all(got == 1.5)
        assert np.all(small == 7.0)
        assert np.all(data == 3.0)
        return {}
    await g.store.wait(["hol-shm/paused"], timeout=60)
    bulk = asyncio.ensure_future(g.allreduce(data, algorithm=RING))
    for _ in range(1000):  # the allreduce's first frames go out within a few loop turns
        if link.write_buffer_size():
            break
        await asyncio.sleep(0)
    ahead = link.write_buffer_size()
    await asyncio.wait_for(g.send(msg, 1, tag=5), 30)
    after_send = link.write_buffer_size()
    await asyncio.wait_for(g.broadcast(small, root=0), 30)
    after_broadcast = link.write_buffer_size()
    bulk_done = bulk.done()
    await g.store.set("hol-shm/sent", b"1")
    await bulk
    assert np.all(data == 3.0)
    return {
        "ahead": ahead,
        "after_send": after_send,
        "after_broadcast": after_broadcast,
        "bulk_done": bulk_done,
    }


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize(
    ("transport", "env"),
    [
        ("shm", {}),
        ("auto", {}),
        # ring copies only, the bulk cap on: the allreduce's frames beyond the cap are
        # held back in the link, and the small frames go into the ring ahead of them
        ("shm", {"AIOCOLLECT_SHM_PULL": "0", "AIOCOLLECT_SHM_BULK_CAP": str(1 << 20)}),
        # the allreduce's frames queued in the link's bulk queue: the small frames were
        # copied (joined to their headers) and go ahead of them
        ("tcp", {}),
    ],
    ids=["shm", "auto", "shm-copies-capped", "tcp"],
)
async def test_small_operations_end_while_bulk_frames_are_outstanding(
    transport: str, env: dict[str, str], uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bulk = TCP_BULK if transport == "tcp" else BULK
    res = await spawn_ranks(
        2, small_ops_ahead_of_bulk, bulk, timeout=100, transport=transport, uvloop=uvloop
    )
    r = res[0]
    assert r["ahead"] > 0, r  # the allreduce's frames were queued or referenced
    # both ended with the allreduce's bytes still unread or unpulled: their own frames
    # were in the ring, and nothing else was waited for
    assert r["after_send"] > 0, r
    assert r["after_broadcast"] > 0, r
    assert not r["bulk_done"], r
