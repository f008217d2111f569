"""An example one-sided link, registered by the tests only: the in-process memory link
with ``expose`` / ``read_exposed`` through a table of exposures keyed by token.

It is what giving a transport one-sided reads takes (docs/design.md, "Adding a one-sided
transport"): a link that declares ``reads`` and ``exposes`` in its ``caps`` and implements
the three methods of the seam (transport/base.py, ``Link.expose``), and a listener whose
record declares the reach of its reads (:func:`aiocollect.transport.onesided.fields`), so
that rendezvous predicts reads and the automatic choice takes the pull algorithms. Its
tokens are an exposure number and length; the exposing link keeps the exposed views in a
table, which the peer's link (on the same thread) reads from, so every token is checked:
unknown, ended and out-of-range ones are ProtocolErrors, like an RDMA NIC's remote access
errors. An RDMA link would register the buffer in ``expose`` (the token: address, length
and remote key), post an RDMA READ in ``read_exposed`` and wait for its completion, and
deregister in ``unexpose``.
"""

from __future__ import annotations

import itertools
import struct

from aiocollect.errors import PeerDisconnected, ProtocolError
from aiocollect.transport import onesided
from aiocollect.transport.base import Handshaker, LinkCaps, LinkEvents
from aiocollect.transport.interface import LinkSetup, Listener, Transport
from aiocollect.transport.memory import MemoryLink, MemoryListener

#: The token: the exposure's number on the exposing link, and its length.
TOKEN = struct.Struct("<QQ")
#: What these links can do: the in-process link's, and one-sided reads both ways.
CAPS = LinkCaps(same_thread=True, reads=True, exposes=True)


class OneSidedLink(MemoryLink):
    """An in-process link whose peer reads what it exposes."""

    exposure_end_checked = True

    def __init__(self, events: LinkEvents, max_frame: int, handshaker: Handshaker) -> None:
        super().__init__(events, max_frame, handshaker)
        #: Live exposures by number: what the peer may read.
        self.exposures: dict[int, memoryview] = {}
        self._numbers = itertools.count(1)
        #: Bytes read from the peer (what the tests check the pull algorithms used).
        self.bytes_read = 0

    @property
    def caps(self) -> LinkCaps:
        return CAPS

    def expose(self, buf: memoryview) -> bytes:
        number = next(self._numbers)
        self.exposures[number] = buf
        return TOKEN.pack(number, len(buf))

    def unexpose(self, token: bytes) -> None:
        if len(token) == TOKEN.size:
            self.exposures.pop(TOKEN.unpack(token)[0], None)

    def read_exposed(self, token: bytes, offset: int, into: memoryview) -> None:
        other = self.other
        if self.closed or not isinstance(other, OneSidedLink) or other.closed:
            raise self.failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        why = _check(other.exposures, token, offset, len(into))
        if why is not None:
            err = ProtocolError(f"{self.describe()} sent a bad one-sided token: {why}")
            self._raise_error(err)
            raise err
        number, _ = TOKEN.unpack(token)
        into[:] = other.exposures[number][offset : offset + len(into)]
        self.bytes_read += len(into)

    def _shutdown(self) -> None:
        self.exposures.clear()  # (a closed link's exposures end with it)
        super()._shutdown()


def _check(exposures: dict[int, memoryview], token: bytes, offset: int, nbytes: int) -> str | None:
    """Why reading ``nbytes`` from ``offset`` of ``token`` is refused, or None."""
    if len(token) != TOKEN.size:
        return f"{len(token)} bytes, not {TOKEN.size}"
    number, length = TOKEN.unpack(token)
    buf = exposures.get(number)
    if buf is None or len(buf) != length:
        return f"exposure {number} is not (or no longer) exposed"
    if offset < 0 or nbytes < 0 or offset + nbytes > length:
        return f"bytes {offset}..{offset + nbytes} are outside the exposed {length} bytes"
    return None


class OneSidedListener(MemoryListener):
    """The in-process listener, making one-sided links; its record says they read every
    peer (:data:`aiocollect.transport.onesided.ANY`)."""

    transport = "memory-onesided"
    link_type = OneSidedLink

    def __init__(self, setup: LinkSetup) -> None:
        super().__init__(setup)
        self.record.update(onesided.fields(onesided.ANY))


class OneSidedTransport(Transport):
    """``memory-onesided``: ranks of one process, one event loop, reading each other."""

    name = OneSidedListener.transport
    in_process = True

    async def listen(self, setup: LinkSetup) -> Listener:
        return OneSidedListener(setup)


ONE_SIDED = OneSidedTransport()
