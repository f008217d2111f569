"""The ring and segment layer without an event loop: wrap-around, bounds checks, creation,
attachment checks, unlinking and the reaping of segments left by dead processes."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from aiocollect.errors import ProtocolError
from aiocollect.transport.shm_ring import (
    MIN_CAPACITY,
    SEGMENT_DIR,
    Segment,
    reap_stale,
    segment_pid,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create(MIN_CAPACITY)
    yield seg
    seg.close()


def test_create_attach_unlink(segment: Segment) -> None:
    assert os.path.exists(segment.path)
    assert os.stat(segment.path).st_mode & 0o777 == 0o600
    other = Segment.attach(segment.name, segment.capacity)
    other.unlink()
    assert not os.path.exists(segment.path)
    writer, reader = segment.rings[0], other.rings[0]
    writer.write(memoryview(b"hello"))
    assert reader.available() == 0  # not published yet
    writer.publish_head()
    assert reader.available() == 5
    out = bytearray(5)
    reader.read(memoryview(out))
    assert out == b"hello"
    other.close()
    segment.unlink()  # idempotent


@pytest.mark.parametrize("seed", range(5))
def test_stream_through_wrap_around(segment: Segment, seed: int) -> None:
    """Random-sized writes and reads through a small ring give back the same stream."""
    rng = random.Random(seed)
    cap = segment.capacity
    data = rng.randbytes(cap * 7 + 123)
    writer, reader = segment.rings[1], Segment.attach(segment.name, cap).rings[1]
    out = bytearray()
    sent = 0
    while len(out) < len(data):
        n = min(writer.free(), rng.randint(1, cap), len(data) - sent)
        writer.write(memoryview(data)[sent:sent + n])
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


def test_positions_out_of_range_are_protocol_errors(segment: Segment) -> None:
    other = Segment.attach(segment.name, segment.capacity)
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
    with pytest.raises(ProtocolError):
        Segment.attach("../etc/passwd", segment.capacity)
    with pytest.raises(ProtocolError):
        Segment.attach("not-ours", segment.capacity)
    with pytest.raises(ProtocolError):
        Segment.attach(segment.name, segment.capacity * 2)  # size does not match
    with pytest.raises(FileNotFoundError):
        Segment.attach(segment.name + "0", segment.capacity)
    with open(segment.path, "r+b") as f:
        f.write(b"XXXXXXXX")
    with pytest.raises(ProtocolError, match="header"):
        Segment.attach(segment.name, segment.capacity)


def test_reap_removes_only_old_segments_of_dead_processes() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        "old-dead": f"aiocollect-{dead.pid}-{os.urandom(4).hex()}",
        "young-dead": f"aiocollect-{dead.pid}-{os.urandom(4).hex()}",
        "old-alive": f"aiocollect-{os.getpid()}-{os.urandom(4).hex()}",
    }
    for label, name in names.items():
        path = os.path.join(SEGMENT_DIR, name)
        with open(path, "wb"):
            pass
        if label.startswith("old"):
            old = time.time() - 3600
            os.utime(path, (old, old))
    try:
        removed = reap_stale()
        assert names["old-dead"] in removed
        assert names["young-dead"] not in removed and names["old-alive"] not in removed
    finally:
        for name in names.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SEGMENT_DIR, name))


def test_segment_pid() -> None:
    assert segment_pid("aiocollect-123-abcd") == 123
    assert segment_pid("aiocollect-x-abcd") is None
    assert segment_pid("other-123-abcd") is None


def test_capacity_shrinks_with_many_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocollect.transport.shm_ring import DEFAULT_CAPACITY, RING_BUDGET, configured_capacity

    monkeypatch.delenv("AIOCOLLECT_SHM_RING_BYTES", raising=False)
    assert configured_capacity(2) == DEFAULT_CAPACITY
    for n in (33, 65, 1000):
        cap = configured_capacity(n)
        assert cap >= 1 << 20 and (cap * 2 * (n - 1) <= RING_BUDGET or cap == 1 << 20)
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
