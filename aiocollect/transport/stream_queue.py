"""Frames a link holds back, in order, with the bytes and the streams they hold.

Both stream links hold *bulk* frames back so that small frames need not wait behind them
(head-of-line blocking): a TCP link while its transport's write buffer is full
(:mod:`aiocollect.transport.tcp`), a shared-memory link while its ring holds enough bulk
bytes (:mod:`aiocollect.transport.shm_writer`). A frame that is not bulk overtakes the held ones
unless its stream ``(kind, gid, seq, slot)`` (:func:`aiocollect.transport.wire.stream_of`)
has a frame held: then it is held behind it, since the frames of one stream keep their
order. The link decides when frames may go; this queue keeps the order and the counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

#: A held frame: its packed header, its payload (referenced, not copied) and its stream.
Held = tuple[bytes, memoryview | bytes, bytes]


class StreamQueue:
    """Frames held back, first in first out.

    ``frames`` is the queue itself (a link may keep it as an attribute to test for
    emptiness on its per-frame path without a call); ``nbytes`` the header and payload
    bytes it holds; ``streams`` how many frames each stream has in it. Only the methods
    change them.
    """

    __slots__ = ("frames", "nbytes", "streams")

    def __init__(self) -> None:
        self.frames: deque[Held] = deque()
        self.nbytes = 0
        self.streams: dict[bytes, int] = {}

    def push(self, header: bytes, payload: memoryview | bytes, stream: bytes) -> None:
        """Hold the frame ``header`` + ``payload`` of ``stream`` behind those held."""
        self.frames.append((header, payload, stream))
        self.nbytes += len(header) + len(payload)
        self.streams[stream] = self.streams.get(stream, 0) + 1

    def release(self, may_go: Callable[[int], bool]) -> Iterator[tuple[bytes, memoryview | bytes]]:
        """Take frames off the front, in order, while ``may_go(payload bytes)`` allows the
        first one: yields each frame's header and payload once it is out of the queue (a
        caller that stops iterating leaves the rest held)."""
        frames, streams = self.frames, self.streams
        while frames:
            header, payload, stream = frames[0]
            n = len(payload)
            if not may_go(n):
                return
            frames.popleft()
            self.nbytes -= len(header) + n
            left = streams[stream] - 1
            if left:
                streams[stream] = left
            else:
                del streams[stream]
            yield header, payload

    def take_all(self) -> list[Held]:
        """Every held frame, in order; the queue is empty afterwards."""
        held = list(self.frames)
        self.clear()
        return held

    def clear(self) -> None:
        """Let go of every held frame (the link ended or was reset)."""
        self.frames.clear()
        self.nbytes = 0
        self.streams.clear()
