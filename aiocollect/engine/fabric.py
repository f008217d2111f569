"""Fabric: the set of links of one world group, shared by all its sub-groups.

It receives every link event, checks each incoming operation frame's fingerprint against
the operation this rank registered at the same (group id, sequence number), and turns any
failure into one broken state: every pending receive fails, every peer gets an ABORT frame
naming the cause, and later calls raise GroupBrokenError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from aiocollect import _fdlimit
from aiocollect._deadline import Deadline
from aiocollect.engine.bulk import Bulk, wanted
from aiocollect.engine.closing import Closer, decode_abort, decode_goodbye, encode_abort
from aiocollect.engine.liveness import Liveness, few
from aiocollect.engine.op_registry import OpRegistry
from aiocollect.engine.spin import Awaited, Spinner, budget_for, core_each
from aiocollect.errors import (
    GroupBrokenError,
    InternalError,
    PeerDisconnected,
    PeerTimeout,
    ProtocolError,
)
from aiocollect.rendezvous.ondemand import Dialer
from aiocollect.transport.base import Link
from aiocollect.transport.wire import ABORT, GOODBYE, P2P, PING, PONG, Header, control_header

log = logging.getLogger("aiocollect")

#: A relayed PeerTimeout that blames this rank is held (as while it diagnoses) when one of
#: this rank's own operations reaches its deadline within this many seconds: the ranks
#: of one collective time out together, give or take when each called it, and the
#: bystander whose probe ends first must not pin the blame on an end of a stalled link
#: (docs/network-faults.md, finding 2). Held, it breaks the group ``HOLD_SLACK`` after
#: that deadline unless this rank's own diagnosis holds it on (and then breaks the
#: group with its own verdict first).
NEAR_DEADLINE = 1.0
HOLD_SLACK = 0.05


class Closable(Protocol):
    """A resource of :attr:`Fabric.resources`."""

    def close(self) -> None:
        """Release it (idempotent)."""


class Fabric:
    """Links of one world group (indexed by world rank) and the failure state."""

    def __init__(self, rank: int, world_size: int, max_frame: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_frame = max_frame
        self.links: dict[int, Link] = {}
        #: Whether every rank may read every other rank's memory, as the rendezvous
        #: records predict (the same on every rank; the automatic algorithm choice).
        self.pulls = False
        #: Per world rank, the index of its host, as the rendezvous records say (empty:
        #: unknown, every rank its own host; the two-level algorithms' topology).
        self.hosts: list[int] = []
        self.failure: BaseException | None = None
        self.closing = False
        #: Timed-out operations of this rank searching for their culprits right now.
        self._diagnosing = 0
        #: A relayed PeerTimeout that blamed this rank, held while it diagnoses, and the
        #: peers it came from (origin and relayer): their links' loss is that abort too.
        self.held_abort: BaseException | None = None
        self.held_from: set[int] = set()
        #: Per group on this fabric (registered by the group), the loop time of its
        #: nearest deadline among its operations in flight, or None: a relayed blame of
        #: this rank waits for this rank's own diagnosis when that deadline is near.
        self.deadlines: list[Callable[[], float | None]] = []
        #: The operations this rank called (engine/op_registry.py); the frame path reads
        #: its tables directly (the same dicts, one attribute away).
        self.registry = registry = OpRegistry(rank, self.fail)
        self._active = registry.active
        self._started = registry.started
        self._early = registry.early
        self._done = registry.done
        #: Probes and link losses (engine/liveness.py).
        self.liveness = Liveness(self)
        #: The close handshake and the links' end (engine/closing.py).
        self.closer = Closer(self)
        #: Whether the first failure has been raised to the user on this rank (aclose
        #: raises a MismatchError nobody has seen yet).
        self.reported = False
        self._p2p_waiters: list[asyncio.Future[None]] = []
        self._spinner: Spinner | None = None  # made on the first wait (engine/spin.py)
        self._spin_on: dict[Link, bool] = {}  # whether waits on a link spin
        #: Makes the links not made when the group formed (rendezvous/ondemand.py), or
        #: None where every link was.
        self.dialer: Dialer | None = None
        self._pieces = False
        #: The pull collectives' bulk worker where the environment asks for one
        #: (engine/bulk.py), else None: set by :meth:`attach`, closed with the links.
        self.bulk: Bulk | None = None
        #: What the algorithms keep for the fabric's life, by their own keys (the slot
        #: segments of ``collectives/segment.py``): closed when the links close or reset.
        self.resources: dict[Hashable, Closable] = {}

    def attach(
        self,
        links: Mapping[int, Link],
        pulls: bool,
        hosts: Sequence[int] = (),
        dialer: Dialer | None = None,
    ) -> None:
        """Take the links the rendezvous made (by world rank) and what its records predict
        (``pulls``: every rank reads every other's memory; ``hosts``: per world rank, the
        index of its host), and tell every link how to
        pace its writes: in pieces where this host has a core per rank process, whole
        where ranks share cores (:meth:`Link.pace_writes`), and give the pull collectives
        a bulk worker thread where ``AIOCOLLECT_BULK_THREAD`` asks for one
        (:mod:`aiocollect.engine.bulk`). Where
        some peer is not linked yet, ``dialer`` makes those links on demand
        (:meth:`on_demand`)."""
        self.links.update(links)
        self.pulls = pulls
        self.hosts = list(hosts)
        pieces = self._pieces = core_each(self.links.values())
        if self.bulk is None and wanted(shared_cores=not pieces):
            self.bulk = Bulk()
        for link in self.links.values():
            link.pace_writes(pieces)
        if dialer is not None and len(self.links) < self.world_size - 1:
            self.on_demand(dialer)

    # -- links on demand ---------------------------------------------------------------------

    def on_demand(self, dialer: Dialer) -> None:
        """Make the links missing after :meth:`attach` through ``dialer`` when an
        operation needs them (:meth:`ensure`); the links it makes, by either side, join
        :attr:`links`."""
        self.dialer = dialer
        dialer.deliver = self.add_link
        if self.failure is not None:
            dialer.refuse(f"the group is broken: {self.failure!r}")

    def add_link(self, link: Link) -> None:
        """Take ``link``, made after the group formed (reset if the group broke)."""
        if self.failure is not None or self.closing:
            link.abort()
            return
        self.links[link.peer] = link
        link.pace_writes(self._pieces)

    async def ensure(self, peers: Iterable[int], timeout: float | None) -> None:
        """Make the links to world ranks ``peers`` that do not exist yet (at most
        ``ondemand.CONNECTS`` connects at a time).

        Raises:
            PeerTimeout: some links were not made within ``timeout`` seconds (named).
            PeerDisconnected: a peer could not be reached, refused, or the group closed;
                or this process has too few descriptors left for the links (the message
                names the limit, the links open and what to do).
        """
        links, dialer = self.links, self.dialer
        missing = [p for p in peers if p not in links and p != self.rank]
        if not missing:
            return
        if dialer is None:
            raise InternalError(f"rank {self.rank} has no link to ranks {missing}")
        short = _fdlimit.reserve(len(missing))  # (a lane only where one is to spare)
        if short is not None:  # (fails the group: every rank learns it from the ABORT)
            raise PeerDisconnected(
                _fdlimit.links_exhausted(self.rank, len(links), short), rank=missing[0]
            )
        deadline = Deadline.after(timeout)
        try:
            made = await asyncio.gather(
                *(dialer.dial(p, deadline) for p in missing), return_exceptions=True
            )
        finally:
            _fdlimit.release(len(missing))
        failed = [exc for exc in made if isinstance(exc, BaseException)]
        timeouts = [exc for exc in failed if isinstance(exc, PeerTimeout)]
        if timeouts and len(timeouts) == len(failed):
            raise PeerTimeout(
                f"rank {self.rank} could not link to ranks "
                f"{few(r for exc in timeouts for r in exc.ranks)} before the deadline",
                [r for exc in timeouts for r in exc.ranks],
            )
        if failed:
            raise next(exc for exc in failed if not isinstance(exc, PeerTimeout))

    # -- busy-waiting -----------------------------------------------------------------------

    @property
    def spinner(self) -> Spinner:
        """This rank's busy-wait (engine/spin.py), its budget decided from the links on
        first use."""
        spinner = self._spinner
        if spinner is None:
            spinner = self._spinner = Spinner(
                budget_for(self.links.values()), asyncio.get_running_loop()
            )
        return spinner

    def spin(self, fut: Awaited, link: Link) -> None:
        """A receive ``fut`` on ``link`` is awaited: keep the loop polling for a while,
        unless the policy says not to or the link polls itself (``caps.polls``: shared
        memory)."""
        if self.spins(link):
            self.spinner.wait(fut)

    def spins(self, link: Link) -> bool:
        """Whether a receive awaited on ``link`` spins (:meth:`spin`), decided once per
        link: the policy's budget for this rank's links is not 0 and the link does not
        poll itself."""
        on = self._spin_on.get(link)
        if on is None:
            spinner = self._spinner
            budget = spinner.budget if spinner is not None else budget_for(self.links.values())
            on = self._spin_on[link] = budget > 0 and not link.caps.polls
        return on

    # -- LinkEvents ------------------------------------------------------------------------

    def on_header(self, link: Link, h: Header) -> None:
        if h.kind == P2P:
            if self._p2p_waiters:
                asyncio.get_running_loop().call_soon(self._wake_p2p)
            return
        key = (h.gid, h.seq)
        mine = self._active.get(key)
        if mine is None:
            done = self._done.get(key)
            if done is not None and done != h.fingerprint:
                raise self.registry.mismatch(h.gid, h.seq, done, link.peer, h.fingerprint)
            if h.seq <= self._started.get(h.gid, -1):
                raise ProtocolError(
                    f"rank {link.peer} sent a frame for finished operation #{h.seq}"
                )
            early = self._early.get(key)
            if early is None:
                self._early[key] = {link.peer: h.fingerprint}
                return
            seen = early.get(link.peer)
            if seen is None:
                early[link.peer] = h.fingerprint
            elif seen != h.fingerprint:
                raise ProtocolError(
                    f"{link.describe()} sent frames of operation #{h.seq} with different "
                    "fingerprints"
                )
            return
        if mine != h.fingerprint:
            raise self.registry.mismatch(h.gid, h.seq, mine, link.peer, h.fingerprint)

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        if kind == GOODBYE:
            link.goodbye_received = True
            link.goodbye_digests = decode_goodbye(payload)
            # The peer sends no more frames: what still waits for one from it never gets it.
            link.fail(self.registry.closed_by(link), drop_early=False)
            self.closer.wake()
            return
        if kind == PING:
            self.liveness.answer(link, payload)
            return
        if kind == PONG:
            self.liveness.on_pong(link, payload)
            return
        assert kind == ABORT
        exc = decode_abort(link.peer, payload)
        if isinstance(exc, PeerTimeout) and self.rank in exc.ranks:
            # A bystander timed out waiting for this rank, which is timing out itself
            # (probing for whom it waits on, or about to: its own deadline is near): its
            # own diagnosis is the precise one.
            near = None if self._diagnosing else self._deadline_near()
            if self._diagnosing or near is not None:
                if self.held_abort is None:
                    self.held_abort = exc
                info = getattr(exc, "abort_info", {})
                self.held_from.update({link.peer, int(info.get("rank", link.peer))})
                if near is not None:  # released then unless a diagnosis holds it on
                    asyncio.get_running_loop().call_at(near + HOLD_SLACK, self._release_held)
                return
        # Relay it: a peer that hears our close before the origin's ABORT must not blame us.
        self.fail(exc, notify=True)

    @contextlib.contextmanager
    def diagnosing(self) -> Iterator[None]:
        """Around a timed-out operation's search for culprits (its probe). Meanwhile a
        relayed PeerTimeout that names this rank is held, and so is the loss of the links
        of the peers it came from (they close right after their ABORT), and those peers
        count as answering the probe. The held error breaks the group at the loop's next
        turn unless the diagnosis did first (its caller fails the fabric with it as soon
        as the search returns)."""
        self._diagnosing += 1
        try:
            yield
        finally:
            self._diagnosing -= 1
            if not self._diagnosing and self.held_abort is not None:
                asyncio.get_running_loop().call_soon(self._release_held)

    def _deadline_near(self) -> float | None:
        """The nearest deadline (loop time) of this rank's operations in flight if it is
        at most ``NEAR_DEADLINE`` seconds away, else None."""
        deadlines = [d for nearest in self.deadlines if (d := nearest()) is not None]
        if not deadlines:
            return None
        soonest = min(deadlines)
        if soonest > asyncio.get_running_loop().time() + NEAR_DEADLINE:
            return None
        return soonest

    def _release_held(self) -> None:
        if self._diagnosing:
            return  # another diagnosis began meanwhile: its end releases it
        held, self.held_abort = self.held_abort, None
        self.held_from.clear()
        if held is not None:
            self.fail(held, notify=True)  # (a no-op once the diagnosis broke the group)

    def on_error(self, link: Link, exc: BaseException) -> None:
        self.fail(exc)

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        """``link`` ended (``exc``: what ended it, if known): wake the close handshake;
        unless the group closes, broke, or the peer said goodbye or aborted, break it
        with PeerDisconnected (:meth:`Liveness.on_lost`)."""
        self.closer.wake()
        self.liveness.on_lost(link, exc)

    # -- any-source receives ---------------------------------------------------------------

    async def p2p_arrival(self) -> None:
        """Wait until some P2P frame arrives on any link."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._p2p_waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._p2p_waiters:
                self._p2p_waiters.remove(fut)

    def _wake_p2p(self) -> None:
        waiters, self._p2p_waiters = self._p2p_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- failure ---------------------------------------------------------------------------

    def cause(self, exc: BaseException) -> BaseException:
        """What an operation that failed with ``exc`` reports: ``exc``, which now breaks the
        fabric, or the fabric's first failure if it broke before (``exc`` is then only a
        consequence, such as a link closed under the operation)."""
        self.fail(exc)
        assert self.failure is not None
        self.reported = True
        return self.failure

    def fail(self, exc: BaseException, notify: bool = True) -> None:
        """Break the fabric with ``exc`` (first failure wins): fail every pending receive,
        send ABORT to every peer that can still hear it, then close the links."""
        if self.failure is not None:
            return
        self.failure = exc
        if self.dialer is not None:
            self.dialer.refuse(f"the group is broken: {type(exc).__name__}")
        # release what only a healthy group needs (a flood of early frames leaves no trace)
        self.registry.forget()
        level = logging.INFO if isinstance(exc, GroupBrokenError) else logging.WARNING
        log.log(level, "group broken on rank %d: %s: %s", self.rank, type(exc).__name__, exc)
        payload = encode_abort(self.rank, exc) if notify else b""
        links = list(self.links.values())
        for link in links:  # first fail every pending receive: no I/O, cannot be cut short
            link.fail(exc)
        for link in links:
            try:
                if notify and not link.closed:
                    link.send(control_header(ABORT, len(payload)), payload)
                link.close()  # flushes the ABORT before closing
            except Exception as err:
                log.warning("while closing the link to rank %d: %r", link.peer, err)
                link.abort()
        for waiter in self._p2p_waiters:
            if not waiter.done():
                waiter.set_exception(exc)
        self._p2p_waiters.clear()
        self.closer.wake()

    def check(self) -> None:
        """Raise GroupBrokenError (caused by the first failure) if the fabric is broken."""
        if self.failure is not None:
            self.reported = True
            raise GroupBrokenError(
                f"the group is broken: {type(self.failure).__name__}: {self.failure}"
            ) from self.failure
