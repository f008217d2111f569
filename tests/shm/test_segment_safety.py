"""Segments cannot be shrunk under the ranks: another process of the same user really
tries to truncate them (``ftruncate`` on its own descriptor of the segment), gets EPERM
from the seals, and the ranks go on with exact results. A truncated shared mapping would
SIGBUS every process touching it, which is what happened with files in ``/dev/shm``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from aiocollect.errors import StoreError
from aiocollect.store import open_store
from aiocollect.testing import spawn_ranks
from aiocollect.transport.shm_ring import MIN_CAPACITY, Segment
from tests.support.targets import shm as targets

# Run as a separate process: for each (pid, path) it opens the file, tries to grow it, to
# shrink it to half and to 0 (so it stays truncated if the kernel allows any of it), and
# prints what each attempt gave.
_TRUNCATE = r"""
import errno, json, os, sys
out = []
for pid, path in json.loads(sys.argv[1]):
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        out.append({"path": path, "open": errno.errorcode[exc.errno]})
        continue
    size = os.fstat(fd).st_size
    tries = {}
    for new in (size + 4096, size // 2, 0):  # ends truncated if the kernel lets it
        try:
            os.ftruncate(fd, new)
            tries[str(new)] = "done"
        except OSError as exc:
            tries[str(new)] = errno.errorcode[exc.errno]
    out.append({"path": path, "open": "ok", "size": size, "after": os.fstat(fd).st_size,
                "tries": tries})
    os.close(fd)
print(json.dumps(out))
"""


def _truncate(paths: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """Have another process (same user) try to change the size of each file."""
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    result: list[dict[str, Any]] = json.loads(proc.stdout)
    return result


def _check_refused(results: list[dict[str, Any]]) -> None:
    """Every file that could be opened refused every change of size."""
    for res in results:
        if res["open"] == "ok":
            assert set(res["tries"].values()) == {"EPERM"}, res
            assert res["after"] == res["size"], res


@pytest.mark.timeout(30)
def test_truncating_a_segment_is_refused_and_its_memory_stays() -> None:
    """The acceptor's descriptor, opened by another process the way a connector opens it
    (``/proc/<pid>/fd/<n>``): shrinking and growing fail with EPERM, and every page of the
    mapping is still there (no SIGBUS touching the last byte of the second ring)."""
    seg = Segment.create(MIN_CAPACITY)
    try:
        assert seg.fd is not None
        _check_refused(_truncate([(os.getpid(), f"/proc/{os.getpid()}/fd/{seg.fd}")]))
        ring = seg.rings[1]
        ring.data[-1] = 0x5A
        ring.data[0] = 0xA5
        assert ring.data[-1] == 0x5A
        assert ring.data[0] == 0xA5
        assert os.fstat(seg.fd).st_size == Segment.size_for(MIN_CAPACITY)
    finally:
        seg.close()


def _segment_files(pid: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """Paths through which process ``pid``'s shared-memory segments can be opened: its
    descriptors of them (``/proc/<pid>/fd/<n>``: Python's mmap keeps a duplicate of the
    descriptor it mapped) and its mappings (``/proc/<pid>/map_files/<range>``, which only
    a process with CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE may open). Segments were files
    in ``/dev/shm`` before and are memfds now; both are named ``aiocollect-*``."""
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if "aiocollect-" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                fds.append((pid, f"/proc/{pid}/fd/{fd}"))
    maps = []
    with open(f"/proc/{pid}/maps") as lines:
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "aiocollect-" in fields[5] and fields[1][3] == "s":
                maps.append((pid, f"/proc/{pid}/map_files/{fields[0]}"))
    return fds, maps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("uvloop", [False, True])
async def test_ranks_survive_a_real_truncation(
    uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two and three real ranks allreduce through small rings (64 KiB, pulls off, so every
    page of every ring is written and read again and again) while another process of the
    same user opens each rank's descriptors of its segments (and, where it may, its
    mappings of them) and tries to truncate each one. Every attempt fails with EPERM; the
    ranks never notice and finish with exact results."""
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(MIN_CAPACITY))
    monkeypatch.setenv("AIOCOLLECT_SHM_PULL", "0")
    for n in (2, 3):
        job = spawn_ranks(
            n,
            targets.allreduce_until_told,
            1 << 14,
            "ready",
            "go",
            50,
            timeout=90,
            uvloop=uvloop,
            transport="shm",
        )
        store, _ = await open_store(job.store, rank=1, timeout=30)
        try:
            await store.wait([f"ready/{r}" for r in range(n)], timeout=30)
            files = [_segment_files(job.pid(r)) for r in range(n)]
            fds = [p for f, _ in files for p in f]
            maps = [p for _, m in files for p in m]
            # each rank maps one segment per peer (its link's), and holds its descriptor
            assert len(fds) == len(maps) == n * (n - 1), files
            results = _truncate(fds + maps)
            # (rank 0 serves the store: if it died of the truncation, outcomes say how)
            with contextlib.suppress(StoreError):
                await store.set("go", b"1")
        finally:
            await store.close()
        outcomes = await job.outcomes()
        for rank, out in enumerate(outcomes):  # (a truncated ring: "died", "signal SIGBUS")
            assert out[0] == "ok", (rank, out, results)
            assert out[1]["error"] is None, (rank, out)
            assert out[1]["rounds"] > 50, (rank, out)
        assert [r["open"] for r in results[: len(fds)]] == ["ok"] * len(fds), results
        _check_refused(results)
