"""A userspace TCP fault proxy, for network-fault tests on machines without ``tc netem``.

:class:`FaultProxy` listens on an address and forwards every connection it accepts to one
target, byte for byte and in order, while injecting faults per direction:

- **delay**: a fixed one-way delay plus uniform jitter. Order is preserved: a segment is
  never released before the one read ahead of it (jitter delays, never reorders).
- **loss**: TCP cannot lose bytes, so loss is emulated the way a TCP receiver sees it: with
  probability ``loss`` a segment (one read, at most ``segment_bytes``) is held back for an
  extra ``rto`` seconds (a retransmission timeout, 200 ms on Linux by default), and every
  later segment waits behind it (head-of-line blocking).
- **stall**: stop forwarding (now, or once a number of bytes passed) until ``resume``; the
  proxy stops reading once ``window_bytes`` are queued, so the sender's socket fills up,
  as with a silent network.
- **cut**: reset (or close) both sides of every connection, now or after a number of bytes.

:mod:`aiocollect.testing.proxynet` puts such a proxy on every rank-to-rank link of a group.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Direction = Literal["forward", "reverse", "both"]
#: Client to target (the connecting rank to the listening rank), and back.
FORWARD: Literal["forward"] = "forward"
REVERSE: Literal["reverse"] = "reverse"
_DIRECTIONS: tuple[Literal["forward"], Literal["reverse"]] = (FORWARD, REVERSE)


def _directions(direction: Direction) -> tuple[Literal["forward", "reverse"], ...]:
    if direction == "both":
        return _DIRECTIONS
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be 'forward', 'reverse' or 'both', not {direction!r}")
    return (direction,)


@dataclass(frozen=True)
class LinkFaults:
    """Faults of one direction of a proxied link.

    Attributes:
        delay: fixed one-way delay in seconds.
        jitter: extra delay drawn uniformly from ``[0, jitter)`` per segment (order kept).
        loss: probability that a segment is "lost", i.e. held back for ``rto`` more seconds.
        rto: the retransmission delay of a lost segment, in seconds.
    """

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    rto: float = 0.2

    def __post_init__(self) -> None:
        if min(self.delay, self.jitter, self.rto) < 0 or not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"invalid faults {self!r}: times must be >= 0, loss in [0, 1]")


class _Trigger:
    """Fire ``action`` once ``remaining`` more bytes crossed the proxy in ``dirs``."""

    __slots__ = ("action", "dirs", "remaining")

    def __init__(self, dirs: tuple[str, ...], remaining: int, action: Callable[[], None]) -> None:
        self.dirs = dirs
        self.remaining = remaining
        self.action = action


class _Pipe:
    """One direction of one proxied connection: a reader task queues segments with their
    release times, a writer task forwards them when due and the direction is not stalled."""

    def __init__(
        self,
        proxy: FaultProxy,
        conn: _Connection,
        direction: Literal["forward", "reverse"],
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.conn = conn
        self.direction = direction
        self.src = src
        self.dst = dst
        self.queue: deque[tuple[float, bytes | None]] = deque()
        self.queued_bytes = 0
        self.last_release = 0.0
        self.changed = asyncio.Event()

    def _notify(self) -> None:
        self.changed.set()

    async def _wait_change(self) -> None:
        self.changed.clear()
        await self.changed.wait()

    async def read_loop(self) -> None:
        """Read segments and queue them with their release times; EOF queues ``None``."""
        loop = asyncio.get_running_loop()
        proxy = self.proxy
        while True:
            while self.queued_bytes >= proxy.window_bytes:
                await self._wait_change()
            data = await self.src.read(proxy.segment_bytes)
            if self.conn.closed:
                return
            faults = proxy.faults[self.direction]
            release = loop.time() + faults.delay
            if faults.jitter:
                release += proxy.rng.uniform(0.0, faults.jitter)
            if data and faults.loss and proxy.rng.random() < faults.loss:
                release += faults.rto
                proxy.lost[self.direction] += 1
            release = max(release, self.last_release)  # never overtake an earlier segment
            self.last_release = release
            self.queue.append((release, data or None))
            self.queued_bytes += len(data)
            self._notify()
            if not data:
                return

    async def write_loop(self) -> None:
        """Forward queued segments in order once due; half-close the destination at EOF."""
        loop = asyncio.get_running_loop()
        proxy = self.proxy
        while True:
            while not self.queue:
                await self._wait_change()
            release, data = self.queue[0]
            wait = release - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                self.queue.popleft()
                if self.dst.can_write_eof():
                    self.dst.write_eof()
                return
            view = memoryview(data)
            while view:
                await proxy.gates[self.direction].wait()
                if self.conn.closed:  # cut (maybe by the trigger just fired): drop the rest
                    return
                n = proxy._allowance(self.direction, len(view))
                if n:
                    self.dst.write(view[:n])
                    view = view[n:]
                    self.queued_bytes -= n
                    proxy._account(self.direction, n)
                    await self.dst.drain()
                    self._notify()
                proxy._fire_due()
            self.queue.popleft()


class _Connection:
    """A client connection and its upstream connection, with their two pipes."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.writers = (client[1], upstream[1])
        self.pipes = (
            _Pipe(proxy, self, FORWARD, client[0], upstream[1]),
            _Pipe(proxy, self, REVERSE, upstream[0], client[1]),
        )
        self.task: asyncio.Task[Any] | None = None
        self.closed = False

    async def run(self) -> None:
        """Pump both directions until both ended; a failed side resets the other."""
        self.task = asyncio.current_task()
        try:
            async with asyncio.TaskGroup() as tg:
                for pipe in self.pipes:
                    tg.create_task(pipe.read_loop())
                    tg.create_task(pipe.write_loop())
        except* OSError:
            self.close_sockets(reset=True)  # pass a reset on as a reset
        else:
            self.close_sockets(reset=False)

    def cut(self, reset: bool) -> None:
        """Close both sockets now and stop pumping (from any task)."""
        self.close_sockets(reset)
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def close_sockets(self, reset: bool) -> None:
        """Close both sockets: with ``reset``, send RST (SO_LINGER 0) instead of FIN."""
        self.closed = True
        for writer in self.writers:
            _close_writer(writer, reset)


def _close_writer(writer: asyncio.StreamWriter, reset: bool) -> None:
    if reset:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


class FaultProxy:
    """Forward TCP connections from a listening address to ``target``, injecting faults.

    Use as ``async with FaultProxy(host, port) as proxy:`` (or ``await proxy.start()`` and
    ``await proxy.close()``), then connect to ``proxy.host``/``proxy.port``. Faults can be
    changed at any time and apply to segments read from then on.

    Args:
        target_host, target_port: where accepted connections are forwarded.
        listen_host, listen_port: where to listen (port 0: any free port).
        faults: faults of both directions (``forward``: client to target).
        reverse: faults of the reverse direction, if different.
        seed: seed of the random generator (jitter and loss), for reproducible runs.
        window_bytes: at most this many bytes are queued per direction and connection
            (a bandwidth-delay product: throughput <= window / delay).
        segment_bytes: the largest read, i.e. the unit of emulated loss.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        faults: LinkFaults | None = None,
        reverse: LinkFaults | None = None,
        seed: int | str | None = None,
        window_bytes: int = 4 << 20,
        segment_bytes: int = 64 << 10,
    ) -> None:
        self.target = (target_host, target_port)
        self._listen = (listen_host, listen_port)
        base = faults or LinkFaults()
        self.faults: dict[str, LinkFaults] = {FORWARD: base, REVERSE: reverse or base}
        self.rng = random.Random(seed)
        self.window_bytes = window_bytes
        self.segment_bytes = segment_bytes
        self.gates = {d: asyncio.Event() for d in _DIRECTIONS}
        for gate in self.gates.values():
            gate.set()
        self.forwarded = dict.fromkeys(_DIRECTIONS, 0)
        self.lost = dict.fromkeys(_DIRECTIONS, 0)
        self.connections_accepted = 0
        #: ``(time.monotonic(), what)`` of every stall and cut applied, in order.
        self.fired: list[tuple[float, str]] = []
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._triggers: list[_Trigger] = []
        self._server: asyncio.Server | None = None
        self._connected = asyncio.Event()
        self.host = listen_host
        self.port = listen_port

    def __repr__(self) -> str:
        return (
            f"FaultProxy({self.host}:{self.port} -> {self.target[0]}:{self.target[1]}, "
            f"forwarded={self.forwarded})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> FaultProxy:
        """Start listening; ``host``/``port`` then give the address to connect to.

        Raises:
            OSError: the listening address cannot be bound.
        """
        self._server = await asyncio.start_server(self._accept, *self._listen)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        return self

    async def close(self) -> None:
        """Stop listening and reset every connection. Idempotent."""
        if self._server is not None:
            self._server.close()
        self.cut(reset=True)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own (not asyncio's client_connected_cb task): ``cut`` cancels it.
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_connection(*self.target)
        except BaseException as exc:
            _close_writer(writer, reset=True)  # like a refused connection
            if isinstance(exc, OSError):
                return
            raise
        conn = _Connection(self, (reader, writer), upstream)
        self._connections.add(conn)
        self.connections_accepted += 1
        self._connected.set()
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)

    async def wait_connected(self) -> None:
        """Return once at least one connection has been accepted and forwarded."""
        await self._connected.wait()

    @property
    def active(self) -> int:
        """Connections currently proxied."""
        return len(self._connections)

    # -- faults ------------------------------------------------------------------------------

    def set_faults(self, faults: LinkFaults, direction: Direction = "both") -> None:
        """Apply ``faults`` to segments read from now on in ``direction``."""
        for d in _directions(direction):
            self.faults[d] = faults

    def stall(self, direction: Direction = "both", *, after_bytes: int = 0) -> None:
        """Stop forwarding in ``direction`` (nothing is dropped) until :meth:`resume`;
        with ``after_bytes``, only once that many more bytes crossed in ``direction``
        (counted together when both), so the stall lands mid-stream at a known byte."""
        dirs = _directions(direction)

        def stop() -> None:
            self.fired.append((time.monotonic(), f"stall {direction}"))
            for d in dirs:
                self.gates[d].clear()

        self._schedule(dirs, after_bytes, stop)

    def resume(self, direction: Direction = "both") -> None:
        """Forward again in ``direction``; forget stalls still waiting for their bytes."""
        dirs = _directions(direction)
        self._triggers = [t for t in self._triggers if not set(t.dirs) & set(dirs)]
        if any(not self.gates[d].is_set() for d in dirs):
            self.fired.append((time.monotonic(), f"resume {direction}"))
        for d in dirs:
            self.gates[d].set()

    def cut(
        self, *, reset: bool = True, after_bytes: int = 0, direction: Direction = "both"
    ) -> None:
        """Close both sides of every current connection: at once, or once ``after_bytes``
        more bytes crossed in ``direction``. ``reset`` sends RST (like a middlebox dropping
        the flow); otherwise both sides see a clean EOF. The listener stays open."""

        def cut_all() -> None:
            self.fired.append((time.monotonic(), "reset" if reset else "close"))
            for conn in list(self._connections):
                conn.cut(reset)
                self._connections.discard(conn)

        self._schedule(_directions(direction), after_bytes, cut_all)

    def _schedule(
        self, dirs: tuple[str, ...], after_bytes: int, action: Callable[[], None]
    ) -> None:
        if after_bytes < 0:
            raise ValueError(f"after_bytes must be >= 0, not {after_bytes}")
        if after_bytes == 0:
            action()
        else:
            self._triggers.append(_Trigger(dirs, after_bytes, action))

    def _allowance(self, direction: str, wanted: int) -> int:
        """How many bytes may be written before the next trigger in ``direction``."""
        limits = [t.remaining for t in self._triggers if direction in t.dirs]
        return min([wanted, *limits])

    def _account(self, direction: str, n: int) -> None:
        self.forwarded[direction] += n
        for t in self._triggers:
            if direction in t.dirs:
                t.remaining -= n

    def _fire_due(self) -> None:
        due = [t for t in self._triggers if t.remaining <= 0]
        if due:
            self._triggers = [t for t in self._triggers if t.remaining > 0]
            for t in due:
                t.action()

    def statistics(self) -> dict[str, Any]:
        """Bytes forwarded and segments "lost" per direction, connections accepted."""
        return {
            "forwarded": dict(self.forwarded),
            "lost": dict(self.lost),
            "connections": self.connections_accepted,
            "active": self.active,
        }


__all__ = ["FORWARD", "REVERSE", "Direction", "FaultProxy", "LinkFaults"]
