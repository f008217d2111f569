"""The ring and segment layer without an event loop: wrap-around, bounds checks, creation
(a sealed memfd) and the checks made when attaching to a peer's offer."""

from __future__ import annotations

import fcntl
import os
import random
from collections.abc import Iterator

import pytest

from aiocollect.errors import ProtocolError
from aiocollect.transport.shm_ring import (
    MIN_CAPACITY,
    SEALS,
    Ring,
    Segment,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create(MIN_CAPACITY)
    yield seg
    seg.close()


def _attach(seg: Segment) -> Segment:
    assert seg.fd is not None
    return Segment.attach(os.getpid(), seg.fd, seg.capacity, seg.token)


def test_create_attach_hand_over(segment: Segment) -> None:
    assert segment.fd is not None
    assert fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:aiocollect-")
    other = _attach(segment)
    assert other.fd is None  # the attaching side keeps only its mapping
    fd = segment.fd
    segment.handed_over()
    assert segment.fd is None
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    writer, reader = segment.rings[0], other.rings[0]
    writer.write(memoryview(b"hello"))
    assert reader.available() == 0  # not published yet
    writer.publish_head()
    assert reader.available() == 5
    out = bytearray(5)
    reader.read(memoryview(out))
    assert out == b"hello"
    other.close()
    segment.handed_over()  # idempotent


@pytest.mark.parametrize("seed", range(5))
def test_stream_through_wrap_around(segment: Segment, seed: int) -> None:
    """Random-sized writes and reads through a small ring give back the same stream."""
    rng = random.Random(seed)
    cap = segment.capacity
    data = rng.randbytes(cap * 7 + 123)
    peer = _attach(segment)
    writer, reader = segment.rings[1], peer.rings[1]
    out = bytearray()
    sent = 0
    while len(out) < len(data):
        n = min(writer.free(), rng.randint(1, cap), len(data) - sent)
        writer.write(memoryview(data)[sent : sent + n])
        sent += n
        writer.publish_head()
        avail = reader.available()
        take = rng.randint(0, avail)
        buf = bytearray(take)
        reader.read(memoryview(buf))
        reader.publish_tail()
        out += buf
        assert writer.free() == cap - (sent - len(out))
    assert out == data
    peer.close()


def test_positions_out_of_range_are_protocol_errors(segment: Segment) -> None:
    other = _attach(segment)
    writer, reader = segment.rings[0], other.rings[0]
    writer.pos = segment.capacity + 1
    writer.publish_head()
    with pytest.raises(ProtocolError, match="writer position"):
        reader.available()
    writer.pos = 0
    writer.publish_head()
    reader.pos = 10  # read past the writer
    reader.publish_tail()
    with pytest.raises(ProtocolError, match="reader position"):
        writer.free()
    other.close()


def test_attach_checks_the_offer(segment: Segment) -> None:
    assert segment.fd is not None
    pid, fd, cap, token = os.getpid(), segment.fd, segment.capacity, segment.token
    with pytest.raises(ProtocolError, match="bad shared-memory offer"):
        Segment.attach(0, fd, cap, token)
    with pytest.raises(ProtocolError, match="bad shared-memory offer"):
        Segment.attach(pid, fd, cap, b"short")
    with pytest.raises(ProtocolError, match="not a sealed"):
        Segment.attach(pid, fd, cap * 2, token)  # size does not match
    with pytest.raises(ProtocolError, match="token"):
        Segment.attach(pid, fd, cap, bytes(len(token)))
    with pytest.raises(FileNotFoundError):
        Segment.attach(pid, 1 << 30, cap, token)  # no such descriptor
    with open(__file__, "rb") as f, pytest.raises(ProtocolError, match="not a sealed"):
        Segment.attach(pid, f.fileno(), cap, token)  # a descriptor, but no memfd
    unsealed = os.memfd_create("aiocollect-unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, Segment.size_for(cap))
        with pytest.raises(ProtocolError, match="seals 0x"):
            Segment.attach(pid, unsealed, cap, token)
    finally:
        os.close(unsealed)
    assert segment.fd is not None
    os.pwrite(segment.fd, b"XXXXXXXX", 0)
    with pytest.raises(ProtocolError, match="header"):
        Segment.attach(pid, fd, cap, token)


def test_capacity_shrinks_with_many_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocollect.transport.shm_ring import DEFAULT_CAPACITY, RING_BUDGET, configured_capacity

    monkeypatch.delenv("AIOCOLLECT_SHM_RING_BYTES", raising=False)
    assert configured_capacity(2) == DEFAULT_CAPACITY
    for n in (33, 65, 1000):
        cap = configured_capacity(n)
        assert cap >= 1 << 20
        assert cap * 2 * (n - 1) <= RING_BUDGET or cap == 1 << 20
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", "1")
    assert configured_capacity(2) == MIN_CAPACITY
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(3 << 20))
    assert configured_capacity(1000) == 3 << 20


def test_spin_only_when_every_local_rank_has_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocollect.transport.shm import SPIN_SECONDS, spin_budget

    monkeypatch.delenv("AIOCOLLECT_SHM_SPIN_US", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert spin_budget(cores) == SPIN_SECONDS
    monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", "250")
    assert spin_budget(cores) == pytest.approx(250e-6)
    assert spin_budget(cores + 1) == 0.0
    monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", "0")
    assert spin_budget(1) == 0.0
    monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", "lots")
    assert spin_budget(1) == SPIN_SECONDS


def _single_checks(ring: Ring, socket_sent: int, refs_sent: int, rung: int, limit: int) -> bool:
    """The sending half's socket decision from the ring's single counters, checked one
    by one as they used to be: raises ProtocolError on implausible ones."""
    ahead = socket_sent - ring.socket_taken() if socket_sent else 0
    if not 0 <= ahead <= limit:
        raise ProtocolError("implausible")
    if ahead:
        return ahead < limit
    gen = ring.reader_sleep()
    return gen != 0 and gen != rung and ring.pulled() == refs_sent and ring.free() == ring.cap


def test_socket_turn_agrees_with_the_single_checks(segment: Segment) -> None:
    """The one-call small-frame check says what the single checks say, and never True
    where they find a counter implausible (a corrupt or hostile peer)."""
    other = _attach(segment)
    try:
        writer, reader = segment.rings[0], other.rings[0]
        rng = random.Random(7)
        limit = 8
        seen = {True: 0, False: 0, "error": 0}
        for _ in range(3000):
            writer.pos = rng.choice([0, 100, MIN_CAPACITY, 5 * MIN_CAPACITY])
            tail = writer.pos - rng.choice([0, 0, 0, 1, 40, -3, MIN_CAPACITY + 1])
            reader.pos = max(0, tail)
            reader.publish_tail()
            reader.arm_reader(rng.choice([0, 1, 2, 3]))
            refs = rng.choice([0, 2, 5])
            reader.publish_pulled(max(0, refs + rng.choice([0, 0, -1, 1])))
            socket_sent = rng.choice([0, 0, 3, 10, 20])
            taken = socket_sent - rng.choice([0, 0, 1, limit - 1, limit, 30])
            reader.publish_socket_taken(max(0, taken))
            rung = rng.choice([0, 1, 2])
            fast = writer.socket_turn(socket_sent, refs, rung, limit)
            try:
                expected = _single_checks(writer, socket_sent, refs, rung, limit)
            except ProtocolError:
                assert not fast
                seen["error"] += 1
                continue
            assert fast == expected
            seen[expected] += 1
        assert all(seen.values()), seen  # every outcome was reached
    finally:
        other.close()
