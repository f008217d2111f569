"""Scratch memory reused across operations: a small, capped free-list of byte buffers.

Algorithms that need temporary receive space (the ring reduce-scatter's window) lease it
here instead of allocating per call: a fresh multi-MiB ``np.empty`` costs page faults and
kernel zeroing on first touch, inside the receive syscalls on the event-loop thread.

Contract:

- ``acquire(count, dtype)`` returns a 1-D array that belongs to the caller alone until it
  hands it back; no other lease shares any of its memory, however many operations run at
  once (on one loop or on several threads).
- ``release(arr)`` hands it back for reuse. Only call it once nothing can still write into
  the memory (every receive posted into it has landed) or read it (no reduction running).
- ``discard(arr)`` ends the lease without reuse: for a failed or cancelled operation whose
  receives may still be filled by a transport. The memory is freed once unreferenced.
- At most ``cap_bytes`` of free buffers are retained; beyond that the least recently
  released ones are dropped, so an idle process holds no more than the cap.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from aiocollect._buffers import Array

#: Most bytes of idle scratch the process-wide pool keeps.
SCRATCH_RETAIN_BYTES = 32 * 1024 * 1024
#: Requests below this many bytes are plain allocations (cheap, and not worth a class).
MIN_POOLED_BYTES = 64 * 1024


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` is served from: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


class ScratchPool:
    """Free-list of byte buffers in power-of-two size classes (see the module docstring).

    Thread-safe; acquire and release are O(number of idle buffers), which the cap keeps
    small (at most ``cap_bytes / MIN_POOLED_BYTES``, in practice one or two).
    """

    def __init__(
        self, cap_bytes: int = SCRATCH_RETAIN_BYTES, min_bytes: int = MIN_POOLED_BYTES
    ) -> None:
        self.cap_bytes = cap_bytes
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._free: list[np.ndarray[Any, np.dtype[np.uint8]]] = []  # oldest first
        self._free_bytes = 0
        # id(leased array) -> (leased array, its byte buffer or None if not pooled)
        self._leases: dict[int, tuple[Array, np.ndarray[Any, np.dtype[np.uint8]] | None]] = {}

    @property
    def retained_bytes(self) -> int:
        """Bytes of idle buffers held for reuse (never above ``cap_bytes``)."""
        return self._free_bytes

    @property
    def leased(self) -> int:
        """Arrays handed out and not yet released or discarded."""
        return len(self._leases)

    def acquire(self, count: int, dtype: np.dtype[Any]) -> Array:
        """A 1-D array of ``count`` elements of ``dtype``, contents undefined, exclusively
        the caller's until :meth:`release` or :meth:`discard`."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        if nbytes >= self.min_bytes:
            want = size_class(nbytes)
            with self._lock:
                for i in range(len(self._free) - 1, -1, -1):  # most recently released first
                    if self._free[i].nbytes == want:
                        buf = self._free.pop(i)
                        self._free_bytes -= want
                        break
            if buf is None:
                buf = np.empty(want, dtype=np.uint8)
            arr: Array = buf[:nbytes].view(dtype)
        else:
            arr = np.empty(count, dtype=dtype)
        with self._lock:
            self._leases[id(arr)] = (arr, buf)
        return arr

    def release(self, arr: Array) -> None:
        """Return a leased array for reuse (nothing may write into it or read it anymore).

        Raises:
            ValueError: ``arr`` is not an array this pool leased (or it was already
                released or discarded).
        """
        buf = self._end_lease(arr)
        if buf is None or buf.nbytes > self.cap_bytes:
            return
        with self._lock:
            self._free.append(buf)
            self._free_bytes += buf.nbytes
            while self._free_bytes > self.cap_bytes:
                self._free_bytes -= self._free.pop(0).nbytes

    def discard(self, arr: Array) -> None:
        """End a lease without reusing the memory (a transport may still write into it).

        Raises:
            ValueError: as for :meth:`release`.
        """
        self._end_lease(arr)

    def clear(self) -> None:
        """Drop every idle buffer (leases stay valid)."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0

    def _end_lease(self, arr: Array) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        with self._lock:
            lease = self._leases.get(id(arr))
            if lease is None or lease[0] is not arr:
                raise ValueError("not an array leased from this pool (or already returned)")
            del self._leases[id(arr)]
        return lease[1]


#: The process-wide pool the collectives lease from.
SCRATCH = ScratchPool()
