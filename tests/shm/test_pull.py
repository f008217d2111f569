"""Single-copy pulls on shared-memory links: payloads sent by reference and copied straight
out of the sender's memory with process_vm_readv (aiocollect.transport.cma).

Real processes and real process_vm_readv throughout; the only fakes are fault injections
(a probe that fails, a sender that announces a bad address or length)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.transport import cma, shm_reader, shm_setup
from aiocollect.transport.shm import ShmLink
from tests.support.shm_leaks import leaked, segments
from tests.support.targets import shm as targets

if cma.threshold() == 0 and os.environ.get(cma.ENV) is None:  # pragma: no cover
    pytest.skip("process_vm_readv is not available on this platform", allow_module_level=True)

_HOLDER = r"""
import ctypes, sys
data = bytes(range(256)) * 4096
addr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
print(addr, flush=True)
sys.stdin.readline()
"""


def _holder() -> tuple[subprocess.Popen[str], int]:
    """A child process holding 1 MiB of known bytes; returns it and their address."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


@pytest.mark.timeout(30)
def test_pull_copies_another_process_memory() -> None:
    proc, addr = _holder()
    try:
        want = bytes(range(256)) * 4096
        got = bytearray(len(want))
        cma.pull(proc.pid, memoryview(got), addr)
        assert bytes(got) == want
        part = bytearray(1000)
        cma.pull(proc.pid, memoryview(part), addr + 300)
        assert bytes(part) == want[300:1300]
        assert cma.probe(proc.pid, addr, want[:24]) is None
        assert "does not hold" in (cma.probe(proc.pid, addr, b"x" * 24) or "")
        with pytest.raises(OSError, match=r"Bad address|does not map"):  # page 0: unmapped
            cma.pull(proc.pid, memoryview(bytearray(16)), 8)
    finally:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    with pytest.raises(ProcessLookupError):
        cma.pull(proc.pid, memoryview(bytearray(16)), addr)
    assert "failed" in (cma.probe(proc.pid, addr, b"x" * 16) or "")


@pytest.mark.timeout(10)
def test_threshold_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cma.ENV, raising=False)
    assert cma.threshold() == cma.PULL_MIN
    for raw, want in [("0", 0), ("off", 0), ("65536", 65536), ("junk", cma.PULL_MIN)]:
        monkeypatch.setenv(cma.ENV, raw)
        assert cma.threshold() == want
    monkeypatch.setenv(cma.ENV, "0")
    assert not cma.enabled()
    assert "off" in (cma.probe(os.getpid(), 1, b"x") or "")


@pytest.mark.timeout(10)
def test_address_of_read_only_and_writable_buffers() -> None:
    arr = np.arange(10, dtype=np.int64)
    assert cma.address(memoryview(arr).cast("B")) == arr.ctypes.data  # type: ignore[arg-type]
    data = b"immutable bytes"
    view = bytearray(len(data))
    cma.pull(os.getpid(), memoryview(view), cma.address(data))
    assert bytes(view) == data


async def _allreduce_counting(g: ac.Group, count: int, rounds: int) -> dict[str, Any]:
    """Large allreduces and a large send/recv, checked exactly; returns how many frames each
    link sent by reference."""
    n = g.world_size
    total = n * (n + 1) // 2
    for i in range(rounds):
        buf = np.arange(count, dtype=np.float64) + (g.rank + 1) * (i + 1)
        # the ring: its chunks go by reference (the pull allreduce, the default from 1 MiB
        # where every rank pulls, reads the buffers itself: tests/shm/test_pull_allreduce.py)
        await g.allreduce(buf, algorithm="ring")
        want = n * np.arange(count, dtype=np.float64) + total * (i + 1)
        np.testing.assert_array_equal(buf, want)
    if g.rank == 0:
        msg = np.arange(count, dtype=np.int64)
        await g.send(msg, 1, tag=9)
        msg[:] = -1  # send returned: the receiver has pulled it, this changes nothing there
    elif g.rank == 1:
        out = np.empty(count, np.int64)
        await g.recv(out, 0, tag=9)
        np.testing.assert_array_equal(out, np.arange(count, dtype=np.int64))
    refs = {
        p: link.frames_by_reference
        for p, link in g._fabric.links.items()
        if isinstance(link, ShmLink)
    }
    await g.barrier()
    return {"refs": refs}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["", "0"])
async def test_processes_pull_large_frames(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two and three real processes: frames of 1 MiB go by reference unless pulls are off
    (AIOCOLLECT_SHM_PULL=0); results are exact either way and nothing is left behind."""
    if setting:
        monkeypatch.setenv(cma.ENV, setting)  # the children inherit it
    else:
        monkeypatch.delenv(cma.ENV, raising=False)
    before = segments()
    for n in (2, 3):
        job = spawn_ranks(
            n, _allreduce_counting, 3 << 19, 3, timeout=100, transport="shm", chunk_bytes=1 << 20
        )
        res = await job
        refs = [sum(r["refs"].values()) for r in res]
        if setting == "0":
            assert refs == [0] * n
        else:
            assert all(r > 0 for r in refs), refs
        assert not leaked(before, {job.pid(r) for r in range(n)})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
async def test_collectives_with_pulls_in_one_process(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every collective over pulled frames (threshold lowered to 1 KiB, 4 KiB chunks):
    the same sweep as the other transports, results checked against numpy."""
    from tests.support.collectives import allreduce_every_op, move_every_way

    monkeypatch.setenv(cma.ENV, "1024")
    dtypes = [np.dtype(np.float32), np.dtype(np.int64)]
    counts = await run_ranks(n, allreduce_every_op, dtypes, transport="shm", chunk_bytes=4096)
    assert counts[0] > 10
    await run_ranks(n, move_every_way, dtypes, transport="shm", chunk_bytes=4096)
    refs = await run_ranks(n, _allreduce_counting, 1 << 14, 1, transport="shm", chunk_bytes=4096)
    assert all(sum(r["refs"].values()) > 0 for r in refs)


@pytest.mark.timeout(60)
async def test_failed_probe_falls_back_to_ring_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose memory cannot be read (ptrace policy, say) is sent copies through the
    ring: same results, no references."""
    monkeypatch.setattr(shm_setup.cma, "probe", lambda *a: "denied by policy (injected)")  # type: ignore[attr-defined]
    res = await run_ranks(2, _allreduce_counting, 1 << 18, 2, transport="shm", chunk_bytes=1 << 20)
    assert [sum(r["refs"].values()) for r in res] == [0, 0]


async def _bad_reference(g: ac.Group, count: int) -> str:
    buf = np.ones(count, np.float32)
    try:
        await asyncio.wait_for(g.allreduce(buf, timeout=20, algorithm="ring"), 30)
    except ac.AiocollectError as exc:
        return f"{type(exc).__name__}: {exc} / {exc.__cause__!r}"
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["address", "length"])
async def test_bad_reference_closes_the_link_not_the_process(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reference record whose address is not mapped in the sender, or whose length does
    not match its frame, is a ProtocolError on that link: both ranks get an error, the
    process goes on."""
    import aiocollect.transport.shm_writer as shm_mod

    real_pack = shm_mod.REF_DESC.pack  # type: ignore[attr-defined]

    class BadDesc:
        size = shm_mod.REF_DESC.size  # type: ignore[attr-defined]

        @staticmethod
        def pack(addr: int, n: int) -> bytes:
            return real_pack(4096, n) if fault == "address" else real_pack(addr, n + 8)

    monkeypatch.setattr(shm_mod, "REF_DESC", BadDesc)
    res = await run_ranks(2, _bad_reference, 1 << 18, transport="shm", chunk_bytes=1 << 20)
    assert all(r != "no error" for r in res), res
    assert any("reference" in r for r in res), res


@pytest.mark.timeout(60)
async def test_big_frames_pull_in_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames several times PULL_STEP (8 MiB chunks) are pulled in steps with the loop
    turning between them; several operations in flight, checked exactly."""
    monkeypatch.setattr(shm_reader, "PULL_STEP", 1 << 20)
    res = await run_ranks(3, targets.big_frames, 3 << 20, transport="shm", chunk_bytes=8 << 20)
    assert res == [True] * 3


async def _small_passes_queued_pulls(g: ac.Group, count: int) -> int:
    """Rank 1 sends ``count`` int64s by reference (tag 1) and then 1 KiB (tag 2); rank 0
    receives the small message first, then the big one. Returns the bytes rank 0 had
    staged when the small message landed (0 on rank 1)."""
    if g.rank == 1:
        big = np.arange(count, dtype=np.int64)
        await asyncio.gather(g.send(big, 0, tag=1), g.send(np.full(128, 7, np.int64), 0, tag=2))
        return 0
    small = np.empty(128, np.int64)
    await g.recv(small, 1, tag=2)
    staged: int = g._fabric.links[1].early_bytes
    big = np.empty(count, np.int64)
    await g.recv(big, 1, tag=1)
    assert (small == 7).all()
    np.testing.assert_array_equal(big, np.arange(count, dtype=np.int64))
    return staged


@pytest.mark.timeout(30)
async def test_small_frame_passes_queued_pulls() -> None:
    """Head-of-line blocking: reference records are taken out of the ring ahead of their
    pulls, so a small frame behind 8 MiB of them (whose receive is not posted: each is
    staged, one pull per loop turn) is read at the next turn after it enters the ring, not
    after every pull ahead of it (a reader that pulled in ring order would show 8388608
    bytes staged here)."""
    count = 1 << 20
    res = await run_ranks(
        2, _small_passes_queued_pulls, count, transport="shm", chunk_bytes=1 << 20
    )
    assert res[1] == 0
    assert res[0] < count * 8, f"the small frame waited for all {res[0]} bytes of pulls"


async def _corrupt_pull_count(g: ac.Group, count: int) -> str:
    if g.rank == 1:  # this reader claims pulls nobody sent
        link = g._fabric.links[0]
        assert isinstance(link, ShmLink)
        link._pulls.pulled = 1 << 40  # what it publishes after its next real pull
    await g.barrier()
    return await _bad_reference(g, count)


@pytest.mark.timeout(60)
async def test_corrupt_pull_count_is_a_protocol_error() -> None:
    """A reader that reports more pulls than references were sent is a ProtocolError on
    the writer's side ("corrupt shared-memory ring"); every rank gets an error."""
    res = await run_ranks(2, _corrupt_pull_count, 1 << 18, transport="shm", chunk_bytes=1 << 20)
    assert all(r != "no error" for r in res), res
    assert any("corrupt shared-memory ring" in r for r in res), res
    # rank 1 is told who failed and why, not that rank 0 disconnected
    assert res[1].startswith("GroupBrokenError: "), res
    assert "rank 0 aborted the group: corrupt shared-memory ring" in res[1], res


@pytest.mark.timeout(30)
def test_info_reports_pulls(monkeypatch: pytest.MonkeyPatch) -> None:
    """`aiocollect info` says whether ranks will pull (real process_vm_readv on this
    process, Yama's policy read from /proc), and why not."""
    from aiocollect.cli.info import collect_info

    monkeypatch.delenv(cma.ENV, raising=False)
    line = collect_info()["transports"]["shm"]
    try:
        scope = Path(cma.YAMA).read_text().strip()
    except OSError:
        scope = "0"
    want = "on for payloads of 262144 bytes" if scope == "0" else "off between ranks"
    assert line.startswith("available (single-copy pulls"), line
    assert want in line, line
    monkeypatch.setenv(cma.ENV, "0")
    assert "pulls off (AIOCOLLECT_SHM_PULL=0" in collect_info()["transports"]["shm"]


async def _scatter_gather(g: ac.Group, count: int) -> int:
    """Ring reduce-scatter and allgather over pulled frames (they skip their up-front copies
    then: reductions out of place from the input, the own block copied while the successor
    pulls it), checked against numpy, inputs unchanged."""
    n, r = g.world_size, g.rank
    rows = [np.arange(n * count, dtype=np.float64) * (x + 1) + x for x in range(n)]
    mine = rows[r].copy()
    for op in (ac.ReduceOp.SUM, ac.ReduceOp.MAX, ac.ReduceOp.AVG):
        out = await g.reduce_scatter(mine, op=op, algorithm="ring")
        stack = np.stack(rows)
        want = {
            ac.ReduceOp.SUM: stack.sum(0),
            ac.ReduceOp.MAX: stack.max(0),
            ac.ReduceOp.AVG: stack.mean(0),
        }[op][r * count : (r + 1) * count]
        np.testing.assert_allclose(out, want, rtol=1e-12)
        np.testing.assert_array_equal(mine, rows[r])  # the input is only read
    send = rows[r][:count].copy()
    gathered = await g.allgather(send, algorithm="ring")
    np.testing.assert_array_equal(gathered, np.stack([x[:count] for x in rows]))
    np.testing.assert_array_equal(send, rows[r][:count])
    return sum(
        link.frames_by_reference for link in g._fabric.links.values() if isinstance(link, ShmLink)
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_ring_reduce_scatter_and_allgather_over_pulls(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cma.ENV, "4096")
    refs = await run_ranks(n, _scatter_gather, 5000 + 3, transport="shm", chunk_bytes=16384)
    assert all(r > 0 for r in refs), refs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("uvloop", [False, True])
async def test_corrupt_pull_count_in_processes_peer_hears_who_and_why(uvloop: bool) -> None:
    """Real processes: rank 1 publishes an impossible pull count; rank 0, whose outgoing
    ring it is, fails with the ProtocolError. Rank 1 is alive and must not be told that
    rank 0 disconnected: it gets GroupBrokenError naming rank 0 and the cause, from the
    ABORT that rank 0 sent on the socket (the ring it would have used is the broken one)."""
    res = await spawn_ranks(
        2,
        targets.corrupt_pull_count,
        1 << 18,
        timeout=60,
        uvloop=uvloop,
        transport="shm",
        chunk_bytes=1 << 20,
    )
    detector, peer = res
    assert detector["error"] in ("ProtocolError", "GroupBrokenError"), detector
    why = detector["message"] if detector["error"] == "ProtocolError" else detector["cause"]
    assert "corrupt shared-memory ring" in why, detector
    assert "pulls reported" in why, detector
    assert peer["error"] == "GroupBrokenError", peer
    text = peer["message"] + " / " + str(peer["cause"])
    assert "rank 0 aborted the group: corrupt shared-memory ring" in text, peer
    assert "pulls reported" in text, peer
    assert "disconnected" not in text, peer
    assert peer["abort"]["rank"] == 0, peer
    assert peer["abort"]["type"] == "ProtocolError", peer


@pytest.mark.timeout(60)
async def test_a_reference_read_as_the_spin_ends_is_pulled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader that spins (a receive waits) sees no doorbell for the frames that arrive
    meanwhile: the writer rings only a sleeping reader. When such a frame is a reference
    record that lands just after the spin's last look, the spin's end reads it out of
    the ring (then arms the flag and sleeps), and the pull must still follow. It did not:
    the record sat in the pull queue until some other event on the link (in a group, the
    mismatch check a second later), a 0.4-1.4 s stall in about one of 150-300 16 MiB
    allreduces over ``auto`` at N=2. Fault injection: the spin's looks at the ring are
    made to miss the record (it lands "just after" each one); the link, the ring and the
    pull are real."""
    from aiocollect.testing.link_suite import Recorder, frame, payload, shm_pair, within
    from aiocollect.transport.wire import DATA

    async with shm_pair(expect_pulls=True)(Recorder(), Recorder(), 8 << 20) as (a, b):
        assert isinstance(b, ShmLink)
        b.policy.spin = 0.02  # the reader spins while a receive waits
        data = payload(1 << 20, 5)
        key, header = frame(DATA, 3, data)
        buf = bytearray(len(data))
        monkeypatch.setattr(b, "_has_input", lambda rx: False)
        fut = b.post_recv(key, memoryview(buf))
        assert b._spin_until is not None, "the receive did not start the reader's spin"
        a.send(header, memoryview(data))
        assert a.frames_by_reference == 1, "the payload did not go by reference"  # type: ignore[attr-defined]
        await within("the pull after the spin's end", fut)
        assert bytes(buf) == data
        await within("the writer to see its payload pulled", a.drained())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin", [0.05, 0.0])
async def test_expect_spins_again_for_a_receive_posted_long_ago(spin: float) -> None:
    """The pull collectives post a peer's last frames when they start and wait for them a
    fold later, when the spin that the posting started has ended and the reader sleeps:
    every such frame then cost the writer a doorbell and the reader a wake-up.
    ``Link.expect`` restarts the spin (where the policy spins): the frame that follows
    comes without a doorbell and the spin finds it. With the spin off it does nothing and
    the frame goes on the socket, as the sleeping reader's doorbell would have. A real link
    pair; the spin's length is the only thing set."""
    from aiocollect.testing.link_suite import Recorder, frame, payload, shm_pair, within
    from aiocollect.transport.wire import DATA

    async with shm_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert isinstance(a, ShmLink)
        assert isinstance(b, ShmLink)
        b.policy.spin = 1e-4  # the posting's spin: over long before the frame comes
        bells = 0
        ring = a.ring_bell

        def counting() -> None:
            nonlocal bells
            bells += 1
            ring()

        a.ring_bell = counting  # type: ignore[method-assign]
        data = payload(64, 9)
        key, header = frame(DATA, 5, data)
        buf = bytearray(len(data))
        fut = b.post_recv(key, memoryview(buf))
        assert b._spin_until is not None
        await asyncio.sleep(0.02)  # (a local timer: the spin ends at its first look after it)
        assert b._spin_until is None, "the posting's spin did not end: the reader is not asleep"
        b.policy.spin = spin
        b.expect()
        assert (b._spin_until is not None) == (spin > 0)
        a.send(header, memoryview(data))
        await within("the expected frame", fut)
        assert bytes(buf) == data
        assert bells == 0
        assert a.frames_on_socket == (0 if spin > 0 else 1)
