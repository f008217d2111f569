"""A rank's slot segment: shared memory its peers on this host map, for the collectives
that copy through shared memory (``collectives/segment.py``).

A slot segment is a sealed memfd like a link's ring segment (:mod:`aiocollect.transport.
shm_ring`: named ``aiocollect-<pid>-<random>`` for ``/proc/<pid>/maps`` only, never in a
file system, sealed against any change of size), with its pages reserved when it is
created (``posix_fallocate``: running out of shared memory is an error there, never a
SIGBUS later) and ``REGIONS`` regions of ``region_bytes`` each after a 4 KiB header::

    0     magic "AIOCSLT1", version, region bytes, token (16 random bytes)
    4096  region 0, then region 1, ...

Its owner creates it, writes into it and keeps its descriptor open until every peer
has mapped it (:meth:`SlotSegment.handed_over`); a peer maps it through
``/proc/<pid>/fd/<fd>`` (:meth:`SlotSegment.attach`) after checking that it is a sealed
memfd of ours of this user, of the announced size and token. After that the segment
exists only as mappings, and goes away with the last of them whatever happens to any
process: nothing can be left behind.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct

import numpy as np

from aiocollect._buffers import Array
from aiocollect.errors import ProtocolError
from aiocollect.transport import shm_ring
from aiocollect.transport.shm_ring import TOKEN_BYTES

MAGIC = b"AIOCSLT1"
VERSION = 1
#: Bytes before the first region (the header, then padding to a page).
HEADER_BYTES = 4096
#: Regions per segment: an operation writes one while its peers may still copy its
#: predecessor's results out of the other.
REGIONS = 2
#: The largest region a peer's offer may announce.
MAX_REGION = 1 << 30
_HEADER = struct.Struct(f"=8sQQ{TOKEN_BYTES}s")


class SlotSegment:
    """A mapped slot segment: this rank's own (:meth:`create`) or a peer's
    (:meth:`attach`)."""

    def __init__(self, region_bytes: int, mm: mmap.mmap, token: bytes, fd: int | None) -> None:
        self.region_bytes = region_bytes
        self.token = token
        #: The owner's descriptor until :meth:`handed_over`; None in a peer's mapping.
        self.fd = fd
        #: The descriptor's number as offered to the peers (-1 in a peer's mapping).
        self.offered = -1 if fd is None else fd
        self._mmap: mmap.mmap | None = mm
        self.bytes: Array = np.frombuffer(mm, np.uint8)

    @staticmethod
    def size_for(region_bytes: int) -> int:
        return HEADER_BYTES + REGIONS * region_bytes

    @classmethod
    def create(cls, region_bytes: int) -> SlotSegment:
        """Create, seal, reserve and map a new segment of ``REGIONS`` regions of
        ``region_bytes``; its descriptor stays open (``fd``) for the peers to open.

        Raises:
            MemoryError: the host's shared memory cannot hold it (the message names the
                size).
            OSError: no sealed memfds here.
        """
        size = cls.size_for(region_bytes)
        fd = shm_ring.new_memfd(size)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise MemoryError(
                    f"cannot reserve {size} bytes of shared memory for a slot segment "
                    f"(the segment allreduce): {exc}"
                ) from exc
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(TOKEN_BYTES)
        _HEADER.pack_into(mm, 0, MAGIC, VERSION, region_bytes, token)
        return cls(region_bytes, mm, token, fd)

    @classmethod
    def attach(cls, pid: int, fd: int, region_bytes: int, token: bytes) -> SlotSegment:
        """Map the slot segment that process ``pid`` offered as its descriptor ``fd`` and
        check that it is what the peer announced: a sealed memfd of ours, of this user, of
        the size for ``region_bytes``, with our magic, version and ``token`` in its header.

        Raises:
            OSError: it cannot be opened here (another pid namespace, no permission to
                look at the peer's descriptors, the peer closed it).
            ProtocolError: the offer is malformed, or what it names is not such a segment.
        """
        if (
            not 0 < pid < 1 << 31
            or not 0 <= fd < 1 << 31
            or len(token) != TOKEN_BYTES
            or not 0 < region_bytes <= MAX_REGION
        ):
            raise ProtocolError(
                f"bad slot segment offer: descriptor {fd} of process {pid}, "
                f"{region_bytes} bytes per region"
            )
        mm = shm_ring.map_offered(pid, fd, cls.size_for(region_bytes), "slot segment")
        header = _HEADER.unpack_from(mm, 0)
        if header != (MAGIC, VERSION, region_bytes, token):
            mm.close()
            raise ProtocolError(
                f"slot segment of process {pid} has header {header[:3]!r} and another "
                "token than offered"
            )
        return cls(region_bytes, mm, token, None)

    def region(self, index: int, nbytes: int) -> Array:
        """The first ``nbytes`` of region ``index`` (bytes, writable).

        Raises:
            ProtocolError: no such region, or ``nbytes`` is past its end (a peer's
                announcement does not fit its segment).
        """
        if not 0 <= index < REGIONS or not 0 <= nbytes <= self.region_bytes:
            raise ProtocolError(
                f"region {index} of {nbytes} bytes is not in a slot segment of {REGIONS} "
                f"regions of {self.region_bytes} bytes"
            )
        lo = HEADER_BYTES + index * self.region_bytes
        return self.bytes[lo : lo + nbytes]

    def handed_over(self) -> None:
        """Every peer has mapped the segment: close the owner's descriptor (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close the descriptor if still open and unmap (idempotent; a view still held
        elsewhere keeps the mapping until the garbage collector takes it)."""
        self.handed_over()
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        self.bytes = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            mm.close()
