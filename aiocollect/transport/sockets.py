"""Socket options of stream links: the kernel's socket buffer sizes, whether a peer is on
this host, and who is at the other end of a Unix socket.

What lies in the kernel's socket buffers is ahead of a small frame, and user space cannot
reorder it: plain TCP links to processes on this host ask for ``LOCAL_SOCKET_BUFFER``
(1 MiB) per buffer, TLS links and links to other hosts for ``SOCKET_BUFFER`` (4 MiB), and
``AIOCOLLECT_SOCKET_BUFFER`` overrides both (:func:`socket_buffer`).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Mapping

log = logging.getLogger("aiocollect.transport.tcp")

#: Kernel socket buffer (SO_SNDBUF and SO_RCVBUF, which Linux doubles) of a link to another
#: host: enough bytes in flight for a LAN's round trip.
SOCKET_BUFFER = 4 * 1024 * 1024
#: The same for a plain TCP link to a process on this host (loopback, or this host's own
#: address; TLS links keep ``SOCKET_BUFFER``). Everything in these buffers lies ahead of a
#: small frame sent behind bulk frames and drains at the receiver's pace, so they are kept
#: small: 1 MiB measured no slower than 4 MiB for bulk and took the round trip behind
#: 64 MiB allreduces from 9-13 ms to 6 ms at p99 (``python -m aiocollect.bench.hol -n 2
#: --transport tcp --size 64M`` with ``AIOCOLLECT_SOCKET_BUFFER`` set to each size).
LOCAL_SOCKET_BUFFER = 1024 * 1024
#: Overrides both (bytes; 0 leaves the buffers to the kernel's autotuning).
SOCKET_BUFFER_ENV = "AIOCOLLECT_SOCKET_BUFFER"
#: The smallest override taken as given: with 4 and 8 KiB, several operations in flight
#: over loopback stopped for good (the receive window, against a 64 KiB MSS, never
#: reopened: ``tests/transport/test_socket_buffer.py``); 16 KiB and up did not.
MIN_SOCKET_BUFFER = 64 * 1024


class Screened(Exception):
    """An accepted connection refused by the listener's screen (which logged it)."""


#: AIOCOLLECT_SOCKET_BUFFER values already warned about (:func:`socket_buffer`).
_WARNED: set[str] = set()


def socket_buffer(
    local: bool | None, tls: bool = False, env: Mapping[str, str] | None = None
) -> int:
    """Bytes to ask the kernel for as each socket buffer of a TCP link (0: leave them to
    its autotuning): ``AIOCOLLECT_SOCKET_BUFFER`` (in ``env``, default ``os.environ``) if
    set, else :data:`LOCAL_SOCKET_BUFFER` for a plain TCP link to this host (``local``)
    and :data:`SOCKET_BUFFER` otherwise. TLS links keep the larger buffers: their bytes
    drain at the receiver's decryption rate whatever the buffer holds, and the smaller one
    measured no better for a small frame there (``python -m aiocollect.bench.hol -n 2
    --transport tls``). A value that is not a non-negative integer is ignored, with a warning the
    first time."""
    raw = (os.environ if env is None else env).get(SOCKET_BUFFER_ENV, "").strip()
    if not raw.isdecimal():
        if raw:
            _warn_once(raw, f"ignoring {SOCKET_BUFFER_ENV}={raw!r}: not a number of bytes")
        return LOCAL_SOCKET_BUFFER if local and not tls else SOCKET_BUFFER
    size = int(raw)
    if 0 < size < MIN_SOCKET_BUFFER:
        _warn_once(
            raw,
            f"{SOCKET_BUFFER_ENV}={raw} raised to {MIN_SOCKET_BUFFER} bytes: smaller socket "
            "buffers can stall TCP on this host for good (loopback's receive window does "
            "not reopen)",
        )
        return MIN_SOCKET_BUFFER
    return size


def _warn_once(raw: str, message: str) -> None:
    """Log ``message`` the first time ``raw`` (an AIOCOLLECT_SOCKET_BUFFER value) comes:
    every link asks, one warning per value is enough."""
    if raw not in _WARNED:
        _WARNED.add(raw)
        log.warning("%s", message)


def unix_peer_pid(sock: socket.socket) -> int | None:
    """The process id of a Unix socket's peer, where the kernel says (``SO_PEERCRED``;
    None where it does not)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = int(struct.unpack("3i", creds)[0])
    except (OSError, struct.error, AttributeError):
        return None
    return pid if pid > 0 else None


def is_local(peername: object, sockname: object) -> bool | None:
    """Whether the peer at ``peername`` of a socket bound to ``sockname`` is a process on
    this host: True when the two ends have the same address (loopback included), False
    for another host's; None when they are not IP addresses (the link is not a network
    socket)."""
    if not isinstance(peername, tuple) or not isinstance(sockname, tuple):
        return None
    peer = peername[0]
    return bool(peer == sockname[0] or str(peer).startswith("127.") or peer == "::1")
