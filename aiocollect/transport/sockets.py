"""Socket options of stream links: the kernel's socket buffer sizes, whether a peer is on
this host, who is at the other end of a Unix socket, and whether another host still
acknowledges what is sent to it.

What lies in the kernel's socket buffers is ahead of a small frame, and user space cannot
reorder it: plain TCP links to processes on this host ask for ``LOCAL_SOCKET_BUFFER``
(1 MiB) per buffer, TLS links and links to other hosts for ``SOCKET_BUFFER`` (4 MiB), and
``AIOCOLLECT_SOCKET_BUFFER`` overrides both (:func:`socket_buffer`).
"""

from __future__ import annotations

import logging
import math
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
#: Seconds a link to another host may wait for its host's acknowledgement (of data in
#: flight, of a window probe or of a keep-alive) before the engine declares that host
#: unreachable (``engine/liveness.py``); the kernel's keep-alives on the link are sized
#: from it (:func:`keep_alive`). A host that vanishes (power loss, pulled cable: no FIN,
#: no RST) is found in about this long plus a second.
LINK_SILENCE = 3.0
#: Overrides it (seconds; 0 turns both the keep-alives and the engine's check off).
LINK_SILENCE_ENV = "AIOCOLLECT_LINK_SILENCE"
#: The smallest override taken as given: a live host whose process stopped reading can
#: leave a window probe unanswered for about 1.4 s (Linux answers such probes at most
#: every 0.5 s, ``net.ipv4.tcp_invalid_ratelimit``, and the first ones come faster).
MIN_LINK_SILENCE = 2.0
#: The prefix of ``struct tcp_info`` up to ``tcpi_last_ack_recv`` (linux/tcp.h): eight u8
#: (state, ca_state, retransmits, probes, backoff, options, wscales, flags), then u32s
#: (rto, ato, snd_mss, rcv_mss, unacked, sacked, lost, retrans, fackets, last_data_sent,
#: last_ack_sent, last_data_recv, last_ack_recv).
_TCP_INFO = struct.Struct("8B13I")
#: The largest TCP_KEEPCNT and TCP_KEEPIDLE Linux takes.
_KEEPCNT_MAX = 127
_KEEPIDLE_MAX = 32767
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


def link_silence(env: Mapping[str, str] | None = None) -> float:
    """Seconds of silence after which another host counts as unreachable:
    ``AIOCOLLECT_LINK_SILENCE`` (in ``env``, default ``os.environ``) if set, else
    :data:`LINK_SILENCE`; 0 where checks are off. A value that is not a non-negative
    number is ignored, and one under :data:`MIN_LINK_SILENCE` raised to it, with a
    warning the first time."""
    raw = (os.environ if env is None else env).get(LINK_SILENCE_ENV, "").strip()
    if not raw:
        return LINK_SILENCE
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        _warn_once(
            f"{LINK_SILENCE_ENV}={raw}",
            f"ignoring {LINK_SILENCE_ENV}={raw!r}: not a number of seconds",
        )
        return LINK_SILENCE
    if 0 < value < MIN_LINK_SILENCE:
        _warn_once(
            f"{LINK_SILENCE_ENV}={raw}",
            f"{LINK_SILENCE_ENV}={raw} raised to {MIN_LINK_SILENCE:g} s: a live host's "
            "answers to window probes can be further apart",
        )
        return MIN_LINK_SILENCE
    return value


def keep_alive(sock: socket.socket, silence: float) -> bool:
    """Have the kernel probe ``sock``'s peer host while the connection is idle: the first
    keep-alive after ``silence / 2`` s without a packet from it (at least 1 s), then one a
    second (at most 127, Linux's limit: the first comes later for a long silence); the
    kernel resets the connection (ETIMEDOUT) about ``silence + 1`` s after the last
    packet if none was answered. A live host's kernel answers whatever its
    process does (frozen, busy, not reading), so only a host that is gone or cut off
    fails. ``TCP_USER_TIMEOUT`` is not used: on Linux it also resets a connection whose
    live peer has not read for that long (its receive window closed).

    Args:
        sock: a connected TCP socket (or the event loop's wrapper of one).
        silence: :func:`link_silence`; 0 sets nothing.

    Returns:
        Whether the options were set (False: ``silence`` is 0, or the socket refused).
    """
    if silence <= 0:
        return False
    idle = max(1, math.ceil(silence / 2))
    count = min(_KEEPCNT_MAX, max(1, math.ceil(silence + 1 - idle)))
    idle = min(_KEEPIDLE_MAX, max(idle, math.ceil(silence + 1 - count)))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    except (OSError, AttributeError):  # (not Linux, or the socket is gone)
        return False
    return True


def unanswered(sock: socket.socket) -> float:
    """Seconds since ``sock``'s peer host last acknowledged anything, where something
    waits for its acknowledgement now (data in flight, or a window or keep-alive probe
    not answered); 0.0 where nothing waits, or the kernel does not say. A live host whose
    process does not read answers the window probes: its silence stays 0 while it does.

    Args:
        sock: a connected TCP socket (or the event loop's wrapper of one).
    """
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
        fields = _TCP_INFO.unpack_from(info)
    except (OSError, AttributeError, struct.error):
        return 0.0
    probes, unacked, last_ack_ms = fields[3], fields[12], fields[20]
    return last_ack_ms / 1000 if probes or unacked else 0.0


def _warn_once(raw: str, message: str) -> None:
    """Log ``message`` the first time ``raw`` (an AIOCOLLECT_SOCKET_BUFFER value, or a
    setting's name and value) comes: every link asks, one warning per value is enough."""
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
