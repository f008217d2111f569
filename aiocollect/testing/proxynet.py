"""Proxied groups: :class:`ProxyNetwork` puts a fault proxy
(:class:`~aiocollect.testing.faultproxy.FaultProxy`) on every rank-to-rank link of a group
without touching the library.

Each rank gets a :class:`ProxiedStore`, a Store wrapper (a :class:`RecordView`) that rewrites
the rank records read during rendezvous (``aiocollect/<name>/rank/<r>``: ``address``/``port``,
and without the name of the rank's Unix socket) so that the reader connects to a proxy for
that (reader, target) pair instead of the target.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack

from aiocollect.store.base import Store
from aiocollect.testing.faultproxy import Direction, FaultProxy, LinkFaults

_RECORD_KEY = re.compile(r"^aiocollect/(?P<name>.+)/rank/(?P<rank>\d+)$")


class RecordView(Store):
    """A view of ``inner`` whose ``get`` of a rendezvous record (``aiocollect/<name>/rank/
    <r>``) returns ``await rewrite(key, value)`` instead of ``value``: what the reading rank
    learns of its peers, changed for a test. Everything else passes through. Closing the
    view does not close ``inner``."""

    def __init__(self, inner: Store, rewrite: Callable[[str, bytes], Awaitable[bytes]]) -> None:
        self.inner = inner
        self.rewrite = rewrite
        self.timeout = inner.timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    async def set(self, key: str, value: bytes) -> None:
        await self.inner.set(key, value)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        value = await self.inner.get(key, timeout=timeout)
        if _RECORD_KEY.match(key) is None:
            return value
        return await self.rewrite(key, value)

    async def add(self, key: str, amount: int) -> int:
        return await self.inner.add(key, amount)

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        await self.inner.wait(keys, timeout=timeout)

    async def check(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.check(keys)

    async def delete(self, key: str) -> bool:
        return await self.inner.delete(key)


class ProxiedStore(RecordView):
    """A view of ``inner`` for rank ``rank`` whose ``get`` of a rendezvous record points the
    reader at ``network``'s proxy for the (reader, target) pair. Everything else passes
    through. Closing the view does not close ``inner``."""

    def __init__(self, inner: Store, rank: int, network: ProxyNetwork) -> None:
        super().__init__(inner, functools.partial(network.rewrite, rank))
        self.rank = rank
        self.network = network

    def __repr__(self) -> str:
        return f"ProxiedStore({self.inner!r}, rank={self.rank})"


class ProxyNetwork:
    """A :class:`FaultProxy` on every rank-to-rank link of the groups formed through it.

    Give rank ``r`` the store ``network.store_for(r)`` (any transport built on TCP). The
    proxy of the link between ranks ``a`` and ``b`` is ``network.link(a, b)``;
    ``network.set_faults`` changes every link, present and future.

    Args:
        inner: the store the ranks really share (e.g. a ``MemoryStore``).
        faults: the faults of every link (both directions) from the start.
        host: where the proxies listen.
        seed: base seed; each proxy gets its own generator derived from it.
    """

    def __init__(
        self,
        inner: Store,
        *,
        faults: LinkFaults | None = None,
        host: str = "127.0.0.1",
        seed: int | None = 0,
    ) -> None:
        self.inner = inner
        self.faults = faults or LinkFaults()
        self.host = host
        self.seed = seed
        self.proxies: dict[tuple[str, int, int], FaultProxy] = {}
        self._lock = asyncio.Lock()

    def store_for(self, rank: int) -> ProxiedStore:
        """The store rank ``rank`` must use."""
        return ProxiedStore(self.inner, rank, self)

    async def rewrite(self, reader: int, key: str, value: bytes) -> bytes:
        """``value`` as ``reader`` must see it: another rank's TCP record points at the
        proxy of the (reader, target) pair (started on first use)."""
        m = _RECORD_KEY.match(key)
        if m is None or int(m["rank"]) == reader:
            return value
        try:
            rec = msgpack.unpackb(value, raw=False)
            address, port, transport = str(rec["address"]), int(rec["port"]), rec["transport"]
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            return value  # not a record we understand: let rendezvous judge it
        if transport not in ("tcp", "tls"):
            return value
        proxy_key = (m["name"], reader, int(m["rank"]))
        async with self._lock:
            proxy = self.proxies.get(proxy_key)
            if proxy is None or proxy.target != (address, port):
                if proxy is not None:
                    await proxy.close()
                seed = None if self.seed is None else f"{self.seed}/{proxy_key}"
                proxy = FaultProxy(
                    address, port, listen_host=self.host, faults=self.faults, seed=seed
                )
                self.proxies[proxy_key] = await proxy.start()
        # Without its Unix socket's name (``unix``, auto and shm on one host), so that a
        # rank on this host connects through the proxy too.
        rec.pop("unix", None)
        return bytes(
            msgpack.packb({**rec, "address": proxy.host, "port": proxy.port}, use_bin_type=True)
        )

    def link(self, a: int, b: int, name: str | None = None) -> FaultProxy:
        """The proxy carrying the link between ranks ``a`` and ``b`` (of group ``name``,
        needed only when several groups formed through this network).

        Raises:
            LookupError: no connection between them went through a proxy.
        """
        found = [
            p
            for (n, r, t), p in self.proxies.items()
            if {r, t} == {a, b} and (name is None or n == name) and p.connections_accepted
        ]
        if len(found) != 1:
            raise LookupError(
                f"{len(found)} proxied links between ranks {a} and {b}"
                + ("" if name is None else f" of group {name!r}")
            )
        return found[0]

    def set_faults(self, faults: LinkFaults, direction: Direction = "both") -> None:
        """Apply ``faults`` to every link from now on (and to links formed later)."""
        if direction == "both":
            self.faults = faults
        for proxy in self.proxies.values():
            proxy.set_faults(faults, direction)

    async def close(self) -> None:
        """Close every proxy (resetting what they still carry). ``inner`` stays open."""
        for proxy in self.proxies.values():
            await proxy.close()
        self.proxies.clear()

    async def __aenter__(self) -> ProxyNetwork:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def run_ranks(
        self,
        world_size: int,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        name: str,
        timeout: float | None = 60.0,
        **options: Any,
    ) -> list[Any]:
        """Like :func:`aiocollect.testing.run_ranks` over TCP with every link proxied:
        open group ``name`` for each rank on this loop, run ``fn(group, *args)``, close it.

        Returns:
            The results in rank order.

        Raises:
            ExceptionGroup: of ``RankFailed`` (cause: the rank's exception), as run_ranks.
        """
        from aiocollect.testing import run_ranks

        options.setdefault("transport", "tcp")
        return await run_ranks(
            world_size, fn, *args, store=self.store_for, name=name, timeout=timeout, **options
        )


__all__ = ["ProxiedStore", "ProxyNetwork", "RecordView"]
