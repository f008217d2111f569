"""The peer handshake over a byte stream (sans-IO): each message a u32 length, then that
many bytes of a msgpack map (at most ``wire.MAX_HANDSHAKE``).

Any link that carries bytes runs its :class:`~aiocollect.transport.base.Handshaker` through
:class:`HandshakeStream` before its first frame: TCP and TLS, shared memory (whose
handshake runs on its doorbell socket), and a transport whose bootstrap is a stream of its
own (an RDMA transport exchanging queue pair numbers, docs/design.md). The link hands it
what it reads and gives it a function to write with; it never reads past the last
handshake message, so the next byte read is the first of the frames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from aiocollect.errors import ProtocolError
from aiocollect.transport.base import Handshaker, Rejection
from aiocollect.transport.wire import LENGTH_PREFIX, MAX_HANDSHAKE


def pack(msg: dict[str, Any]) -> bytes:
    """One handshake message as it goes on the stream: its length, then its msgpack."""
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return LENGTH_PREFIX.pack(len(data)) + data


class HandshakeStream:
    """Runs ``handshaker`` over a byte stream written with ``write``.

    Reading: put the next bytes read into :meth:`buffer` (never more than its length), then
    call :meth:`received` with their count."""

    def __init__(self, handshaker: Handshaker, write: Callable[[bytes], None]) -> None:
        self.handshaker = handshaker
        self._write = write
        self._buf = bytearray(LENGTH_PREFIX.size)
        self._got = 0
        self._length: int | None = None  # of the message being read, once its prefix is in

    def start(self) -> None:
        """Send the handshaker's opening messages.

        Raises:
            what the handshaker raises.
        """
        for msg in self.handshaker.start():
            self.send(msg)

    def send(self, msg: dict[str, Any]) -> None:
        """Write one handshake message (a reply, or a listener's own refusal)."""
        self._write(pack(msg))

    def buffer(self) -> memoryview:
        """Where the next bytes read go: the rest of the current prefix or message."""
        return memoryview(self._buf)[self._got :]

    def received(self, nbytes: int) -> int | None:
        """``nbytes`` were read into :meth:`buffer`. Returns the peer's rank once the
        handshake is complete, else None.

        Raises:
            ProtocolError: a message too large, or not a map. ValueError or
            msgpack.ExtraData: a message that is not msgpack. What the handshaker raises
            (a :class:`Rejection`'s reply is sent first, then its error raised).
        """
        self._got += nbytes
        if self._got < len(self._buf):
            return None
        self._got = 0
        if self._length is None:
            (n,) = LENGTH_PREFIX.unpack(self._buf)
            if n > MAX_HANDSHAKE:
                raise ProtocolError(f"handshake message of {n} bytes")
            self._length = n
            self._buf = bytearray(n)
            if n:
                return None
        raw = bytes(self._buf)
        self._length = None
        self._buf = bytearray(LENGTH_PREFIX.size)
        msg = msgpack.unpackb(raw, raw=False)
        if not isinstance(msg, dict):
            raise ProtocolError("handshake message is not a map")
        try:
            replies, peer = self.handshaker.on_message(msg)
        except Rejection as rej:
            self.send(rej.reply)
            raise rej.error from None
        for reply in replies:
            self.send(reply)
        return peer
