"""What shared-memory tests check is left behind: aiocollect files in ``/dev/shm`` (of any
process) and this process's descriptors and mappings of segments (sealed memfds, no name in
any file system).

Segments are sealed memfds, so what could leak is what this process holds: a descriptor of a
segment (an acceptor's, kept until its peer has mapped it) or a mapping of one (a link that
was never closed); a spawned rank's descriptors and mappings die with it, which the kernel
guarantees. ``/dev/shm`` is checked too: nothing named ``aiocollect-*`` may ever appear there.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from aiocollect.transport.shm_ring import PREFIX, pid_alive

SHM_DIR = "/dev/shm"
MEMFD = f"/memfd:{PREFIX}"


def segments() -> set[str]:
    """Names of aiocollect files in /dev/shm (of any process)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}
    except OSError:
        return set()


def _pid_of(name: str) -> int | None:
    pid, _, rest = name[len(PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() and rest else None


def leaked(before: set[str], pids: set[int] | None = None) -> set[str]:
    """Files named in /dev/shm since ``before`` that belong to ``pids`` or, without pids,
    to this process or a process that has exited."""
    out = set()
    for name in segments() - before:
        pid = _pid_of(name)
        if pid is None:
            continue
        if pids is not None:
            if pid in pids:
                out.add(name)
            continue
        if pid == os.getpid() or not pid_alive(pid):
            out.add(name)
    return out


def held() -> set[str]:
    """This process's descriptors and mappings of segments (``fd N -> ...``, ``map ...``)."""
    gc.collect()  # a mapping whose view was still exported at close goes with the GC
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(MEMFD):
            out.add(f"fd {fd} -> {target}")
    with open("/proc/self/maps") as maps:
        for line in maps:
            if MEMFD in line:
                out.add(f"map {line.split()[0]} {line.split(maxsplit=5)[-1].strip()}")
    return out


@contextmanager
def nothing_left() -> Iterator[None]:
    """Check, when the block ends without error, that it left no aiocollect file in
    /dev/shm and no segment open or mapped in this process.

    Raises:
        AssertionError: something was left (named in the message).
    """
    before, held_before = segments(), held()
    yield
    left = leaked(before)
    assert not left, f"this test left shared-memory files: {sorted(left)}"
    kept = held() - held_before
    assert not kept, f"this test left segments open or mapped: {sorted(kept)}"
