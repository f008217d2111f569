"""Staging buffers kept for reuse: the memory a frame that arrives before its receive is
posted waits in.

A frame with no receive posted yet is staged (``Link._begin_frame``) and copied out when
its receive comes. At three and four ranks over TCP the ring stages every operation's
first reduce-scatter chunks (a predecessor that finished the previous operation first
sends them before this rank has posted their receives), and a fresh ``bytearray`` per
frame cost an allocation, zeroing, a page fault per 4 KiB written and a release: 400-460
minor faults per 16 MiB allreduce and rank at four ranks, 2,400 at 64 MiB. Kept buffers
took that to 4-28, and each of five interleaved pairs 2-7 ms faster per operation
(``tools/op_cpu.py -n 4 --size 16M`` reports the page faults per operation).

Contract: :meth:`StagingPool.give` takes only a buffer nothing else holds or will write
(its frame was copied out, after the transport finished writing it); a frame that did not
complete (a failed link, a mismatch) never comes back here, so a buffer a broken transport
could still write into is never handed out again. A buffer taken has the length asked for
and undefined contents: the frame overwrites all of it before anyone reads it.

The pool is one per process and shared by every link (links of groups on several threads
included: a lock guards it), bounded by ``BUDGET`` bytes in all, so a process with many
links keeps no more than a few chunks.
"""

from __future__ import annotations

import threading

#: Bytes of staging buffers kept in all (per process).
BUDGET = 16 * 1024 * 1024
#: Smaller buffers are not kept: allocating them costs less than looking.
MIN_BYTES = 64 * 1024


class StagingPool:
    """Staging buffers of frames copied out, by exact length, within ``budget`` bytes."""

    def __init__(self, budget: int = BUDGET, min_bytes: int = MIN_BYTES) -> None:
        self.budget = budget
        self.min_bytes = min_bytes
        self._kept: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        #: Buffers handed out again instead of allocated (for tests and diagnostics).
        self.reused = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes kept now."""
        return self._bytes

    def take(self, length: int) -> bytearray:
        """A buffer of ``length`` bytes (contents undefined): a kept one, else a new one."""
        if length >= self.min_bytes:
            with self._lock:
                bufs = self._kept.get(length)
                if bufs:
                    self._bytes -= length
                    self.reused += 1
                    return bufs.pop()
        return bytearray(length)

    def give(self, buf: bytearray) -> None:
        """Keep ``buf`` (nothing else holds it: module docstring) while the budget allows."""
        n = len(buf)
        if n < self.min_bytes:
            return
        with self._lock:
            if self._bytes + n <= self.budget:
                self._kept.setdefault(n, []).append(buf)
                self._bytes += n

    def clear(self) -> None:
        """Let every kept buffer go."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0


#: The process's pool (``Link`` stages through it).
POOL = StagingPool()
