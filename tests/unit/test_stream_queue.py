"""The held-frame queue of stream links (transport/stream_queue.py), with no event loop:
order, byte and stream counts, release while allowed, flush and drop."""

from __future__ import annotations

from aiocollect.transport.stream_queue import StreamQueue
from aiocollect.transport.wire import DATA, MAGIC, P2P, Header, pack_header, stream_of


def _header(kind: int, seq: int, slot: int, length: int) -> bytes:
    return pack_header(Header(kind, 1, 0, 1, 0, 0, seq, slot, -1, length, length))


def test_stream_of_is_kind_gid_seq_and_slot() -> None:
    a = _header(DATA, 3, 4, 10)
    assert int.from_bytes(a[:2], "little") == MAGIC
    assert stream_of(a) == stream_of(_header(DATA, 3, 4, 99))  # (length and chunk aside)
    assert stream_of(a) != stream_of(_header(P2P, 3, 4, 10))
    assert stream_of(a) != stream_of(_header(DATA, 4, 4, 10))
    assert stream_of(a) != stream_of(_header(DATA, 3, 5, 10))


def test_counts_follow_push_and_release() -> None:
    q = StreamQueue()
    big, small = _header(DATA, 1, 0, 8), _header(DATA, 2, 0, 2)
    q.push(big, b"x" * 8, stream_of(big))
    q.push(small, b"yy", stream_of(small))
    q.push(big, b"z" * 8, stream_of(big))
    assert len(q.frames) == 3
    assert q.nbytes == 3 * len(big) + 18
    assert q.streams == {stream_of(big): 2, stream_of(small): 1}
    # the first frame goes, the second is refused: nothing after it goes either
    out = list(q.release(lambda n: n != 2))
    assert out == [(big, b"x" * 8)]
    assert q.nbytes == 2 * len(big) + 10
    assert q.streams == {stream_of(big): 1, stream_of(small): 1}
    out = list(q.release(lambda n: True))
    assert [p for _, p in out] == [b"yy", b"z" * 8]
    assert (len(q.frames), q.nbytes, q.streams) == (0, 0, {})


def test_a_caller_that_stops_iterating_leaves_the_rest_held() -> None:
    q = StreamQueue()
    h = _header(DATA, 1, 0, 1)
    for i in range(3):
        q.push(h, bytes([i]), stream_of(h))
    for _, payload in q.release(lambda n: True):
        assert payload == b"\x00"
        break
    assert [p for _, p, _ in q.frames] == [b"\x01", b"\x02"]
    assert q.streams == {stream_of(h): 2}


def test_take_all_and_clear_empty_it() -> None:
    q = StreamQueue()
    h = _header(P2P, 1, 7, 3)
    q.push(h, b"abc", stream_of(h))
    frames = q.frames
    assert q.take_all() == [(h, b"abc", stream_of(h))]
    assert q.frames is frames
    assert not frames
    assert (q.nbytes, q.streams) == (0, {})
    q.push(h, b"abc", stream_of(h))
    q.clear()
    assert (len(q.frames), q.nbytes, q.streams) == (0, 0, {})
