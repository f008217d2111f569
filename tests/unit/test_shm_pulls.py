"""The pull queue of shared-memory readers (transport/shm_pulls.py), with no event loop:
records pulled in order and in steps, stream counts, refused pulls, failures. The
"writer" is this process (``process_vm_readv`` on itself)."""

from __future__ import annotations

import os

import pytest

from aiocollect.transport import cma
from aiocollect.transport.shm_pulls import PullQueue
from aiocollect.transport.wire import DATA, Header

pytestmark = pytest.mark.skipif(
    cma.self_check() is not None, reason=f"no process_vm_readv here: {cma.self_check()}"
)


def _header(slot: int, n: int) -> Header:
    return Header(DATA, 1, 0, 1, 0, 0, 7, slot, -1, n, n)


def _queue() -> PullQueue:
    q = PullQueue()
    q.peer_pid = os.getpid()
    return q


def test_a_record_is_pulled_in_steps_and_counted() -> None:
    src = bytes(range(256)) * 40
    keep = memoryview(src)
    q = _queue()
    q.add(_header(1, len(src)), cma.address(keep), (DATA, 1, 7, 1))
    assert q.streams == {(DATA, 1, 7, 1): 1}
    dest = memoryview(bytearray(len(src)))
    token = (_header(1, len(src)), None, None)
    assert q.begin((dest, token))
    assert not q.pending
    steps = 0
    while (done := q.copy(4096)) is None:
        steps += 1
        assert q.streams  # (its stream's frames still wait)
    assert done is token
    assert steps == len(src) // 4096
    assert bytes(dest) == src
    assert (q.current, q.got, q.streams, q.pulled) == (None, 0, {}, 1)


def test_a_refused_pull_is_over_at_once() -> None:
    q = _queue()
    q.add(_header(1, 8), 1, (DATA, 1, 7, 1))
    q.add(_header(2, 8), 2, (DATA, 1, 7, 2))
    assert not q.begin(None)
    assert (q.current, q.pulled) == (None, 1)
    assert q.streams == {(DATA, 1, 7, 2): 1}
    q.clear()
    assert (len(q.pending), q.current, q.streams) == (0, None, {})


def test_a_range_the_writer_does_not_back_raises() -> None:
    q = _queue()
    q.add(_header(1, 8), 8, (DATA, 1, 7, 1))  # (address 8: never mapped)
    q.begin((memoryview(bytearray(8)), (_header(1, 8), None, None)))
    with pytest.raises(OSError, match="Bad address"):
        q.copy(1 << 20)
    assert q.current is not None  # (unchanged: the link fails)
    assert q.got == 0
