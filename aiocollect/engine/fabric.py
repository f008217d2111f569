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
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgpack

from aiocollect import errors
from aiocollect.engine.spin import Awaited, Spinner, budget_for, core_each
from aiocollect.errors import (
    GroupBrokenError,
    MismatchError,
    PeerDisconnected,
    ProtocolError,
)
from aiocollect.fingerprint import describe as describe_fingerprint
from aiocollect.transport.base import Fingerprint, Link
from aiocollect.transport.wire import (
    ABORT,
    GOODBYE,
    P2P,
    PING,
    PONG,
    WORLD_GID,
    Header,
    control_header,
)

log = logging.getLogger("aiocollect")

DONE_MEMORY = 4096
#: A PING is answered only while less than this is queued on the link: a peer that sends
#: PINGs and never reads cannot make this rank queue PONGs without bound.
PONG_BACKLOG = 16 * 1024 * 1024
#: A PING's payload: an 8-byte token, optionally followed by this question, "have you
#: called operation ``seq`` of group ``gid``, and with which fingerprint?" — its PONG echoes
#: the payload and appends one byte, 1 (yes) or 0 (no), after a yes the fingerprint
#: (``_FINGERPRINT``) when this rank still remembers it. The token alone is just echoed.
_CALLED_QUERY = struct.Struct("<IQ")
#: The PONG's appended answer to that question: not called yet, or called (then maybe
#: followed by the fingerprint).
NOT_CALLED = b"\x00"
CALLED = b"\x01"
_FINGERPRINT = struct.Struct("<qqqqq")
_TOKEN = 8
#: Fingerprints of the last operations per group a GOODBYE carries (to name the operation
#: when the close handshake finds that ranks disagreed).
GOODBYE_RECENT = 16
#: A relayed PeerTimeout that blames this rank is held (as while it diagnoses) when one of
#: this rank's own operations reaches its deadline within this many seconds: the ranks
#: of one collective time out together, give or take when each called it, and the
#: bystander whose probe ends first must not pin the blame on an end of a stalled link
#: (docs/network-faults.md, finding 2). Held, it breaks the group ``HOLD_SLACK`` after
#: that deadline unless this rank's own diagnosis holds it on (and then breaks the
#: group with its own verdict first).
NEAR_DEADLINE = 1.0
#: Seconds an unexplained loss of a same-host peer's connection waits for that peer's
#: process to exit before it is blamed (:meth:`Fabric.on_lost`).
PEER_EXIT_WAIT = 0.5
HOLD_SLACK = 0.05


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
        self.failure: BaseException | None = None
        self.closing = False
        #: Timed-out operations of this rank searching for their culprits right now.
        self._diagnosing = 0
        #: A relayed PeerTimeout that blamed this rank, held while it diagnoses, and the
        #: peers it came from (origin and relayer): their links' loss is that abort too.
        self._held_abort: BaseException | None = None
        self._held_from: set[int] = set()
        #: Per group on this fabric (registered by the group), the loop time of its
        #: nearest deadline among its operations in flight, or None: a relayed blame of
        #: this rank waits for this rank's own diagnosis when that deadline is near.
        self.deadlines: list[Callable[[], float | None]] = []
        self._active: dict[tuple[int, int], Fingerprint] = {}
        self._started: dict[int, int] = {}
        # (gid, seq) -> {peer: fingerprint} of frames that came before this rank's call: one
        # entry per peer however many frames it sends (every frame of an op carries its
        # fingerprint), counted in the link's staging cap (transport.base.STAGED_FRAME_COST)
        self._early: dict[tuple[int, int], dict[int, Fingerprint]] = {}
        # running digest of the fingerprints registered per group, in sequence order: the
        # close handshake compares them (a mismatch no frame revealed, see aclose)
        self._digests: dict[int, int] = {}
        #: Whether the first failure has been raised to the user on this rank (aclose
        #: raises a MismatchError nobody has seen yet).
        self.reported = False
        self._close_waiters: list[asyncio.Future[None]] = []
        #: Losses waiting for their peer's process to exit: pidfd -> (its loop, its timer).
        self._exit_waits: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle]] = {}
        self._done: OrderedDict[tuple[int, int], Fingerprint] = OrderedDict()
        self._p2p_waiters: list[asyncio.Future[None]] = []
        self._pongs: dict[tuple[int, bytes], asyncio.Future[bytes]] = {}
        self._probes = 0
        self._spinner: Spinner | None = None  # made on the first wait (engine/spin.py)
        self._spin_on: dict[Link, bool] = {}  # whether waits on a link spin

    def attach(self, links: Mapping[int, Link], pulls: bool) -> None:
        """Take the links the rendezvous made (by world rank) and what its records predict
        (``pulls``: every rank reads every other's memory), and tell every link how to
        pace its writes: in pieces where this host has a core per rank process, whole
        where ranks share cores (:meth:`Link.pace_writes`)."""
        self.links.update(links)
        self.pulls = pulls
        pieces = core_each(self.links.values())
        for link in self.links.values():
            link.pace_writes(pieces)

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

    # -- operation registry ----------------------------------------------------------------

    def register(self, gid: int, seq: int, fp: Fingerprint, ranks: list[int]) -> None:
        """Record this rank's operation at (gid, seq) and check frames that came early."""
        self._active[(gid, seq)] = fp
        if seq > self._started.get(gid, -1):
            self._started[gid] = seq
        self._digests[gid] = hash((self._digests.get(gid, 0), fp))
        early = self._early.pop((gid, seq), None) if self._early else None
        if early is None:
            return
        for peer, theirs in early.items():
            if theirs != fp:
                self.fail(self._mismatch(gid, seq, fp, peer, theirs, ranks))
                return

    def unregister(self, gid: int, seq: int) -> None:
        fp = self._active.pop((gid, seq), None)
        if fp is not None:
            # Remember recent fingerprints: a peer that disagrees may only send after this
            # rank finished (e.g. this rank's op had nothing to receive).
            self._done[(gid, seq)] = fp
            if len(self._done) > DONE_MEMORY:
                self._done.popitem(last=False)

    def fingerprint(self, gid: int, seq: int) -> Fingerprint | None:
        """This rank's fingerprint of operation ``seq`` of group ``gid``, if it is in
        flight or among the last ``DONE_MEMORY`` finished."""
        key = (gid, seq)
        return self._active.get(key) or self._done.get(key)

    def closed_by(self, link: Link) -> errors.AiocollectError:
        """The error for this rank's operations still waiting on ``link`` once its peer
        closed cleanly. The peer's GOODBYE carries the digest of the operations it called:
        where it shows that the peer called one of them differently, or never called it
        (it closed after fewer operations), the MismatchError naming both calls; else a
        GroupBrokenError saying the peer closed the group."""
        theirs = link.goodbye_digests
        peer = link.peer
        if theirs is not None:
            for (gid, seq), mine in sorted(self._active.items()):
                if gid not in theirs and gid != WORLD_GID:
                    continue  # a sub-group the peer never used (or is not a member of)
                count, _digest, recent = theirs.get(gid, (0, 0, []))
                where = "" if gid == WORLD_GID else f" of sub-group {gid:#x}"
                if seq >= count:
                    return MismatchError(
                        f"operation #{seq}{where}: rank {self.rank} called "
                        f"{describe_fingerprint(mine)} but rank {peer} closed the group "
                        f"after calling {count} collective operations (it never called "
                        "this one)"
                    )
                for entry in recent:
                    try:
                        their_seq, their_fp = int(entry[0]), tuple(int(x) for x in entry[1:6])
                    except (TypeError, ValueError, IndexError):
                        continue
                    if their_seq == seq and len(their_fp) == 5 and their_fp != mine:
                        return MismatchError(
                            f"operation #{seq}{where}: rank {self.rank} called "
                            f"{describe_fingerprint(mine)} but rank {peer} called "
                            f"{describe_fingerprint(their_fp)} (found when rank {peer} "
                            "closed the group)"
                        )
        return GroupBrokenError(f"rank {peer} closed the group")

    def _mismatch(
        self,
        gid: int,
        seq: int,
        mine: Fingerprint,
        peer: int,
        theirs: Fingerprint,
        ranks: list[int] | None = None,
    ) -> MismatchError:
        grank = ranks.index(peer) if ranks and peer in ranks else peer
        where = "" if gid == WORLD_GID else f" of sub-group {gid:#x}"
        return MismatchError(
            f"operation #{seq}{where}: rank {self.rank} called {describe_fingerprint(mine)} "
            f"but rank {grank} called {describe_fingerprint(theirs)}"
        )

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
                raise self._mismatch(h.gid, h.seq, done, link.peer, h.fingerprint)
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
            raise self._mismatch(h.gid, h.seq, mine, link.peer, h.fingerprint)

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        if kind == GOODBYE:
            link.goodbye_received = True
            link.goodbye_digests = _decode_goodbye(payload)
            # The peer sends no more frames: what still waits for one from it never gets it.
            link.fail(self.closed_by(link), drop_early=False)
            self._wake_closers()
            return
        if kind == PING:
            if not link.closed and link.write_buffer_size() < PONG_BACKLOG:
                reply = payload + self._called(payload)
                link.send(control_header(PONG, len(reply)), reply)
            return
        if kind == PONG:
            waiter = self._pongs.pop((link.peer, payload[:_TOKEN]), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(payload)
            return
        assert kind == ABORT
        exc = _decode_abort(link.peer, payload)
        if isinstance(exc, errors.PeerTimeout) and self.rank in exc.ranks:
            # A bystander timed out waiting for this rank, which is timing out itself
            # (probing for whom it waits on, or about to: its own deadline is near): its
            # own diagnosis is the precise one.
            near = None if self._diagnosing else self._deadline_near()
            if self._diagnosing or near is not None:
                if self._held_abort is None:
                    self._held_abort = exc
                info = getattr(exc, "abort_info", {})
                self._held_from.update({link.peer, int(info.get("rank", link.peer))})
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
            if not self._diagnosing and self._held_abort is not None:
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
        held, self._held_abort = self._held_abort, None
        self._held_from.clear()
        if held is not None:
            self.fail(held, notify=True)  # (a no-op once the diagnosis broke the group)

    def on_error(self, link: Link, exc: BaseException) -> None:
        self.fail(exc)

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        self._wake_closers()
        if self.failure is not None or self.closing:
            return
        if self._held_abort is not None and link.peer in self._held_from:
            # that peer aborted (held, see diagnosing): nothing more comes from it
            link.fail(self._held_abort, drop_early=False)
            return
        if link.goodbye_received:
            # A clean close fails only what still needs that peer; such an op then breaks
            # the group through the usual path.
            link.fail(self.closed_by(link), drop_early=False)
            return
        # An unexplained loss. The peer may have gone right after an ABORT (its own, or
        # one it relayed) that this loop has not read yet: a write to it that fails ends
        # the connection before the bytes it sent are read, and another peer's ABORT can
        # wait on another link. Blame the loss two loop turns later, after the next
        # poll for input, unless an ABORT broke the group first (docs/design.md, *Failure
        # detection*). Where the peer is a process on this host, first wait (at most
        # PEER_EXIT_WAIT) until it has exited: the kernel closes an exiting process's
        # sockets before it tells its parent, so a launcher could see this rank, failing
        # because of the loss, exit before the peer whose exit caused it.
        loop = asyncio.get_running_loop()
        pid = link.peer_pid
        if pid is not None and pid != os.getpid() and self._after_exit(loop, pid, link, exc):
            return
        loop.call_soon(loop.call_soon, self._lost, link, exc)

    def _after_exit(
        self,
        loop: asyncio.AbstractEventLoop,
        pid: int,
        link: Link,
        exc: BaseException | None,
    ) -> bool:
        """Blame the loss of ``link`` (two loop turns later, as :meth:`on_lost`) once
        process ``pid`` has exited or ``PEER_EXIT_WAIT`` seconds have passed. False,
        having done nothing, where that cannot be watched (no pidfd; the process is gone
        already)."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return False

        def fire() -> None:
            wait = self._exit_waits.pop(fd, None)
            if wait is None:
                return  # (fired already, or cancelled by a close)
            wait[1].cancel()
            loop.remove_reader(fd)
            os.close(fd)
            loop.call_soon(loop.call_soon, self._lost, link, exc)

        try:
            loop.add_reader(fd, fire)
        except (NotImplementedError, OSError, ValueError):
            os.close(fd)
            return False
        self._exit_waits[fd] = (loop, loop.call_later(PEER_EXIT_WAIT, fire))
        return True

    def _cancel_exit_waits(self) -> None:
        """Stop watching peers' processes (the fabric closes: nothing is blamed now)."""
        waits, self._exit_waits = self._exit_waits, {}
        for fd, (loop, timer) in waits.items():
            timer.cancel()
            with contextlib.suppress(Exception):  # (a closed loop has no readers left)
                loop.remove_reader(fd)
            os.close(fd)

    def _lost(self, link: Link, exc: BaseException | None) -> None:
        """Break the group with the loss of ``link`` (``exc``: what ended it), unless it
        broke meanwhile."""
        if self.failure is not None or self.closing:
            return
        detail = f": {exc}" if exc else ""
        self.fail(
            PeerDisconnected(
                f"rank {link.peer} disconnected ({link.describe()}){detail}", link.peer
            )
        )

    # -- liveness ---------------------------------------------------------------------------

    async def probe(self, peers: list[int], timeout: float) -> list[int]:
        """PING ``peers`` (world ranks) and return those that did not answer within
        ``timeout`` seconds: a live peer's event loop answers at once, even while its own
        operations wait; a frozen or hung process does not."""
        replies = await self._ping(peers, timeout, b"")
        return sorted(p for p, reply in replies.items() if reply is None)

    async def survey(
        self, peers: list[int], timeout: float, gid: int, seq: int
    ) -> tuple[list[int], list[int], dict[int, Fingerprint]]:
        """Like :meth:`probe`, also asking whether each peer has called operation ``seq``
        of group ``gid``, and with which fingerprint. Returns (peers that did not answer,
        peers that answered no, the fingerprints of the peers that called it and still
        remember it)."""
        query = _CALLED_QUERY.pack(gid, seq)
        replies = await self._ping(peers, timeout, query)
        dead = sorted(p for p, reply in replies.items() if reply is None)
        absent = sorted(p for p, reply in replies.items() if reply == NOT_CALLED)
        fps: dict[int, Fingerprint] = {}
        for p, reply in replies.items():
            if reply is not None and len(reply) == 1 + _FINGERPRINT.size and reply[:1] == CALLED:
                coll, dtype, count, op, root = _FINGERPRINT.unpack_from(reply, 1)
                fps[p] = (coll, dtype, count, op, root)
        return dead, absent, fps

    def check_fingerprints(
        self, gid: int, seq: int, fps: dict[int, Fingerprint], ranks: list[int]
    ) -> MismatchError | None:
        """The MismatchError naming this rank's operation ``seq`` and the first peer (world
        rank) in ``fps`` that called another one, if any."""
        mine = self.fingerprint(gid, seq)
        if mine is None:
            return None
        for peer in sorted(fps):
            if fps[peer] != mine:
                return self._mismatch(gid, seq, mine, peer, fps[peer], ranks)
        return None

    async def _ping(
        self, peers: list[int], timeout: float, query: bytes
    ) -> dict[int, bytes | None]:
        """PING each peer with ``query``; its answer (what the PONG appended), or None."""
        loop = asyncio.get_running_loop()
        self._probes += 1
        token = self._probes.to_bytes(_TOKEN, "little")
        request = token + query
        waiting: dict[int, asyncio.Future[bytes]] = {}
        for peer in peers:
            link = self.links.get(peer)
            if link is None or link.closed:
                continue
            fut: asyncio.Future[bytes] = loop.create_future()
            self._pongs[(peer, token)] = fut
            waiting[peer] = fut
            try:
                link.send(control_header(PING, len(request)), request)
            except errors.AiocollectError:
                fut.cancel()
        if waiting:
            await asyncio.wait(waiting.values(), timeout=timeout)
        for peer in waiting:
            self._pongs.pop((peer, token), None)
        held = self._held_from  # peers whose ABORT is held: they answered that way
        return {
            p: f.result()[len(request) :]
            if f.done() and not f.cancelled()
            else (b"" if p in held else None)
            for p, f in waiting.items()
        }

    def _called(self, ping: bytes) -> bytes:
        """The answer to a PING's question, if it asks one."""
        if len(ping) != _TOKEN + _CALLED_QUERY.size:
            return b""
        gid, seq = _CALLED_QUERY.unpack_from(ping, _TOKEN)
        if self._started.get(gid, -1) < seq:
            return NOT_CALLED
        fp = self.fingerprint(gid, seq)
        return CALLED if fp is None else CALLED + _FINGERPRINT.pack(*fp)

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
        # release what only a healthy group needs (a flood of early frames leaves no trace)
        self._early.clear()
        self._done.clear()
        level = logging.INFO if isinstance(exc, GroupBrokenError) else logging.WARNING
        log.log(level, "group broken on rank %d: %s: %s", self.rank, type(exc).__name__, exc)
        payload = _encode_abort(self.rank, exc) if notify else b""
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
        self._wake_closers()

    def check(self) -> None:
        """Raise GroupBrokenError (caused by the first failure) if the fabric is broken."""
        if self.failure is not None:
            self.reported = True
            raise GroupBrokenError(
                f"the group is broken: {type(self.failure).__name__}: {self.failure}"
            ) from self.failure

    def goodbye(self) -> None:
        """Tell every peer this rank closes cleanly: a GOODBYE carrying the digest of the
        operations this rank called (links stay open: see :meth:`farewell`)."""
        self.closing = True
        payload = self._goodbye_payload()
        for link in list(self.links.values()):
            if not link.closed:
                with contextlib.suppress(errors.AiocollectError):
                    link.send(control_header(GOODBYE, len(payload)), payload)

    async def farewell(self, timeout: float) -> MismatchError | None:
        """After :meth:`goodbye`: wait up to ``timeout`` seconds until every peer said
        goodbye too, disconnected, or the fabric broke (an ABORT), then compare the peers'
        digests with this rank's. Returns the MismatchError if two ranks called different
        operations (the caller breaks the fabric with it), else None; peers still silent
        at the timeout are not compared (they compare ours when they close)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.failure is None and not all(
            link.goodbye_received or link.closed for link in self.links.values()
        ):
            left = end - loop.time()
            if left <= 0:
                break
            fut: asyncio.Future[None] = loop.create_future()
            self._close_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                break
            finally:
                if fut in self._close_waiters:
                    self._close_waiters.remove(fut)
        if self.failure is not None:
            return None
        for peer, link in sorted(self.links.items()):
            theirs = link.goodbye_digests
            if theirs is not None:
                err = self._compare_digests(peer, theirs)
                if err is not None:
                    return err
        return None

    def close_links(self) -> None:
        """Close every link gracefully (flush, half-close)."""
        self.closing = True
        self._cancel_exit_waits()
        for link in list(self.links.values()):
            link.close()

    async def links_gone(self, timeout: float, grace: float) -> None:
        """After :meth:`close_links`: wait for every link to end, then reset those that
        have not, so that no connection outlives the group's close (an event loop closed
        right after would find them open: uvloop then refuses to close, EBUSY, where
        warnings are errors, and asyncio warns of unclosed transports). A peer that said
        goodbye closes its end as soon as it reads ours, so this waits up to ``timeout``
        when every peer did and ``grace`` otherwise (after a failure, or a peer gone or
        still silent: time for what was flushed, an ABORT above all, to be read)."""
        links = list(self.links.values())
        if not links:
            return
        said = self.failure is None and all(link.goodbye_received for link in links)
        waits = [asyncio.ensure_future(link.wait_closed()) for link in links]
        try:
            await asyncio.wait(waits, timeout=max(0.0, timeout if said else min(grace, timeout)))
        finally:
            for link, waiting in zip(links, waits, strict=True):
                if not waiting.done():
                    waiting.cancel()
                    link.abort()

    def _wake_closers(self) -> None:
        waiters, self._close_waiters = self._close_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _goodbye_payload(self) -> bytes:
        recent: dict[int, list[list[int]]] = {}
        for gid, seq in reversed(self._done):
            entries = recent.setdefault(gid, [])
            if len(entries) < GOODBYE_RECENT:
                entries.append([seq, *self._done[(gid, seq)]])
        groups = {
            gid: [self._started[gid] + 1, digest, recent.get(gid, [])]
            for gid, digest in self._digests.items()
        }
        return bytes(msgpack.packb(groups, use_bin_type=True))

    def _compare_digests(
        self, peer: int, theirs: dict[int, tuple[int, int, list[Any]]]
    ) -> MismatchError | None:
        """The MismatchError if ``peer``'s GOODBYE shows other operations than this rank
        called, in a group both are members of (the world group, and sub-groups both have
        used)."""
        for gid in sorted(set(theirs) | {0}):
            if gid not in self._digests and gid != 0:
                continue
            count, digest, recent = theirs.get(gid, (0, 0, []))
            mine_count = self._started.get(gid, -1) + 1
            if (count, digest) == (mine_count, self._digests.get(gid, 0)):
                continue
            where = "" if gid == WORLD_GID else f" of sub-group {gid:#x}"
            for entry in recent:
                try:
                    seq, theirs_fp = int(entry[0]), tuple(int(x) for x in entry[1:6])
                except (TypeError, ValueError, IndexError):
                    continue
                mine = self._done.get((gid, seq))
                if mine is not None and len(theirs_fp) == 5 and mine != theirs_fp:
                    return MismatchError(
                        f"operation #{seq}{where}: rank {self.rank} called "
                        f"{describe_fingerprint(mine)} but rank {peer} called "
                        f"{describe_fingerprint(theirs_fp)}"
                        " (found when the group closed)"
                    )
            if count != mine_count:
                return MismatchError(
                    f"the group closed{where} after rank {self.rank} called {mine_count} "
                    f"collective operations but rank {peer} called {count}"
                )
            return MismatchError(
                f"the group closed{where} after {count} collective operations, but ranks "
                f"{self.rank} and {peer} called different ones (the operation is older than "
                f"the last {GOODBYE_RECENT} each remembers)"
            )
        return None

    def abort_links(self) -> None:
        self.closing = True
        self._cancel_exit_waits()
        for link in list(self.links.values()):
            link.abort()


_ABORT_CLASSES: dict[str, type[errors.AiocollectError]] = {
    "MismatchError": errors.MismatchError,
    "PeerTimeout": errors.PeerTimeout,
    "PeerDisconnected": errors.PeerDisconnected,
    "ProtocolError": errors.GroupBrokenError,
}


def _decode_goodbye(payload: bytes) -> dict[int, tuple[int, int, list[Any]]] | None:
    """A GOODBYE's digests by group id (None if it carries none or is malformed: the
    close then compares nothing with that peer)."""
    if not payload:
        return None
    try:
        groups = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return {int(gid): (int(v[0]), int(v[1]), list(v[2])) for gid, v in groups.items()}
    except Exception:
        return None


def _encode_abort(rank: int, exc: BaseException) -> bytes:
    relayed = getattr(exc, "abort_info", None)
    if isinstance(relayed, dict):
        return bytes(msgpack.packb(relayed, use_bin_type=True))
    info: dict[str, Any] = {"rank": rank, "type": type(exc).__name__, "message": str(exc)}
    if getattr(exc, "raised", None):
        info["raised"] = True  # the message names the user's exception: relay it as is
    if isinstance(exc, errors.PeerTimeout):
        info["ranks"] = list(exc.ranks)
    elif isinstance(exc, errors.PeerError) and exc.rank is not None:
        info["ranks"] = [exc.rank]
    return bytes(msgpack.packb(info, use_bin_type=True))


def _decode_abort(peer: int, payload: bytes) -> BaseException:
    """Rebuild the failure a peer reported in its ABORT frame."""
    try:
        info = msgpack.unpackb(payload, raw=False)
        kind, message = str(info["type"]), str(info["message"])
        origin = int(info["rank"])
        ranks = [int(r) for r in info.get("ranks", [])]
    except Exception:
        return ProtocolError(f"rank {peer} sent a malformed ABORT frame")
    text = (
        message
        if info.get("raised") is True and message.startswith(f"rank {origin} ")
        else f"rank {origin} aborted the group: {message}"
    )
    cls = _ABORT_CLASSES.get(kind, GroupBrokenError)
    exc: errors.AiocollectError
    if cls is errors.PeerTimeout:
        exc = errors.PeerTimeout(text, ranks)
    elif cls is errors.PeerDisconnected:
        exc = errors.PeerDisconnected(text, ranks[0] if ranks else origin)
    else:
        exc = cls(text)
    exc.abort_info = info  # type: ignore[attr-defined]
    return exc
