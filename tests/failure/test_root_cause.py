"""Errors that lead to the root cause: ABORT carries the aborting rank's exception, the
ExceptionGroup of run_ranks/spawn_ranks names the rank that failed first, open_group() used
without await says so."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.transport.wire import ABORT
from tests.support.targets import failure as targets
from tests.support.targets import mismatch as mismatch_targets

pytestmark = pytest.mark.timeout(60)


async def test_peers_see_what_the_aborting_rank_raised() -> None:
    with pytest.raises(ExceptionGroup) as info:
        await run_ranks(4, mismatch_targets.raise_on_rank, 2, transport="tcp", timeout=20)
    group = info.value
    assert str(group).startswith("rank 2 failed first: KeyError: 'missing'"), str(group)
    assert "4 of 4 ranks failed" in str(group)
    for failed in group.exceptions:
        cause = failed.__cause__
        if failed.rank == 2:  # type: ignore[union-attr]
            assert isinstance(cause, KeyError)
            continue
        assert isinstance(cause, ac.GroupBrokenError), repr(cause)
        assert "rank 2 raised KeyError: 'missing'" in str(cause), str(cause)
        assert "aborted the group" not in str(cause).split("raised")[0], str(cause)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_spawned_ranks_name_the_first_failure(transport: str) -> None:
    with pytest.raises(ExceptionGroup) as info:
        await spawn_ranks(
            3, mismatch_targets.raise_on_rank, 1, timeout=40, transport=transport, group_timeout=20
        )
    group = info.value
    assert str(group).startswith("rank 1 failed first: KeyError: 'missing'"), str(group)
    others = [f for f in group.exceptions if f.rank != 1]  # type: ignore[union-attr]
    assert others, str(group)
    for failed in others:
        assert "rank 1 raised KeyError: 'missing'" in str(failed), str(failed)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
@pytest.mark.parametrize("abort_follows", [True, False])
async def test_a_loss_waits_for_the_abort_read_next(transport: str, abort_follows: bool) -> None:
    """Fault injection of the order in which rank 0 learns two things (the race behind
    test_spawned_ranks_name_the_first_failure): rank 2's link is lost (a write to it
    failed after it went) before rank 1's ABORT, already sent, is read on the loop's next
    turn. The loss is blamed only after that turn, so the ABORT's cause breaks the group;
    with no ABORT the loss does, as PeerDisconnected, within two loop turns."""
    from aiocollect.engine.closing import encode_abort

    async def body(g: ac.Group) -> Any:
        if g.rank != 0:  # hears rank 0's ABORT (relaying the cause, or the loss)
            with pytest.raises((ac.GroupBrokenError, ac.PeerDisconnected)):
                await g.recv(np.zeros(1), 0, tag=1)
            return None
        fabric, loop = g._fabric, asyncio.get_running_loop()
        links = fabric.links
        fabric.on_lost(links[2], BrokenPipeError(32, "Broken pipe"))
        assert fabric.failure is None  # not yet: the next poll may explain it
        if abort_follows:
            cause = ac.GroupBrokenError("rank 1 raised KeyError: 'missing'")
            cause.raised = True  # type: ignore[attr-defined]
            payload = encode_abort(1, cause)
            loop.call_soon(fabric.on_control, links[1], ABORT, payload)
        for _ in range(3):
            await asyncio.sleep(0)
        return fabric.failure

    failure, _, _ = await run_ranks(3, body, transport=transport, timeout=20.0)
    if abort_follows:
        assert "rank 1 raised KeyError: 'missing'" in str(failure), repr(failure)
    else:
        assert isinstance(failure, ac.PeerDisconnected), repr(failure)
        assert "rank 2 disconnected" in str(failure)
        assert "Broken pipe" in str(failure)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
@pytest.mark.parametrize("timeout", [0.4, 30.0])
async def test_a_relayed_blame_waits_for_a_near_deadline(transport: str, timeout: float) -> None:
    """Fault injection of the order behind test_stalled_link_blame_is_precise: a peer's
    PeerTimeout that blames this rank arrives while this rank's own operation is still
    short of its deadline. Near it (0.4 s), the blame is held and this rank's own
    diagnosis wins: it names the peer it waits for. Far from it (30 s), the relayed blame
    breaks the group at once."""
    from aiocollect.engine.closing import encode_abort

    async def body(g: ac.Group) -> Any:
        if g.rank == 0:  # stays alive (it answers the probe), hears rank 1's ABORT
            with pytest.raises(ac.AiocollectError):
                await g.recv(np.zeros(1), 1, tag=2, timeout=60.0)
            return None
        fabric, loop = g._fabric, asyncio.get_running_loop()
        waiting = g.recv(np.zeros(1), 0, tag=1, timeout=timeout)
        blame = ac.PeerTimeout("recv on rank 0 timed out after 0.4 s: ranks [1] sent nothing", [1])
        start = loop.time()
        fabric.on_control(fabric.links[0], ABORT, encode_abort(0, blame))
        held = fabric.failure is None
        with pytest.raises(ac.PeerTimeout) as info:
            await waiting
        return held, info.value, loop.time() - start

    _, (held, err, took) = await run_ranks(2, body, transport=transport, timeout=30.0)
    if timeout < 1.0:
        assert held
        assert err.ranks == [0], err  # its own verdict: it waits for rank 0
        assert "on rank 1 timed out" in str(err), err
        assert took >= 0.3, took
    else:
        assert not held
        assert err.ranks == [1], err  # the relayed one, at once
        assert took < 5.0, took


@pytest.mark.parametrize("uvloop", [False, True])
async def test_a_same_host_loss_is_blamed_once_the_process_has_exited(uvloop: bool) -> None:
    """A peer's connection that ends unexplained (no GOODBYE, no ABORT) is blamed once
    that peer's process on this host has exited: the kernel closes an exiting process's
    sockets before it tells the parent, and a launcher that saw the survivor's failure
    first named the wrong rank. Rank 1 ends its connection and lives 0.1 s more: rank 0's
    PeerDisconnected comes after that, not at once. (0.1 s, well under the wait's bound
    ``PEER_EXIT_WAIT``: a loaded machine may wake rank 1 late from its sleep, and a bound
    reached first would blame it before it exits.)"""
    (err, failed_at), (_, ended_at) = await spawn_ranks(
        2, targets.close_links_then_linger, 0.1, timeout=40, transport="auto", uvloop=uvloop
    )
    assert err == "PeerDisconnected"
    assert failed_at >= ended_at, failed_at - ended_at


@pytest.mark.parametrize("uvloop", [False, True])
async def test_a_same_host_peer_that_lives_on_is_blamed_within_the_bound(uvloop: bool) -> None:
    """The wait for the peer's exit is bounded (``PEER_EXIT_WAIT``): a peer that ends its
    connections and lives on 5 s is blamed after about half a second, not after 5 s."""
    from aiocollect.engine.liveness import PEER_EXIT_WAIT

    (err, failed_at), (_, ended_at) = await spawn_ranks(
        2, targets.close_links_then_linger, 5.0, timeout=40, transport="auto", uvloop=uvloop
    )
    assert err == "PeerDisconnected"
    assert ended_at - failed_at > 5.0 - PEER_EXIT_WAIT - 2.0, (ended_at, failed_at)


async def test_open_group_without_await_says_so() -> None:
    opener = ac.open_group(0, 1, store="memory://no-await", name="no-await")
    with pytest.raises(AttributeError, match="await open_group"):
        opener.allreduce(np.ones(1))
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        opener.nonsense  # noqa: B018
    group = await opener
    await group.aclose()


WS_SCRIPT = """
import asyncio, sys
import aiocollect as ac

async def main() -> None:
    print("up", flush=True)
    try:
        g = await ac.open_group(int(sys.argv[1]), int(sys.argv[2]), store=sys.argv[3],
                                name="ws", timeout=30)
        await g.aclose()
        print("ok")
    except Exception as exc:
        print(type(exc).__name__, exc)

asyncio.run(main())
"""


@pytest.mark.one_loop  # waits out a timeout; nothing loop-specific
@pytest.mark.parametrize(
    "sizes",
    [[4, 4, 4, 5], [5, 4, 4, 4], [3, 4, 4, 4]],
    ids=["last-says-5", "first-says-5", "first-says-3"],
)
async def test_world_size_mismatch_is_a_rendezvous_error_on_every_rank(sizes: list[int]) -> None:
    """One process of four was started with another world size: every rank gets
    RendezvousError naming the disagreement, promptly (not StoreError when rank 0, which
    hosts the store, gives up first; not a timeout waiting for a rank that never comes)."""
    import asyncio
    import sys
    import time

    from aiocollect.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    odd = next(r for r, ws in enumerate(sizes) if sizes.count(ws) == 1)
    procs: dict[int, asyncio.subprocess.Process] = {}

    async def start(rank: int) -> None:
        procs[rank] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WS_SCRIPT,
            str(rank),
            str(sizes[rank]),
            url,
            stdout=asyncio.subprocess.PIPE,
        )
        assert procs[rank].stdout is not None
        assert await procs[rank].stdout.readline() == b"up\n"  # type: ignore[union-attr]

    # the odd rank comes last (a rank arriving after rank 0 gave up waits for a new job,
    # as after a restart: that race is not what this test is about)
    await asyncio.gather(*(start(r) for r in range(len(sizes)) if r != odd))
    await start(odd)
    started = time.monotonic()  # every rank is up (interpreters start slowly on a busy host)
    try:
        outs = [
            (await asyncio.wait_for(procs[r].communicate(), 40))[0].decode()
            for r in range(len(sizes))
        ]
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.kill()
                await p.wait()
    elapsed = time.monotonic() - started
    for rank, out in enumerate(outs):
        # RendezvousTimeout is a RendezvousError: a rank that came after rank 0 gave up
        # finds the job ended, and the message says why
        assert out.startswith(("RendezvousError", "RendezvousTimeout")), (rank, out)
        assert "world_size=" in out, (rank, out)
    assert elapsed < 20, elapsed


async def test_pending_handle_collected_with_its_group_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A small allreduce called on one rank only, never awaited, its groups dropped: when
    the garbage is collected, the pending handle warns (as asyncio does for a Task)."""
    import asyncio
    import gc

    name = "dropped-handle"
    groups = await asyncio.gather(
        *(ac.open_group(r, 2, store=f"memory://{name}", name=name, timeout=None) for r in range(2))
    )
    groups[0].allreduce(np.ones(2, np.float32))  # rank 1 never calls it
    for _ in range(3):  # its first step runs, its frame is delivered: it waits for rank 1
        await asyncio.sleep(0)
    del groups
    with caplog.at_level("WARNING", logger="aiocollect"):
        gc.collect()
    assert any(
        "garbage-collected while pending" in r.getMessage()
        and "allreduce (op #0)" in r.getMessage()
        for r in caplog.records
    ), caplog.text
