"""A rank that reaches the store only after rank 0 gave up on a world-size mismatch gets
``RendezvousError`` saying why, not ``StoreError`` when rank 0's embedded store goes away
under it. Real rank processes, rank 0 hosting the store."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from aiocollect.errors import StoreError
from aiocollect.store import TCPStore
from aiocollect.testing import free_port
from tests.support.procs import reap

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import asyncio, sys
import aiocollect as ac
import aiocollect.api

aiocollect.api.FAILED_STORE_LINGER = 2.0  # (5 s) a shorter test

async def main() -> None:
    print("up", flush=True)
    sys.stdin.readline()  # started: go on when told (rank 3: once rank 0 gave up)
    try:
        g = await ac.open_group(int(sys.argv[1]), int(sys.argv[2]), store=sys.argv[3],
                                name="late", timeout=30)
        await g.aclose()
        print("ok")
    except Exception as exc:
        print(type(exc).__name__, exc)

asyncio.run(main())
"""


async def _start(rank: int, world: int, url: str, go: bool = True) -> asyncio.subprocess.Process:
    """A rank process, its imports done ("up"); ``go``: told to begin (else :func:`_go`)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SCRIPT,
        str(rank),
        str(world),
        url,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"up\n"
    if go:
        await _go(proc)
    return proc


async def _go(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()


async def _output(proc: asyncio.subprocess.Process, timeout: float) -> str:
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    return out.decode().strip()


@pytest.mark.one_loop  # real processes; nothing loop-specific
async def test_rank_arriving_after_rank_0_gave_up_gets_rendezvous_error() -> None:
    """Rank 0 says world size 3, ranks 1-3 say 4; rank 3 starts only once rank 0 has
    ended the job (``done`` is in the store; its process is up before, waiting to be told)
    while rank 0's store still lingers (this test
    keeps a connection open, so the linger lasts its full time, 2 s here). Rank 3 waits for a new
    job on that store, as after a restart; when the store closes it used to get
    ``StoreError: connection ... lost``, and now ``RendezvousError`` quoting why the
    store's own host ended the job (the world sizes), when the linger ends, well before
    its own 30 s timeout."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    procs = [await _start(0, 3, url)]
    watcher = TCPStore("127.0.0.1", port, timeout=20)
    gave_up: asyncio.Future[None] | None = None
    try:
        for _ in range(200):  # rank 0 binds the store a moment after it printed "up"
            try:
                await watcher.connect(timeout=5)
                break
            except StoreError:  # not listening yet
                watcher = TCPStore("127.0.0.1", port, timeout=20)
                await asyncio.sleep(0.05)
        # Every other rank's process starts (imports done) before any of them reaches the
        # store: a start-up takes 1-3 s on a loaded machine, longer than the store's 2 s
        # linger, so none may fall between rank 0 giving up and rank 3 arriving. The wait
        # for rank 0's end is asked before ranks 1 and 2 begin, so its answer comes while
        # the store is still up.
        procs += [await _start(r, 4, url, go=False) for r in (1, 2, 3)]
        gave_up = asyncio.ensure_future(watcher.wait(["aiocollect/late/done/0"], timeout=20))
        await asyncio.sleep(0)  # the wait request is written before ranks 1 and 2 begin
        for proc in procs[1:3]:
            await _go(proc)
        await gave_up  # rank 0 gave up
        assert procs[0].returncode is None  # still lingering: our connection holds it
        started = time.monotonic()
        await _go(procs[3])
        late = await _output(procs[3], 20)
        took = time.monotonic() - started
        await watcher.close()
        outs = [await _output(p, 20) for p in procs[:3]]
    finally:
        if gave_up is not None and not gave_up.done():
            gave_up.cancel()
        await watcher.close()
        await reap(procs)
    for rank, out in enumerate(outs):
        assert out.startswith(("RendezvousError", "RendezvousTimeout")), (rank, out)
    assert late.startswith("RendezvousError"), late
    assert "world_size=" in late, late
    assert "which hosted the store, ended its job before this rank arrived" in late, late
    assert took < 10, f"rank 3 took {took:.1f} s (the store lingers 2 s)"
