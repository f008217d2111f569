"""Cross-memory attach: copying straight out of another process's memory with Linux's
``process_vm_readv(2)``, the single-copy path of shared-memory links (no event loop).

A sender on a shared-memory link may put a *reference* to its payload in the ring (the
payload's address and length) instead of the payload; the receiver then copies the bytes
from the sender's memory into the posted receive in one step, where the ring takes two
(into the ring, out of it). The kernel allows it between processes of the same user that
may ptrace each other (Yama's ``ptrace_scope`` and container seccomp policies can forbid
it), so each side *probes* the other once while the link is set up and falls back to ring
copies if the probe fails. MPI implementations use the same mechanism (Open MPI's ``vader``
BTL and MPICH's LMT call it CMA).

The same reads are the shared-memory link's one-sided reads (``Link.expose`` /
``Link.read_exposed``): an exposure's token is the buffer's address and length in the
exposing process (:func:`token`), checked against the requested range before each read
(:func:`locate`); the kernel checks that the range is mapped there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

#: Environment setting: ``0`` turns single-copy pulls off (links copy through the ring); a
#: number of bytes sets the smallest payload sent by reference (default ``PULL_MIN``).
ENV = "AIOCOLLECT_SHM_PULL"
#: Yama's ptrace policy: 1 or more forbids reading a sibling process's memory.
YAMA = "/proc/sys/kernel/yama/ptrace_scope"
#: Payloads at least this large go by reference: below it the ring's two copies cost less
#: than the writer's wait for the reader's acknowledgement.
PULL_MIN = 256 * 1024


#: A one-sided token: the exposed buffer's address and length in the exposing process.
TOKEN = struct.Struct("<QQ")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Any = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn  # type: ignore[no-any-return]


_readv = _load()


def threshold() -> int:
    """The smallest payload this process sends by reference, 0 when pulls are off here
    (no process_vm_readv, or AIOCOLLECT_SHM_PULL=0). Bad values fall back to PULL_MIN."""
    if _readv is None:
        return 0
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return PULL_MIN
    if raw.lower() in ("off", "no", "false"):
        return 0
    try:
        return max(0, int(raw))
    except ValueError:
        return PULL_MIN


def enabled() -> bool:
    """Whether this process may use pulls (see :func:`threshold`)."""
    return threshold() > 0


def address(buf: memoryview | bytes | bytearray) -> int:
    """The address of a contiguous, non-empty buffer's first byte (read-only ones too)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except TypeError:  # read-only
        return int(np.frombuffer(buf, np.uint8).ctypes.data)


def token(buf: memoryview) -> bytes:
    """The one-sided token of ``buf`` in this process (:data:`TOKEN`: its address and
    length; 0 for the address of an empty buffer)."""
    n = len(buf)
    return TOKEN.pack(address(buf) if n else 0, n)


def locate(token: bytes, offset: int, nbytes: int) -> int:
    """The address of bytes ``offset`` .. ``offset + nbytes`` of the buffer ``token`` (from
    the network) names in the exposing process.

    Raises:
        ValueError: the token is malformed (not :data:`TOKEN`'s size, a zero address for
            a non-empty buffer), or the range is outside the buffer.
    """
    if len(token) != TOKEN.size:
        raise ValueError(f"a token of {len(token)} bytes, not {TOKEN.size}")
    base, length = TOKEN.unpack(token)
    if offset < 0 or nbytes < 0 or offset + nbytes > length:
        raise ValueError(
            f"bytes {offset}..{offset + nbytes} are outside the exposed {length} bytes"
        )
    if not base and length:
        raise ValueError("a token without an address")
    return int(base) + offset


def pull(pid: int, dst: memoryview, src: int) -> None:
    """Copy ``len(dst)`` bytes from address ``src`` of process ``pid`` into ``dst``.

    Raises:
        ProcessLookupError: the process is gone.
        PermissionError: this process may not read that one's memory.
        OSError: the range is not mapped in that process (EFAULT), or pulls are
            unavailable here (ENOSYS).
    """
    fn = _readv
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    n = len(dst)
    base = address(dst)
    done = 0
    while done < n:
        local = _IoVec(base + done, n - done)
        remote = _IoVec(src + done, n - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ESRCH:
                raise ProcessLookupError(err, f"process {pid} is gone")
            if err == errno.EPERM:
                raise PermissionError(err, f"may not read the memory of process {pid}")
            raise OSError(
                err, f"process_vm_readv from process {pid} at {src + done:#x}: {os.strerror(err)}"
            )
        if got == 0:
            raise OSError(errno.EFAULT, f"process {pid} does not map {src + done:#x}")
        done += got


def probe(pid: int, src: int, expect: bytes) -> str | None:
    """Read ``len(expect)`` bytes at ``src`` in process ``pid`` and compare them with
    ``expect``. Returns None when that works, else why pulls cannot be used."""
    if not enabled():
        return "single-copy pulls are off (process_vm_readv missing or AIOCOLLECT_SHM_PULL=0)"
    got = bytearray(len(expect))
    try:
        pull(pid, memoryview(got), src)
    except OSError as exc:
        return f"process_vm_readv from process {pid} failed: {exc}"
    if bytes(got) != expect:
        return f"process {pid} does not hold the announced bytes at {src:#x}"
    return None


def self_check() -> str | None:
    """Why this process cannot pull (see :func:`probe`), tried on its own memory; None when
    it can. Another process may still be forbidden (Yama, see :func:`status`)."""
    token = b"aiocollect-cma-probe"
    return probe(os.getpid(), address(token), token)


def status() -> str:
    """One line for ``aiocollect info``: whether ranks on this host will pull, and why not.
    (Each link still probes its own peer; this only checks this process and the policy.)"""
    limit = threshold()
    if limit == 0:
        return "off (AIOCOLLECT_SHM_PULL=0, or no process_vm_readv on this platform)"
    why = self_check()
    if why is not None:
        return f"off: {why}; links copy through the ring"
    try:
        with open(YAMA) as f:
            scope = f.read().strip()
    except OSError:
        scope = ""
    if scope not in ("", "0"):
        return (
            f"off between ranks: Yama ptrace_scope={scope} forbids reading a sibling "
            "process's memory; links copy through the ring"
        )
    return f"on for payloads of {limit} bytes or more"
