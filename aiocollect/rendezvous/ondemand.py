"""A rank's links to its peers, made when the group forms and on demand afterwards.

:class:`Dialer` admits incoming links (the acceptor handshake's ``admit``), connects to a
peer when asked (:meth:`Dialer.dial`), and hands every link made to its owner
(``deliver``: the rendezvous's table while the group forms, the fabric's afterwards).

Either rank of a pair may need the link first, and both may connect at once. The higher
rank's connection stands: a rank refuses a connection from a lower rank while its own
connection to that rank is under way, and either refusal (that one, or "already linked")
tells the connecting rank to wait for the link its peer makes instead (both see one link).
A connect retries within its deadline when the connection is refused or reset (the peer's
listener backlog was full), at most ``CONNECTS`` at a time per rank, and a rank waiting
for its peer's connection waits no longer than its own deadline. A connect that finds
this process out of descriptors fails at once, with a message naming the limit, the links
open and what to do (``_fdlimit.links_exhausted``).

A TCP link gets its small-frame lane (transport/tcp_link.py) where both ranks' records
offer lanes (``"lanes": 2``, transport/tcp_listener.py), from the rank that connected it,
once the link first carries bulk (:meth:`TcpLink.arm_lane`: that rank sends, or reads, a
frame of ``BULK_MIN`` bytes or more): that rank connects again with a lane's hello (the
link carries every frame until its lane is up), where its process has a descriptor to
spare (``_fdlimit.reserve_lane``); the peer admits a lane only from a rank it has a link
to, while it has a descriptor to spare too, and hands it to that link once the connecting
rank has made it the link's lane (:meth:`Dialer.admit_lane`, :meth:`Dialer.on_link`; the
handshake's ``attached``). Lane connects take ``CONNECTS`` slots of their own (a pair's
lane doubles its connects: without the bound, the listeners' backlogs overflow when many
pairs start bulk at once, as an alltoall of large blocks over links on demand makes
them), and a lane's ``LANE_TIMEOUT`` counts from its slot. A rank whose links take lanes
keeps its listener open with the group (rendezvous.py). A lane that cannot be made, or is
given up while it is set up (on either rank), leaves the link on its one connection; the
rank that dialed it says so at DEBUG.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine

from aiocollect import _fdlimit
from aiocollect._deadline import Deadline
from aiocollect.errors import PeerDisconnected, PeerTimeout, RendezvousError
from aiocollect.rendezvous.handshake import ConnectorHandshake
from aiocollect.rendezvous.records import Known, Records
from aiocollect.transport.base import Link, Superseded
from aiocollect.transport.interface import Listener
from aiocollect.transport.tcp import StreamLink
from aiocollect.transport.tcp_link import TcpLink
from aiocollect.transport.tcp_listener import SocketListener

log = logging.getLogger("aiocollect.rendezvous")

#: Connects (with their handshakes) one rank runs at a time: beyond this the peers'
#: backlogs overflow and SYNs are dropped (a second's retransmission each).
CONNECTS = 64
#: The first pause before a refused or reset connect is retried (doubling up to
#: ``RETRY_MAX``).
RETRY_FIRST = 0.01
RETRY_MAX = 0.5
#: The words of a refusal that means "use the link your peer is making".
STANDS = "the peer's own link stands"
#: Seconds a rank's connect of a small-frame lane may take (handshake included), from
#: when it got its slot.
LANE_TIMEOUT = 30.0


class Dialer:
    """The links of rank ``rank`` of group ``name`` (``world_size`` ranks, job ``job``).

    Args:
        rank: this rank.
        world_size: the group's size.
        name: the group's name (handshakes check it).
        secret: the shared secret, or None.
        job: the job's nonce (handshakes check it).
        deliver: called with each link made (by either side), once per peer.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        name: str,
        secret: bytes | None,
        job: bytes,
        deliver: Callable[[Link], None],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.secret = secret
        self.job = job
        self.deliver = deliver
        #: The listener (connects go through it) and the ranks' records, once the group's
        #: are read (a peer's is fetched before its first connect, where it is not there).
        self.listener: Listener | None = None
        self.records: Known = Records({})
        #: Peers linked (by either side) with their links, connecting to, and admitted by
        #: this rank.
        self.linked: dict[int, Link] = {}
        self._outgoing: set[int] = set()
        self._incoming: set[int] = set()
        #: This rank's lane connects (which :meth:`refuse` cancels too: a lane given up
        #: while it is set up leaves its link as it was).
        self._lane_tasks: set[asyncio.Task[None]] = set()
        self._waiters: dict[int, asyncio.Future[Link]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(CONNECTS)
        self._lane_slots = asyncio.Semaphore(CONNECTS)
        #: Why no more links are made (the group closed or broke), or None.
        self.refusing: str | None = None

    # -- the listener's side ---------------------------------------------------------------

    def admit(self, peer: int) -> str | RendezvousError | None:
        """The acceptor handshake's check of a connecting ``peer``: None to go on, else
        why the link is refused."""
        if self.refusing is not None:
            return self.refusing
        if peer in self.linked:
            return Superseded(f"rank {peer} is already linked to rank {self.rank} ({STANDS})")
        if peer in self._outgoing and peer < self.rank:
            return Superseded(f"rank {self.rank} is connecting to rank {peer} ({STANDS})")
        self._incoming.add(peer)
        return None

    def admit_lane(self, peer: int) -> str | RendezvousError | None:
        """The acceptor handshake's check of a small-frame lane from ``peer``: admitted
        only for a TCP link to it that has none yet, while this process has a descriptor
        to spare for it (:func:`_fdlimit.lane_fits`; refusals are quiet: the link goes on
        without a lane)."""
        link = self.linked.get(peer)
        if (
            self.refusing is not None
            or not isinstance(link, TcpLink)
            or not link.wants_lane()
            or not _fdlimit.lane_fits()
        ):
            return Superseded(f"rank {self.rank} takes no small-frame lane from rank {peer}")
        return None

    def on_link(self, link: Link) -> None:
        """A link whose handshake succeeded (accepted or connected), or an accepted
        small-frame lane (handed to its link)."""
        peer = link.peer
        if isinstance(link, StreamLink) and link.is_lane:
            owner = self.linked.get(peer)
            taken = False
            if isinstance(owner, TcpLink):
                taken = owner.take_lane(link)
            if not taken:
                link.abort()
            return
        self._incoming.discard(peer)
        if self.refusing is not None or peer in self.linked:
            link.abort()
            return
        self.linked[peer] = link
        self.deliver(link)
        fut = self._waiters.pop(peer, None)
        if fut is not None and not fut.done():
            fut.set_result(link)

    # -- connecting ------------------------------------------------------------------------

    def start(self, peer: int, deadline: Deadline) -> asyncio.Future[Link]:
        """Make sure a link to ``peer`` is on its way (connecting unless this rank already
        is, or was asked by the peer) and return the future of that link. The future fails
        with RendezvousError where the connect fails for good; it never times out (the
        caller's wait does). A peer already linked (its link may have arrived after the
        caller looked, while its connect was on its way to the loop) gets its link at
        once: a connect would be refused as "already linked" and nothing would arrive."""
        made = self.linked.get(peer)
        if made is not None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(made)
            return done
        fut = self._waiters.get(peer)
        if fut is None:
            fut = self._waiters[peer] = asyncio.get_running_loop().create_future()
            # (its failure is raised to whoever waits; unawaited, it is no bug to report)
            fut.add_done_callback(_retrieve)
        if peer not in self._outgoing and peer not in self._incoming:
            self._outgoing.add(peer)
            self._spawn(self._connect(peer, deadline))
        return fut

    def _spawn(
        self, coro: Coroutine[None, None, None], tasks: set[asyncio.Task[None]] | None = None
    ) -> asyncio.Task[None]:
        """Run ``coro`` as a task kept in ``tasks`` (default: the connects, which
        :meth:`refuse` cancels) until it ends; returns the task."""
        kept = self._tasks if tasks is None else tasks
        task = asyncio.ensure_future(coro)
        kept.add(task)
        task.add_done_callback(kept.discard)
        return task

    async def dial(self, peer: int, deadline: Deadline) -> Link:
        """The link to world rank ``peer``, connected now if there is none yet.

        Raises:
            PeerTimeout: no link before ``deadline`` (naming the peer).
            PeerDisconnected: the peer could not be reached or refused the link, or no more
                links are made (the group closed or broke).
        """
        if self.refusing is not None:
            raise PeerDisconnected(
                f"rank {self.rank} makes no more links: {self.refusing}", rank=peer
            )
        fut = self.start(peer, deadline)
        try:
            async with asyncio.timeout(deadline.remaining()):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise PeerTimeout(
                f"rank {self.rank} could not link to rank {peer} before the deadline",
                [peer],
            ) from None
        except RendezvousError as exc:
            raise PeerDisconnected(str(exc), rank=peer) from None

    async def _connect(self, peer: int, deadline: Deadline) -> None:
        pause = RETRY_FIRST
        try:
            try:  # (the peers of one alltoall read theirs in one store request)
                await self.records.fetch((peer,))
            except Exception as exc:
                self._failed(peer, _unread(self.rank, peer, exc))
                return
            while True:
                async with self._slots:
                    if peer in self.linked or self.refusing is not None:
                        return
                    try:
                        link = await self._link(peer)
                    except RendezvousError as exc:
                        if STANDS in str(exc):
                            return  # the peer's connection comes to the listener
                        if _fdlimit.is_exhausted(exc):
                            detail = f"connecting to rank {peer}: {exc.__context__}"
                            why = _fdlimit.links_exhausted(self.rank, len(self.linked), detail)
                            self._failed(peer, RendezvousError(why))
                            return
                        left = deadline.remaining()
                        if not _retryable(exc) or (left is not None and left < pause):
                            self._failed(peer, exc)
                            return
                    except Exception as exc:  # refused for good (AuthenticationError, ...)
                        self._failed(peer, exc)
                        return
                    else:
                        self.on_link(link)
                        if self._lane_wanted(peer, link):
                            assert isinstance(link, TcpLink)
                            link.arm_lane(self._lane_due)
                        return
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX)
        finally:
            self._outgoing.discard(peer)

    def _lane_wanted(self, peer: int, link: Link) -> bool:
        """Whether ``link`` (to ``peer``) should get a small-frame lane: a TCP link that
        wants one, through a listener that offers lanes to a peer whose record does."""
        listener = self.listener
        return (
            isinstance(link, TcpLink)
            and isinstance(listener, SocketListener)
            and listener.lanes
            and peer in self.records
            and self.records[peer].get("lanes") == 2
            and link.wants_lane()
        )

    def _lane_due(self, link: TcpLink) -> None:
        """``link`` (connected by this rank) carries bulk for the first time:
        dial its small-frame lane, unless this rank makes no more links or this process
        has no descriptor to spare (:func:`_fdlimit.reserve_lane`; the link then keeps its
        one connection)."""
        if self.refusing is not None or not _fdlimit.reserve_lane():
            return
        link.lane_coming()
        task = self._spawn(self._connect_lane(link.peer, link), self._lane_tasks)
        task.add_done_callback(_release_lane)  # (also where it is cancelled before it ran)

    async def _connect_lane(self, peer: int, link: TcpLink) -> None:
        """Make ``link``'s small-frame lane, in one of the ``CONNECTS`` slots, within
        ``LANE_TIMEOUT`` seconds of taking it (the link goes on without one if that fails
        or is cancelled; a lane made once this rank refuses links is closed)."""
        listener = self.listener
        assert isinstance(listener, SocketListener)
        hs = ConnectorHandshake(
            self.name, self.rank, peer, self.world_size, self.secret, job=self.job, lane=True
        )
        try:
            async with self._lane_slots:
                if self.refusing is not None or link.closed or link.lost:
                    raise PeerDisconnected(self.refusing or "the link ended first", peer)
                async with asyncio.timeout(LANE_TIMEOUT):
                    lane = await listener.connect_lane(self.records[peer], hs, link)
        except BaseException as exc:
            link.lane_failed(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            if self.refusing is None:
                link.attach_lane(lane)
            else:
                lane.close()
                link.lane_failed(PeerDisconnected(self.refusing, peer))

    async def _link(self, peer: int) -> Link:
        assert self.listener is not None
        hs = ConnectorHandshake(
            self.name, self.rank, peer, self.world_size, self.secret, job=self.job
        )
        return await self.listener.connect(self.records[peer], hs)

    def _failed(self, peer: int, exc: BaseException) -> None:
        fut = self._waiters.pop(peer, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def refuse(self, reason: str) -> None:
        """Make no more links (the group closed or broke): connects under way end, links
        that complete later are reset, waiters fail, and lanes under way are given up."""
        if self.refusing is not None:
            return
        self.refusing = reason
        for task in [*self._tasks, *self._lane_tasks]:
            task.cancel()
        for peer in list(self._waiters):
            self._failed(peer, RendezvousError(f"rank {self.rank} makes no more links: {reason}"))

    async def wait_closed(self) -> None:
        """Wait for the connects and lane connects that :meth:`refuse` cancelled to end."""
        for task in [*self._tasks, *self._lane_tasks]:
            with contextlib.suppress(BaseException):
                await task


def _release_lane(task: asyncio.Task[None]) -> None:
    """A lane's dial ended: its descriptor is counted by ``open_count`` (or was closed)."""
    del task
    _fdlimit.release(1)


def _retrieve(fut: asyncio.Future[Link]) -> None:
    if not fut.cancelled():
        fut.exception()


def _unread(rank: int, peer: int, exc: Exception) -> RendezvousError:
    """The error of a connect to ``peer`` whose record could not be read (``exc``)."""
    if isinstance(exc, RendezvousError):
        return exc
    return RendezvousError(f"rank {rank} could not read the record of rank {peer}: {exc}")


def _retryable(exc: RendezvousError) -> bool:
    """Whether a connect that failed with ``exc`` may succeed if tried again: refused or
    reset by the peer's kernel (a full backlog, a listener not up yet), not refused by
    the peer's handshake or its TLS."""
    return isinstance(exc.__context__, ConnectionError)
