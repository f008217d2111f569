"""Shared-memory segments and single-producer/single-consumer byte rings (no event loop).

A *segment* is one file in ``/dev/shm`` (``aiocollect-<pid>-<random>``, mode 0600) holding
two rings, one per direction of a link. It exists by name only while the link is being set
up: the rank that accepts the connection creates it, the connecting rank maps it and unlinks
it at once, so nothing stays in ``/dev/shm`` whatever happens to either process later.

Layout (all offsets in bytes, counters native u64)::

    0     magic "AIOCSHM1", version, capacity
    1024  ring 0 control  (acceptor -> connector)
    1536  ring 1 control  (connector -> acceptor)
    4096  ring 0 data     (capacity bytes)
    4096 + capacity       ring 1 data

Each ring's control block has the writer's line (``head``: bytes ever written; ``wsleep``:
the writer is waiting for space or pulls, in generation g) and, 256 bytes on, the reader's
line (``tail``: bytes ever consumed; ``rsleep``: the reader is waiting for data, in
generation g; ``pulled``: reference records completed; ``pulls``: 1 once the reader has
checked that it can read the writer's memory, see :mod:`aiocollect.transport.cma`).
Positions only grow; ``head - tail`` is the fill. Everything read from the other side is
bounds-checked: a position out of range raises ProtocolError, never an IndexError or crash.

A ring carries the link's frames as on TCP (header, then payload), plus *reference
records*: a frame header whose magic is ``REF_MAGIC`` followed by ``REF_DESC`` (the
payload's address in the writer's process and its length) instead of the payload. The
reader copies the payload out of the writer's memory and then counts it in ``pulled``; the
writer keeps the payload untouched until then.

Memory ordering: x86-64 keeps stores in order and loads in order, so "copy the bytes, then
store ``head``" publishes them and "load ``head``, then copy" reads them. The one reordering
x86 allows (a later load passing an earlier store) would lose wake-ups in the sleep protocol
(store my flag, then load the other side's counter); :func:`fence` (a lock round trip, i.e. a
locked instruction) sits between those two steps. Other architectures need real barriers,
which pure Python cannot issue, so :func:`unavailable` reports them as unsupported.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import stat
import struct
import sys
import threading
import time

from aiocollect.errors import ProtocolError
from aiocollect.transport import cma

SEGMENT_DIR = "/dev/shm"
PREFIX = "aiocollect-"
MAGIC = b"AIOCSHM1"
VERSION = 1
DATA_OFFSET = 4096
MIN_CAPACITY = 64 * 1024
MAX_CAPACITY = 1 << 30
DEFAULT_CAPACITY = 8 * 1024 * 1024
CAPACITY_ENV = "AIOCOLLECT_SHM_RING_BYTES"
#: Most ring memory one rank maps by default, over all its local peers (both directions).
RING_BUDGET = 256 * 1024 * 1024
#: Seconds after which a segment of a dead process counts as leaked (a rank killed between
#: creating a segment and its peer mapping it) and may be removed by the next rank.
STALE_AFTER = 60.0

_SEG_HEADER = struct.Struct("=8sQQ")
PROBE_BYTES = _SEG_HEADER.size
_CTL_OFFSET = (1024, 1536)
_CTL_BYTES = 512
# u64 word indexes inside a control block
_HEAD, _WSLEEP, _TAIL, _RSLEEP, _PULLED, _PULLS = 0, 1, 32, 33, 34, 35

#: Magic of a reference record's header (a frame header otherwise; wire.MAGIC is 0xAC01).
REF_MAGIC = 0xAC02
REF_MAGIC_BYTES = REF_MAGIC.to_bytes(2, "little")
#: What follows a reference record's header: payload address and length in the writer.
REF_DESC = struct.Struct("<QQ")

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier on x86-64 (the lock's atomic read-modify-write instructions)."""
    _fence_lock.acquire()
    _fence_lock.release()


def unavailable() -> str | None:
    """Why shared-memory links cannot be used on this machine, or None if they can."""
    if not sys.platform.startswith("linux"):
        return f"shared-memory links need Linux (this is {sys.platform})"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"shared-memory links need x86-64 memory ordering (this is {machine})"
    if not os.path.isdir(SEGMENT_DIR) or not os.access(SEGMENT_DIR, os.W_OK | os.X_OK):
        return f"{SEGMENT_DIR} is missing or not writable"
    return None


def configured_capacity(local_ranks: int = 2) -> int:
    """Bytes per ring: AIOCOLLECT_SHM_RING_BYTES (clamped) if set, else DEFAULT_CAPACITY,
    reduced when many ranks share the host so that one rank's rings (two per local peer)
    stay within RING_BUDGET (at least 1 MiB each)."""
    raw = os.environ.get(CAPACITY_ENV, "")
    try:
        value = int(raw) if raw else 0
    except ValueError:
        value = 0
    if value <= 0:
        share = RING_BUDGET // (2 * max(1, local_ranks - 1))
        value = min(DEFAULT_CAPACITY, max(1 << 20, 1 << (share.bit_length() - 1)))
    return min(MAX_CAPACITY, max(MIN_CAPACITY, value))


class Ring:
    """One direction of a link: this process is either its writer or its reader."""

    __slots__ = ("cap", "ctl", "data", "pos")

    def __init__(self, view: memoryview, index: int, capacity: int) -> None:
        off = _CTL_OFFSET[index]
        self.ctl = view[off:off + _CTL_BYTES].cast("Q")
        start = DATA_OFFSET + index * capacity
        self.data = view[start:start + capacity]
        self.cap = capacity
        #: head (as writer) or tail (as reader): our own position; a new ring starts at 0
        self.pos = 0

    def release(self) -> None:
        self.ctl.release()
        self.data.release()

    # -- writer side -----------------------------------------------------------------------

    def free(self) -> int:
        """Bytes the writer may write now.

        Raises:
            ProtocolError: the reader's position is outside [head - capacity, head].
        """
        tail = self.ctl[_TAIL]
        fill = self.pos - tail
        if not 0 <= fill <= self.cap:
            raise ProtocolError(f"corrupt shared-memory ring: reader position {tail} with "
                                f"writer at {self.pos} and capacity {self.cap}")
        return self.cap - fill

    def write(self, src: memoryview) -> None:
        """Copy ``src`` (at most ``free()`` bytes) in at the head; ``publish`` shows it."""
        n = len(src)
        off = self.pos % self.cap
        first = min(n, self.cap - off)
        self.data[off:off + first] = src[:first]
        if first < n:
            self.data[:n - first] = src[first:]
        self.pos += n

    def publish_head(self) -> None:
        self.ctl[_HEAD] = self.pos

    def arm_writer(self, generation: int) -> None:
        self.ctl[_WSLEEP] = generation

    def reader_sleep(self) -> int:
        return int(self.ctl[_RSLEEP])

    def pulls_enabled(self) -> bool:
        """Whether the reader said it can read this process's memory."""
        return self.ctl[_PULLS] == 1

    def pulled(self) -> int:
        """Reference records the reader has completed (copied out of our memory)."""
        return int(self.ctl[_PULLED])

    # -- reader side -----------------------------------------------------------------------

    def available(self) -> int:
        """Bytes the reader may consume now.

        Raises:
            ProtocolError: the writer's position is outside [tail, tail + capacity].
        """
        head = self.ctl[_HEAD]
        fill = head - self.pos
        if not 0 <= fill <= self.cap:
            raise ProtocolError(f"corrupt shared-memory ring: writer position {head} with "
                                f"reader at {self.pos} and capacity {self.cap}")
        return fill

    def read(self, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes (at most ``available()``) out at the tail."""
        n = len(dst)
        off = self.pos % self.cap
        first = min(n, self.cap - off)
        dst[:first] = self.data[off:off + first]
        if first < n:
            dst[first:] = self.data[:n - first]
        self.pos += n

    def peek(self, dst: memoryview) -> None:
        """Copy the next ``len(dst)`` bytes without consuming them."""
        pos = self.pos
        self.read(dst)
        self.pos = pos

    def skip(self, n: int) -> None:
        self.pos += n

    def publish_tail(self) -> None:
        self.ctl[_TAIL] = self.pos

    def arm_reader(self, generation: int) -> None:
        self.ctl[_RSLEEP] = generation

    def writer_sleep(self) -> int:
        return int(self.ctl[_WSLEEP])

    def enable_pulls(self) -> None:
        self.ctl[_PULLS] = 1

    def publish_pulled(self, count: int) -> None:
        self.ctl[_PULLED] = count


class Segment:
    """A mapped segment; ``rings[0]`` carries acceptor -> connector, ``rings[1]`` back."""

    def __init__(self, name: str, capacity: int, mm: mmap.mmap) -> None:
        self.name = name
        self.capacity = capacity
        self.unlinked = False
        self._mmap: mmap.mmap | None = mm
        self._view: memoryview | None = memoryview(mm)
        self.rings = (Ring(self._view, 0, capacity), Ring(self._view, 1, capacity))

    @property
    def address(self) -> int:
        """Where this process maps the segment (the peer's pull probe reads its header)."""
        assert self._view is not None
        return cma.address(self._view[:PROBE_BYTES])

    def probe_bytes(self) -> bytes:
        """The segment's header, identical in both processes' mappings."""
        assert self._view is not None
        return bytes(self._view[:PROBE_BYTES])

    @staticmethod
    def size_for(capacity: int) -> int:
        return DATA_OFFSET + 2 * capacity

    @property
    def path(self) -> str:
        return os.path.join(SEGMENT_DIR, self.name)

    @classmethod
    def create(cls, capacity: int) -> Segment:
        """Create, size and map a new segment (both readers start out waiting).

        Raises:
            OSError: /dev/shm is full, missing or not writable.
        """
        _reap_once()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(SEGMENT_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.ftruncate(fd, cls.size_for(capacity))
            mm = mmap.mmap(fd, cls.size_for(capacity))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        _SEG_HEADER.pack_into(mm, 0, MAGIC, VERSION, capacity)
        seg = cls(name, capacity, mm)
        for ring in seg.rings:
            ring.arm_reader(1)  # the first write rings the doorbell
        return seg

    @classmethod
    def attach(cls, name: str, capacity: int) -> Segment:
        """Map the segment ``name`` created by the peer and check that it is what the peer
        announced (name pattern, owner, size, magic, version, capacity).

        Raises:
            OSError: it does not exist here (another /dev/shm) or cannot be opened.
            ProtocolError: it is not a segment of this shape.
        """
        if (not name.startswith(PREFIX) or "/" in name or len(name) > 128
                or not MIN_CAPACITY <= capacity <= MAX_CAPACITY):
            raise ProtocolError(f"bad shared-memory offer {name!r} of {capacity} bytes")
        path = os.path.join(SEGMENT_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            size = cls.size_for(capacity)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size:
                raise ProtocolError(f"shared-memory segment {name} is not a {size}-byte file "
                                    f"of this user")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, cap = _SEG_HEADER.unpack_from(mm, 0)
        if (magic, version, cap) != (MAGIC, VERSION, capacity):
            mm.close()
            raise ProtocolError(f"shared-memory segment {name} has header "
                                f"{(magic, version, cap)!r}")
        return cls(name, capacity, mm)

    def unlink(self) -> None:
        """Remove the name (idempotent; mappings stay valid until closed)."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unlink if still named and unmap (idempotent)."""
        self.unlink()
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        for ring in self.rings:
            ring.release()
        if self._view is not None:
            self._view.release()
            self._view = None
        with contextlib.suppress(BufferError):  # a view still exported: the GC unmaps it
            mm.close()


_reaped = False


def _reap_once() -> None:
    global _reaped
    if not _reaped:
        _reaped = True
        reap_stale()


def reap_stale(max_age: float = STALE_AFTER) -> list[str]:
    """Remove this user's segments whose creating process is gone and that are older than
    ``max_age`` seconds (left by a rank killed during link setup). Returns their names."""
    removed: list[str] = []
    try:
        names = os.listdir(SEGMENT_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        pid = segment_pid(name)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(SEGMENT_DIR, name)
        try:
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or now - st.st_mtime < max_age:
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


def segment_pid(name: str) -> int | None:
    """The creating pid encoded in a segment name, or None if it is not one of ours."""
    if not name.startswith(PREFIX):
        return None
    pid, _, rest = name[len(PREFIX):].partition("-")
    if not pid.isdigit() or not rest:
        return None
    return int(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
