"""Liveness: whether the peers are there, asked (PING/PONG), told (a lost link) and seen
(their hosts' acknowledgements).

A timed-out operation, and one waiting longer than the watchdog's check interval, PINGs
its peers (:meth:`Liveness.probe`, :meth:`Liveness.survey`): a live peer's event loop
answers at once, even while its own operations wait, and can say whether it has called a
given operation, with which fingerprint. A link that ends without a GOODBYE or an ABORT
breaks the group with PeerDisconnected (:meth:`Liveness.on_lost`), after what this loop
may still have to read, and, for a peer process on this host, after that process exited.
While an operation waits, the links to other hosts are looked at (:meth:`Liveness.look`):
one whose host has acknowledged nothing for ``LINK_SILENCE`` seconds, though data or a
probe waits for it, breaks the group with PeerDisconnected naming it unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiocollect import errors
from aiocollect.errors import PeerDisconnected
from aiocollect.transport.base import Fingerprint, Link
from aiocollect.transport.sockets import LINK_SILENCE_ENV, link_silence
from aiocollect.transport.wire import PING, PONG, control_header

if TYPE_CHECKING:
    from aiocollect.engine.fabric import Fabric

#: A PING is answered only while less than this is queued on the link: a peer that sends
#: PINGs and never reads cannot make this rank queue PONGs without bound.
PONG_BACKLOG = 16 * 1024 * 1024
#: A PING's payload: an 8-byte token, optionally followed by this question, "have you
#: called operation ``seq`` of group ``gid``, and with which fingerprint?" — its PONG echoes
#: the payload and appends one byte, 1 (yes) or 0 (no), after a yes the fingerprint
#: (``_FINGERPRINT``) when this rank still remembers it. The token alone is just echoed.
CALLED_QUERY = struct.Struct("<IQ")
#: The PONG's appended answer to that question: not called yet, or called (then maybe
#: followed by the fingerprint).
NOT_CALLED = b"\x00"
CALLED = b"\x01"
_FINGERPRINT = struct.Struct("<qqqqq")
_TOKEN = 8
#: Seconds an unexplained loss of a same-host peer's connection waits for that peer's
#: process to exit before it is blamed (:meth:`Liveness.on_lost`).
PEER_EXIT_WAIT = 0.5
#: Seconds between two looks at the links' acknowledgements (:meth:`Liveness.look`), at
#: least: every group on the fabric asks at each of its watchdog's ticks.
LOOK_EVERY = 0.4
#: A link counts as silent since the previous look when its silence grew by the time
#: between the looks, give or take this (seconds; the kernel counts in jiffies).
LOOK_SLACK = 0.25


class Liveness:
    """The probes and the link losses of ``fabric``."""

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric
        self._registry = fabric.registry
        self._pongs: dict[tuple[int, bytes], asyncio.Future[bytes]] = {}
        self._probes = 0
        #: Losses waiting for their peer's process to exit: pidfd -> (its loop, its timer).
        self._exit_waits: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle]] = {}
        #: Seconds of silence after which another host is unreachable (0: not checked).
        self.silence = link_silence()
        self._looked = -LOOK_EVERY
        #: Links found silent at the last look: peer -> (loop time, seconds silent).
        self._silent: dict[int, tuple[float, float]] = {}

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        """``link`` ended (``exc``: why, if known): see the fabric's ``on_lost``.

        Args:
            link: the link that ended.
            exc: what ended it, or None.
        """
        fabric = self._fabric
        if fabric.failure is not None or fabric.closing:
            return
        if fabric.held_abort is not None and link.peer in fabric.held_from:
            # that peer aborted (held, see diagnosing): nothing more comes from it
            link.fail(fabric.held_abort, drop_early=False)
            return
        if link.goodbye_received:
            # A clean close fails only what still needs that peer; such an op then breaks
            # the group through the usual path.
            link.fail(self._registry.closed_by(link), drop_early=False)
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

    def cancel_exit_waits(self) -> None:
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
        fabric = self._fabric
        if fabric.failure is not None or fabric.closing:
            return
        if getattr(exc, "errno", None) == errno.ETIMEDOUT and self.silence > 0:
            # the kernel's keep-alives went unanswered (transport/sockets.py, keep_alive)
            fabric.fail(self.unreachable([link.peer], f"answered no keep-alive ({exc})"))
            return
        detail = f": {exc}" if exc else ""
        fabric.fail(
            PeerDisconnected(
                f"rank {link.peer} disconnected ({link.describe()}){detail}", link.peer
            )
        )

    # -- hosts that stopped acknowledging ----------------------------------------------------

    def look(self, now: float) -> None:
        """Called while an operation waits (every watchdog tick, at most every
        ``LOOK_EVERY`` s): break the group with :meth:`unreachable` where links to other
        hosts have had something waiting for their host's acknowledgement for
        :attr:`silence` seconds or more, on this look and the previous one, with no
        acknowledgement in between (one look could catch a live host's window probe
        in flight). A live host's kernel acknowledges whatever its process does.

        Args:
            now: the loop's time.
        """
        fabric = self._fabric
        if self.silence <= 0 or now - self._looked < LOOK_EVERY or fabric.failure is not None:
            return
        self._looked = now
        before, self._silent = self._silent, {}
        lost = []
        for peer, link in fabric.links.items():
            quiet = link.unanswered()
            if quiet is None or quiet < self.silence:
                continue
            self._silent[peer] = (now, quiet)
            seen = before.get(peer)
            if seen is not None and quiet - seen[1] >= now - seen[0] - LOOK_SLACK:
                lost.append(peer)
        if lost:
            quiet = max(self._silent[p][1] for p in lost)
            fabric.fail(self.unreachable(lost, f"acknowledged nothing for {quiet:.1f} s"))

    def unreachable(self, peers: list[int], how: str) -> PeerDisconnected:
        """The error for hosts of world ranks ``peers`` that stopped answering (``how``),
        naming the first one's link and the ranks on its host.

        Args:
            peers: the ranks whose links went silent (world ranks, not empty).
            how: what their host did not answer, for the message.

        Returns:
            PeerDisconnected with ``rank`` the first of ``peers`` (not raised).
        """
        fabric = self._fabric
        first = peers[0]
        link = fabric.links.get(first)
        notes = []
        hosts = fabric.hosts
        if first < len(hosts):
            mates = [r for r, h in enumerate(hosts) if h == hosts[first]]
            notes.append(f"ranks on that host: {few(mates)}")
        others = sorted(set(peers) - {first})
        if others:
            notes.append(f"the hosts of ranks {few(others)} went silent too")
        notes.append(f"{LINK_SILENCE_ENV}={self.silence:g}")
        return PeerDisconnected(
            f"{link.describe() if link is not None else f'rank {first}'} unreachable: its "
            f"host {how} ({'; '.join(notes)})",
            first,
        )

    # -- probes ----------------------------------------------------------------------------

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
        query = CALLED_QUERY.pack(gid, seq)
        replies = await self._ping(peers, timeout, query)
        dead = sorted(p for p, reply in replies.items() if reply is None)
        absent = sorted(p for p, reply in replies.items() if reply == NOT_CALLED)
        fps: dict[int, Fingerprint] = {}
        for p, reply in replies.items():
            if reply is not None and len(reply) == 1 + _FINGERPRINT.size and reply[:1] == CALLED:
                coll, dtype, count, op, root = _FINGERPRINT.unpack_from(reply, 1)
                fps[p] = (coll, dtype, count, op, root)
        return dead, absent, fps

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
            link = self._fabric.links.get(peer)
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
        held = self._fabric.held_from  # peers whose ABORT is held: they answered that way
        return {
            p: f.result()[len(request) :]
            if f.done() and not f.cancelled()
            else (b"" if p in held else None)
            for p, f in waiting.items()
        }

    def answer(self, link: Link, payload: bytes) -> None:
        """A PING came on ``link``: echo its payload and the answer to its question,
        unless ``PONG_BACKLOG`` or more is queued on the link.

        Args:
            link: the link it came on.
            payload: the PING's payload.
        """
        if not link.closed and link.write_buffer_size() < PONG_BACKLOG:
            reply = payload + self.called(payload)
            link.send(control_header(PONG, len(reply)), reply)

    def on_pong(self, link: Link, payload: bytes) -> None:
        """A PONG came on ``link``: resolve the probe waiting for it, if any.

        Args:
            link: the link it came on.
            payload: the PONG's payload.
        """
        waiter = self._pongs.pop((link.peer, payload[:_TOKEN]), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(payload)

    def called(self, ping: bytes) -> bytes:
        """The answer to a PING's question, if it asks one.

        Args:
            ping: the PING's payload.

        Returns:
            What the PONG appends: nothing, ``NOT_CALLED``, or ``CALLED`` and maybe the
            fingerprint.
        """
        if len(ping) != _TOKEN + CALLED_QUERY.size:
            return b""
        gid, seq = CALLED_QUERY.unpack_from(ping, _TOKEN)
        if self._registry.started.get(gid, -1) < seq:
            return NOT_CALLED
        fp = self._registry.fingerprint(gid, seq)
        return CALLED if fp is None else CALLED + _FINGERPRINT.pack(*fp)


def few(ranks: Iterable[int], most: int = 8) -> str:
    """Ranks for a message: at most ``most`` of them (sorted, without repeats), then how
    many more: a message about a large group stays a line.

    Args:
        ranks: the ranks.
        most: how many to show.

    Returns:
        ``"[1, 2]"``, or ``"[0, 1, ..., 7] and 56 more"``-like text.
    """
    shown = sorted(set(ranks))
    if len(shown) <= most:
        return str(shown)
    return f"{shown[:most]} and {len(shown) - most} more"
