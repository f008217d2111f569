"""The shared-memory transports (``shm`` and ``auto``) and their listener: TCP and Unix
socket connections whose links move to shared memory during their handshake
(:class:`~aiocollect.transport.shm.ShmLink`), per-rank spin and ring settings once every
rank's record is known, and the checks ``transport="shm"`` makes of its peers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from aiocollect.errors import RendezvousError
from aiocollect.transport import cma, host, onesided, shm_ring, unix
from aiocollect.transport.base import Handshaker
from aiocollect.transport.interface import LinkSetup, Listener, Record, Transport
from aiocollect.transport.shm import ShmLink
from aiocollect.transport.shm_reader import ShmPolicy, spin_budget
from aiocollect.transport.tcp import StreamLink
from aiocollect.transport.tcp_link import TcpLink
from aiocollect.transport.tcp_listener import SocketListener

log = logging.getLogger("aiocollect.transport.shm")


class ShmListener(SocketListener):
    """A TCP listener whose links move to shared memory during their handshake.

    ``mode`` (published as the record's ``shm``): ``force`` (``transport="shm"``: every
    link, or the group fails to form), ``auto`` (links to ranks on this host whose mode is
    not ``off``; the others, and any whose upgrade fails, stay on TCP) or ``off`` (shared
    memory does not work here: plain TCP links, and peers do not ask for it)."""

    offers_lanes = False  # (its links are shared-memory links, on one socket each)

    def __init__(self, setup: LinkSetup, mode: str) -> None:
        super().__init__(setup, "tcp")
        self.mode = mode
        self._unix_server: asyncio.Server | None = None
        self.policy = ShmPolicy()
        self.record["shm"] = mode
        #: Whether this rank's links to the ranks on its host read one-sided: the group's
        #: default chunk size and algorithms depend on every rank's (transport.onesided).
        pulls = mode != "off" and self.policy.pull_min > 0
        self.record.update(onesided.fields(onesided.HOST if pulls else None))

    async def serve(self, factory: Callable[[], StreamLink]) -> asyncio.Server:
        """TCP as any socket listener, and an abstract Unix socket for the ranks on this
        host (its name in the record's ``unix``; :mod:`aiocollect.transport.unix`)."""
        server = await super().serve(factory)
        if unix.enabled():
            try:
                self._unix_server, self.record["unix"] = await unix.serve(factory)
            except OSError as exc:  # (no Unix sockets here: TCP it is)
                log.debug("no Unix socket for rank %d: %s", self.setup.rank, exc)
        return server

    async def dial(self, record: Record, link: StreamLink) -> None:
        """Over the peer's Unix socket when it runs on this host and offers one (and this
        rank may use them), else, or when that fails, over TCP.

        Raises:
            OSError: the TCP connection failed too.
        """
        name = record.get("unix")
        if unix.valid_name(name) and unix.enabled() and host.same_host(record):
            assert isinstance(name, str)
            try:
                await unix.dial(name, lambda: link)
                return
            except OSError as exc:  # e.g. another network namespace: TCP instead
                log.debug(
                    "rank %d: no Unix socket to rank %s (%s), using TCP",
                    self.setup.rank,
                    record.get("rank"),
                    exc,
                )
        await super().dial(record, link)

    def close(self) -> None:
        server, self._unix_server = self._unix_server, None
        if server is not None:
            server.close()
        super().close()

    def make_link(self, handshaker: Handshaker, record: Record | None) -> StreamLink:
        setup, mode = self.setup, self.mode
        if mode == "off" or (record is not None and not SHM.accepts(record)):
            return TcpLink(setup.events, setup.max_frame, handshaker)
        return ShmLink(
            setup.events,
            setup.max_frame,
            handshaker,
            role="acceptor" if record is None else "connector",
            required=mode == "force",
            policy=self.policy,
        )

    def prepare(self, peers: Mapping[int, Record]) -> None:
        if self.mode == "force":
            self._check_peers(peers)
        local = sum(1 for rec in peers.values() if host.same_host(rec))
        self.policy.spin = spin_budget(local)
        self.policy.capacity = shm_ring.configured_capacity(local)

    def _check_peers(self, peers: Mapping[int, Record]) -> None:
        rank = self.setup.rank
        reason = shm_ring.unavailable()
        if reason is not None:
            raise RendezvousError(f"rank {rank}: transport='shm' is unavailable: {reason}")
        me = host.identity()
        for r, rec in peers.items():
            if r == rank:
                continue
            if not host.same_host(rec):
                raise RendezvousError(
                    f"transport='shm' needs every rank on one host: rank {r} runs on "
                    f"{rec.get('hostname')!r} (boot id {rec.get('boot_id')!r}), rank {rank} "
                    f"on {me['hostname']!r} (boot id {me['boot_id']!r}); use "
                    "transport='auto'"
                )
            if rec.get("shm", "off") == "off":
                raise RendezvousError(
                    f"rank {r} does not use shared memory but rank {rank} has "
                    f"transport='shm'; give every rank the same transport"
                )


class ShmTransport(Transport):
    """``shm`` (``required``): shared memory for every link. ``auto``: shared memory to the
    ranks this transport accepts (same host, shared memory on there too) where it works
    here, TCP to the others and where the upgrade fails; one group may mix both."""

    def __init__(self, name: str, required: bool) -> None:
        self.name = name
        self.required = required

    def unavailable(self) -> str | None:
        return shm_ring.unavailable() if self.required else None

    def details(self) -> str | None:
        socket = unix.describe()
        if not self.required:
            why = shm_ring.unavailable()
            return "tcp only: " + why if why else f"shm on one host (over {socket}), else tcp"
        return f"single-copy pulls {cma.status()}; over {socket}"

    def accepts(self, record: Record) -> bool:
        return host.same_host(record) and record.get("shm", "off") != "off"

    async def listen(self, setup: LinkSetup) -> Listener:
        mode = "auto" if shm_ring.unavailable() is None else "off"
        listener = ShmListener(setup, "force" if self.required else mode)
        await listener.start()
        return listener


SHM = ShmTransport("shm", required=True)
AUTO = ShmTransport("auto", required=False)
