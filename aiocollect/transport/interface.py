"""What a transport gives rendezvous: :class:`Transport` (one per name in
:mod:`aiocollect.transport.registry`) and the :class:`Listener` it opens for one rank.

Rendezvous is transport-agnostic. For each rank it calls ``transport.listen(setup)``,
publishes ``listener.record`` (merged into the rank's rendezvous record, next to its rank,
host identity and settings), reads every other rank's record, hands them all to
``listener.prepare`` (which may refuse the group, or size itself by them), and then calls
``listener.connect(record, handshaker)`` for every lower rank; the higher ranks' links
reach ``setup.on_link`` from the listener. It never looks inside a record beyond the
``"transport"`` field, which names what the listener speaks (ranks whose listeners speak
different things cannot link, e.g. TLS and plain TCP, and the group fails to form).

The listener, not the transport, connects because it holds the rank's own state that its
links share (the shared-memory policy, sized once every record is known): the transport
is a stateless description, like gloo's transport, and the listener its per-rank device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiocollect.tls import TLSConfig
from aiocollect.transport.base import Handshaker, Link, LinkEvents

#: A rendezvous record as published and read back (msgpack-able values only).
Record = dict[str, Any]

#: Given an accepted connection's peer and local addresses (as the socket layer reports
#: them): None to go on with the handshake, or a handshake message (a reject) to send
#: before closing it. Rendezvous sets one in protected mode (no secret).
Screen = Callable[[Any, Any], "dict[str, Any] | None"]


@dataclass
class LinkSetup:
    """What one rank's listener and links need, filled in by rendezvous."""

    #: This rank's world rank (named in error messages).
    rank: int
    events: LinkEvents
    max_frame: int
    #: The address to listen on (socket transports).
    host: str
    #: A new acceptor handshaker for each incoming connection.
    acceptor: Callable[[], Handshaker]
    #: Called with each incoming link once its handshake succeeded.
    on_link: Callable[[Link], None]
    #: TLS contexts, for transports with ``needs_tls``.
    tls: TLSConfig | None = None
    #: Screens incoming connections before their handshake (protected mode), or None.
    screen: Screen | None = None
    #: The listen backlog (the kernel caps it at net.core.somaxconn): the group's size,
    #: since with links on demand every peer may connect at once, and a full backlog drops
    #: SYNs (a second's retransmission each). Not more: where accept runs out of
    #: descriptors, asyncio retries it up to this many times per wake-up, logging each.
    backlog: int = 100


class Listener(abc.ABC):
    """One rank's end of a transport: accepts the higher ranks, connects to the lower."""

    #: What to publish (merged into the rank's record): ``"transport"`` (what the listener
    #: speaks) and the transport's own fields (its address, for instance).
    record: Record

    def prepare(self, peers: Mapping[int, Record]) -> None:  # noqa: B027 - optional
        """Every rank's record (this rank's included), read before the first connect:
        check that this transport can link to each (raise RendezvousError, naming the
        rank, if not) and size shared state by them. In a group that forms through a
        digest (aiocollect.rendezvous.digest) a record not read is a stand-in: the fields
        every rank's record shares, and its host's identity where it is this rank's.

        Raises:
            RendezvousError: a peer this transport cannot link to.
        """

    @abc.abstractmethod
    async def connect(self, record: Record, handshaker: Handshaker) -> Link:
        """Link to the rank that published ``record`` and run ``handshaker`` over it.

        Raises:
            RendezvousError: the peer cannot be reached or refused the link (named).
            AuthenticationError: a party failed to prove the shared secret.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting; links already made stay up, handshakes in progress end."""


class Transport(abc.ABC):
    """A way of linking ranks, registered under ``name``."""

    name: str
    #: Needs ``ssl=`` (TLS contexts) from open_group.
    needs_tls: bool = False
    #: Links only ranks of one process (not offered by ``aiocollect run`` and ``bench``).
    in_process: bool = False

    def unavailable(self) -> str | None:
        """Why this transport cannot be used here, or None when it can."""
        return None

    def details(self) -> str | None:
        """A line for ``aiocollect info`` when available (a version, a mode), or None."""
        return None

    def accepts(self, record: Record) -> bool:
        """Whether this transport can link this rank to the rank that published
        ``record`` (``auto``'s per-link choice asks it)."""
        return bool(record.get("transport") == self.name)

    @abc.abstractmethod
    async def listen(self, setup: LinkSetup) -> Listener:
        """Start this rank's listener.

        Raises:
            OSError: it cannot listen (e.g. the address is not this host's).
        """
