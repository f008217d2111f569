"""Shared-memory segments and single-producer/single-consumer byte rings (no event loop).

A *segment* is an anonymous file (``memfd_create``, named ``aiocollect-<pid>-<random>``
for ``/proc/<pid>/maps`` only: it is never in a file system) holding two rings, one per
direction of a link. The rank that accepts the connection creates it, sizes it and
*seals* it (``F_SEAL_SHRINK``, ``F_SEAL_GROW``, ``F_SEAL_SEAL``): from then on nobody, not
even a process of the same user holding a descriptor, can change its size, so the
mappings can never lose their pages under the ranks (a truncated shared mapping raises
SIGBUS in every process that touches it). The connecting rank opens the acceptor's
descriptor through ``/proc/<pid>/fd/<n>`` (the kernel allows it to processes that may
inspect the acceptor: same user, dumpable), checks that it is a sealed memfd of ours of
the announced size, carrying the announced token in its header, maps it and closes its
descriptor; the acceptor closes its own once the connector says it has mapped it. After
setup the segment exists only as the two mappings, and goes away with the last of them
whatever happens to either process: there is nothing to clean up and nothing to leak.

Layout (all offsets in bytes, counters native u64)::

    0     magic "AIOCSHM1", version, capacity, token (16 random bytes)
    1024  ring 0 control  (acceptor -> connector)
    1536  ring 1 control  (connector -> acceptor)
    4096  ring 0 data     (capacity bytes)
    4096 + capacity       ring 1 data

Each ring's control block has the writer's line (``head``: bytes ever written; ``wsleep``:
the writer is waiting for space or pulls, in generation g) and, 256 bytes on, the reader's
line (``tail``: bytes ever consumed; ``rsleep``: the reader is waiting for data, in
generation g; ``pulled``: reference records completed; ``pulls``: 1 once the reader has
checked that it can read the writer's memory, see :mod:`aiocollect.transport.cma`;
``socket_taken``: frames the reader has taken from the socket instead of the ring, see
:mod:`aiocollect.transport.shm`).
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
import fcntl
import functools
import mmap
import os
import platform
import secrets
import stat
import struct
import sys
import threading

from aiocollect.errors import ProtocolError
from aiocollect.transport import cma
from aiocollect.transport.wire import MAGIC_BYTES

PREFIX = "aiocollect-"
MAGIC = b"AIOCSHM1"
VERSION = 3
DATA_OFFSET = 4096
MIN_CAPACITY = 64 * 1024
MAX_CAPACITY = 1 << 30
DEFAULT_CAPACITY = 8 * 1024 * 1024
CAPACITY_ENV = "AIOCOLLECT_SHM_RING_BYTES"
#: Most ring memory one rank maps by default, over all its local peers (both directions).
RING_BUDGET = 256 * 1024 * 1024
#: Bytes of the random token that ties a segment to the welcome that offered it.
TOKEN_BYTES = 16
#: The seals every segment carries: its size is fixed for good (no SIGBUS by truncation).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_SEG_HEADER = struct.Struct(f"=8sQQ{TOKEN_BYTES}s")
PROBE_BYTES = _SEG_HEADER.size
_CTL_OFFSET = (1024, 1536)
_CTL_BYTES = 512
# u64 word indexes inside a control block
_HEAD, _WSLEEP, _TAIL, _RSLEEP, _PULLED, _PULLS, _SOCKET_TAKEN = 0, 1, 32, 33, 34, 35, 36

#: Magic of a reference record's header (a frame header otherwise; wire.MAGIC is 0xAC01).
REF_MAGIC = 0xAC02
REF_MAGIC_BYTES = REF_MAGIC.to_bytes(len(MAGIC_BYTES), "little")
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
    return _memfd_unavailable()


@functools.cache
def _memfd_unavailable() -> str | None:
    """Try once what every link setup does: a sealed memfd, reopened through /proc."""
    try:
        fd = new_memfd(DATA_OFFSET)
    except (OSError, AttributeError) as exc:
        return f"cannot create a sealed memfd (memfd_create, F_ADD_SEALS): {exc}"
    try:
        os.close(_reopen(os.getpid(), fd))
    except OSError as exc:
        return f"cannot reopen a memfd through /proc/self/fd: {exc}"
    finally:
        os.close(fd)
    return None


def new_memfd(size: int) -> int:
    """A new memfd of ``size`` bytes, sealed against any change of size.

    Raises:
        OSError: no memfd_create or sealing here, or out of memory.
    """
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reopen(pid: int, fd: int) -> int:
    """Open the file that process ``pid`` holds as descriptor ``fd`` (a new descriptor).

    Raises:
        OSError: no such process or descriptor here, or no permission to look.
    """
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def map_offered(pid: int, fd: int, size: int, kind: str) -> mmap.mmap:
    """Map the memfd that process ``pid`` offered as its descriptor ``fd``, once checked:
    a memfd of ours (named with PREFIX), a regular file of this user, of ``size`` bytes,
    sealed against changes of size (``kind`` names it in the error: "segment").

    Raises:
        OSError: it cannot be opened here (another pid namespace, no permission to look
            at the peer's descriptors, the peer closed it).
        ProtocolError: what it names is not such a memfd.
    """
    mine = _reopen(pid, fd)
    try:
        what = os.readlink(f"/proc/self/fd/{mine}")
        st = os.fstat(mine)
        try:
            seals = fcntl.fcntl(mine, fcntl.F_GET_SEALS)
        except OSError:  # not a file that can be sealed
            seals = 0
        if (
            not what.startswith(f"/memfd:{PREFIX}")
            or not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_size != size
            or seals & SEALS != SEALS
        ):
            raise ProtocolError(
                f"descriptor {fd} of process {pid} is not a sealed {size}-byte "
                f"aiocollect {kind} of this user ({what}, {st.st_size} bytes, "
                f"seals {seals:#x})"
            )
        return mmap.mmap(mine, size)
    finally:
        os.close(mine)


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
        self.ctl = view[off : off + _CTL_BYTES].cast("Q")
        start = DATA_OFFSET + index * capacity
        self.data = view[start : start + capacity]
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
            raise ProtocolError(
                f"corrupt shared-memory ring: reader position {tail} with "
                f"writer at {self.pos} and capacity {self.cap}"
            )
        return self.cap - fill

    def write(self, src: memoryview) -> None:
        """Copy ``src`` (at most ``free()`` bytes) in at the head; ``publish`` shows it."""
        n = len(src)
        off = self.pos % self.cap
        if off + n <= self.cap:  # the common case: no wrap
            self.data[off : off + n] = src
        else:
            first = self.cap - off
            self.data[off:] = src[:first]
            self.data[: n - first] = src[first:]
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

    def socket_taken(self) -> int:
        """Frames sent on the socket (not through the ring) that the reader has taken."""
        return int(self.ctl[_SOCKET_TAKEN])

    def socket_turn(self, socket_sent: int, refs_sent: int, rung: int, limit: int) -> bool:
        """The small-frame check of the sending half in one step (the common case only):
        True when a small frame may go on the socket now, because ``socket_sent`` socket
        frames are more than the reader has taken but fewer than ``limit`` ahead, or none
        is ahead and the reader sleeps (a generation other than 0 and ``rung``, the one we
        last rang for) with everything written read and all ``refs_sent`` references
        pulled. False also where a counter is implausible: this never raises (``socket_taken``
        and :meth:`free`, asked next, report it).
        """
        ctl = self.ctl
        if socket_sent:
            ahead = socket_sent - ctl[_SOCKET_TAKEN]
            if ahead:
                return 0 < ahead < limit
        gen = ctl[_RSLEEP]
        return gen != 0 and gen != rung and ctl[_PULLED] == refs_sent and ctl[_TAIL] == self.pos

    # -- reader side -----------------------------------------------------------------------

    def available(self) -> int:
        """Bytes the reader may consume now.

        Raises:
            ProtocolError: the writer's position is outside [tail, tail + capacity].
        """
        head = self.ctl[_HEAD]
        fill = head - self.pos
        if not 0 <= fill <= self.cap:
            raise ProtocolError(
                f"corrupt shared-memory ring: writer position {head} with "
                f"reader at {self.pos} and capacity {self.cap}"
            )
        return fill

    def read(self, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes (at most ``available()``) out at the tail."""
        n = len(dst)
        off = self.pos % self.cap
        if off + n <= self.cap:  # the common case: no wrap
            dst[:] = self.data[off : off + n]
        else:
            first = self.cap - off
            dst[:first] = self.data[off:]
            dst[first:] = self.data[: n - first]
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

    def publish_socket_taken(self, count: int) -> int:
        """Publish ``count`` socket frames taken, then, after a full fence, the writer's
        sleep generation (:meth:`writer_sleep`: 0 while it is awake), in one call."""
        ctl = self.ctl
        ctl[_SOCKET_TAKEN] = count
        fence()
        return int(ctl[_WSLEEP])


class Segment:
    """A mapped segment; ``rings[0]`` carries acceptor -> connector, ``rings[1]`` back.

    ``fd`` is the creator's descriptor, kept open only until the peer has opened its own
    (:meth:`handed_over`); an attached segment holds none."""

    def __init__(self, capacity: int, mm: mmap.mmap, token: bytes, fd: int | None) -> None:
        self.capacity = capacity
        self.token = token
        self.fd = fd
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

    @classmethod
    def create(cls, capacity: int) -> Segment:
        """Create, size, seal and map a new segment (both readers start out waiting); its
        descriptor stays open (``fd``) for the peer to open until :meth:`handed_over`.

        Raises:
            OSError: no sealed memfds here, or out of memory.
        """
        size = cls.size_for(capacity)
        fd = new_memfd(size)
        try:
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(TOKEN_BYTES)
        _SEG_HEADER.pack_into(mm, 0, MAGIC, VERSION, capacity, token)
        seg = cls(capacity, mm, token, fd)
        for ring in seg.rings:
            ring.arm_reader(1)  # the first write rings the doorbell
        return seg

    @classmethod
    def attach(cls, pid: int, fd: int, capacity: int, token: bytes) -> Segment:
        """Map the segment that process ``pid`` offered as its descriptor ``fd`` and check
        that it is what the peer announced: a memfd of ours, of this user, sealed against
        changes of size, of the size for ``capacity``, with our magic, version, capacity
        and ``token`` in its header.

        Raises:
            OSError: it cannot be opened here (another pid namespace, no permission to
                look at the peer's descriptors, the peer closed it).
            ProtocolError: the offer is malformed, or what it names is not such a segment.
        """
        if (
            not 0 < pid < 1 << 31
            or not 0 <= fd < 1 << 31
            or len(token) != TOKEN_BYTES
            or not MIN_CAPACITY <= capacity <= MAX_CAPACITY
        ):
            raise ProtocolError(
                f"bad shared-memory offer: descriptor {fd} of process {pid}, "
                f"{capacity} bytes per ring"
            )
        mm = map_offered(pid, fd, cls.size_for(capacity), "segment")
        header = _SEG_HEADER.unpack_from(mm, 0)
        if header != (MAGIC, VERSION, capacity, token):
            mm.close()
            raise ProtocolError(
                f"shared-memory segment of process {pid} has header "
                f"{header[:3]!r} and another token than offered"
            )
        return cls(capacity, mm, token, None)

    def handed_over(self) -> None:
        """The peer has mapped the segment: close the creator's descriptor (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close the descriptor if still open and unmap (idempotent)."""
        self.handed_over()
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
