"""The pull queue of a shared-memory reader: reference records taken out of the ring, whose
payloads are copied straight out of the writer's memory, in order, a step at a time.

Reference records are taken out of the ring as they come (the pulls queue up here), so a
small frame behind them is read at once instead of after their pulls, unless it belongs to
the stream ``(kind, gid, seq, slot)`` of a queued pull: frames of one stream land in
order, so the ring then waits for that stream's pulls (:attr:`PullQueue.streams`). The
reader (:class:`~aiocollect.transport.shm_reader.RingReader`) decides when a pull may
begin and where its payload goes; this queue keeps the order, copies the bytes
(:func:`aiocollect.transport.cma.pull`) and counts the pulls done, which the reader
publishes in the ring for the writer.
"""

from __future__ import annotations

from collections import deque

from aiocollect.transport import cma
from aiocollect.transport.base import Aside
from aiocollect.transport.wire import Header

#: Most bytes pulled out of the peer's memory in one go; a larger payload is pulled in
#: steps, and every step (and every pulled frame) ends with a turn of the event loop, so
#: that the operation waiting for the frame reduces it and sends on before the next pull.
PULL_STEP = 1024 * 1024

#: A stream's key: the ``(kind, gid, seq, slot)`` of a frame.
Stream = tuple[int, ...]


class PullQueue:
    """Reference records to pull, in order, and the pull under way.

    Attributes (read-only for the reader):
        pending: records not begun: header, address in the writer, stream.
        current: the pull under way (where its payload goes, its token from
            ``Link._begin_aside``, its address and stream), or None.
        got: bytes of the current pull copied so far.
        streams: streams with pending or underway pulls, and how many each (a dict the
            reader may keep bound to test on its per-frame path).
        pulled: pulls ever completed (what the ring's ``pulled`` counter says).
        peer_pid: the process whose memory the records point into.
    """

    __slots__ = ("current", "got", "peer_pid", "pending", "pulled", "streams")

    def __init__(self) -> None:
        self.pending: deque[tuple[Header, int, Stream]] = deque()
        self.current: tuple[memoryview, Aside, int, Stream] | None = None
        self.got = 0
        self.streams: dict[Stream, int] = {}
        self.pulled = 0
        self.peer_pid = 0

    def add(self, h: Header, addr: int, stream: Stream) -> None:
        """Queue the record of frame ``h`` whose payload lies at ``addr``."""
        self.pending.append((h, addr, stream))
        self.streams[stream] = self.streams.get(stream, 0) + 1

    def begin(self, begun: tuple[memoryview, Aside] | None) -> bool:
        """Take the next pending record and begin its pull into ``begun``'s memory (the
        reader's ``_begin_aside`` for its header); None: refused (nothing to copy, the
        pull counts as done at once). Returns whether a pull is under way now."""
        h, addr, stream = self.pending.popleft()
        del h
        if begun is None:
            self._done(stream)
            return False
        self.current = (begun[0], begun[1], addr, stream)
        self.got = 0
        return True

    def copy(self, limit: int) -> Aside | None:
        """Copy up to ``limit`` more bytes of the current pull. Returns its token once the
        payload is complete (the pull then counts as done), else None.

        Raises:
            ProcessLookupError: the writer's process is gone.
            OSError: the range is not the writer's memory.
        """
        cur = self.current
        assert cur is not None
        dest, token, addr, stream = cur
        got = self.got
        n = min(limit, len(dest) - got)
        cma.pull(self.peer_pid, dest[got : got + n], addr + got)
        self.got = got = got + n
        if got < len(dest):
            return None
        self.current = None
        self.got = 0
        self._done(stream)
        return token

    def _done(self, stream: Stream) -> None:
        """A pull of ``stream`` is over: count it, and let that stream's frames on."""
        left = self.streams.get(stream, 1) - 1
        if left:
            self.streams[stream] = left
        else:
            self.streams.pop(stream, None)
        self.pulled += 1

    def clear(self) -> None:
        """Forget every pull (the link is failing: its receives fail with it)."""
        self.pending.clear()
        self.streams.clear()
        self.current = None
