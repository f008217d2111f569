"""``open_group``: wiring of store, rendezvous, transport and group."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl as ssl_module
from collections.abc import Callable, Coroutine, Generator
from types import TracebackType
from typing import Any

from aiocollect import _auth, _fdlimit
from aiocollect._deadline import Deadline
from aiocollect._protect import insecure_from_env
from aiocollect.collectives.neighbours import neighbours
from aiocollect.elastic import generations as _elastic
from aiocollect.engine.fabric import Fabric
from aiocollect.errors import UsageError
from aiocollect.group import Group
from aiocollect.rendezvous.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_FRAME
from aiocollect.rendezvous.rendezvous import RendezvousConfig, rendezvous
from aiocollect.store import Store, open_store
from aiocollect.tls import TLSConfig, as_config
from aiocollect.transport import registry
from aiocollect.transport.wire import WORLD_GID

SSLArg = (
    TLSConfig | ssl_module.SSLContext | tuple[ssl_module.SSLContext, ssl_module.SSLContext] | None
)

_ENV_RANK = ("AIOCOLLECT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_ENV_SIZE = (
    "AIOCOLLECT_WORLD_SIZE",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "SLURM_NTASKS",
)


def _env_int(names: tuple[str, ...], what: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise UsageError(f"environment variable {name}={value!r} is not an int") from None
    del what
    return None


class _DefaultTimeout(float):
    """The type of open_group's default ``timeout`` (300 s), told apart from an explicit
    300.0 so that AIOCOLLECT_TIMEOUT applies only when the caller gave none."""

    def __repr__(self) -> str:
        return f"{float(self)!r}"


DEFAULT_TIMEOUT = _DefaultTimeout(300.0)


def resolve_timeout(timeout: float | None) -> float | None:
    """``timeout`` if given, else AIOCOLLECT_TIMEOUT (seconds, or ``none`` for no deadline),
    else 300 s.

    Args:
        timeout: ``open_group``'s argument (``DEFAULT_TIMEOUT`` where the caller gave
            none).

    Returns:
        The group's default timeout in seconds, or None for no deadline.

    Raises:
        UsageError: AIOCOLLECT_TIMEOUT is not a positive number of seconds or ``none``.
    """
    if timeout is not DEFAULT_TIMEOUT:
        return timeout
    value = os.environ.get("AIOCOLLECT_TIMEOUT", "").strip()
    if not value:
        return float(DEFAULT_TIMEOUT)
    if value.lower() == "none":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(
            f"environment variable AIOCOLLECT_TIMEOUT={value!r} is not a "
            "positive number of seconds (or 'none')"
        )
    return seconds


def resolve_store(store: Store | str | None) -> Store | str:
    """The store argument, else AIOCOLLECT_STORE, else torchrun's MASTER_ADDR/PORT.

    Args:
        store: ``open_group``'s argument, or None.

    Returns:
        The Store, or a store URL (with MASTER_ADDR/PORT: ``tcp://MASTER_ADDR:PORT+1``,
        as torchrun's own store may listen on MASTER_PORT).

    Raises:
        UsageError: no store given and none in the environment.
    """
    if store is not None:
        return store
    env = os.environ.get("AIOCOLLECT_STORE")
    if env:
        return env
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        # torchrun's own TCPStore may already listen on MASTER_PORT; use the next port.
        return f"tcp://{addr}:{int(port) + 1}"
    raise UsageError(
        "no store: pass store=, or set AIOCOLLECT_STORE (or MASTER_ADDR and MASTER_PORT)"
    )


def _interface_address(ifname: str) -> str:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(
                s.fileno(),
                0x8915,  # SIOCGIFADDR
                struct.pack("256s", ifname.encode()[:15]),
            )
        except OSError as exc:
            raise UsageError(f"AIOCOLLECT_IFNAME={ifname}: no IPv4 address ({exc})") from None
    return socket.inet_ntoa(packed[20:24])


def _route_address(target: str) -> str:
    """The local address the kernel would use to reach ``target`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def listen_host(host: str | None, store: Store | str) -> str:
    """Where this rank listens: ``host``, else AIOCOLLECT_IFNAME's address, else the
    address that routes to the store's host, else loopback.

    Args:
        host: ``open_group``'s argument, or None.
        store: the store or its URL (a ``tcp://`` or ``redis://`` host gives the route).

    Returns:
        The address to listen on and publish.

    Raises:
        UsageError: AIOCOLLECT_IFNAME names an interface without an IPv4 address.
    """
    if host:
        return host
    ifname = os.environ.get("AIOCOLLECT_IFNAME")
    if ifname:
        return _interface_address(ifname)
    if isinstance(store, str) and store.startswith(("tcp://", "redis://")):
        netloc = store.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
        target = netloc.rsplit(":", 1)[0].strip("[]")
        if target in ("localhost", "127.0.0.1", "::1", ""):
            return "127.0.0.1" if target != "::1" else "::1"
        try:  # getaddrinfo, not gethostbyname: IPv6 literals and names must work too
            target = str(socket.getaddrinfo(target, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError):
            return "127.0.0.1"
        return _route_address(target)
    return "127.0.0.1"


def _check_links(links: str | None) -> bool:
    """Whether links open on demand (``links``, else AIOCOLLECT_LINKS, else ``lazy``).

    Raises:
        UsageError: neither ``lazy`` nor ``eager``.
    """
    if links is None:
        links = os.environ.get("AIOCOLLECT_LINKS", "").strip().lower() or "lazy"
        what = "environment variable AIOCOLLECT_LINKS"
    else:
        what = "links"
    if links not in ("lazy", "eager"):
        raise UsageError(f"{what} must be 'lazy' or 'eager', got {links!r}")
    return links == "lazy"


def _check_transport(transport: str | None, ssl: SSLArg) -> str:
    """The transport to use (``transport``, else AIOCOLLECT_TRANSPORT, else ``auto``).

    Raises:
        UsageError: no such transport, it needs ``ssl=`` and got none, or it cannot be
            used here (the reason named).
    """
    transport = transport or os.environ.get("AIOCOLLECT_TRANSPORT") or "auto"
    found = registry.get(transport) if isinstance(transport, str) else None
    if found is None:
        raise UsageError(f"transport must be one of {registry.names()}, got {transport!r}")
    if found.needs_tls and ssl is None:
        raise UsageError(
            f"transport={transport!r} needs ssl= (aiocollect.tls.contexts(...) "
            "or an ssl.SSLContext)"
        )
    if (reason := found.unavailable()) is not None:
        raise UsageError(f"transport={transport!r} is not available here: {reason}")
    return transport


async def _open(
    rank: int | None,
    world_size: int | None,
    *,
    store: Store | str | None,
    transport: str | None,
    timeout: float | None,
    secret: bytes | str | None,
    host: str | None,
    ssl: SSLArg,
    name: str,
    chunk_bytes: int | None,
    insecure: bool = False,
    elastic: bool = False,
    links: str | None = None,
) -> Group:
    if rank is None:
        rank = _env_int(_ENV_RANK, "rank")
    if world_size is None:
        world_size = _env_int(_ENV_SIZE, "world size")
    if rank is None or world_size is None:
        raise UsageError(
            "rank and world_size are required (arguments or AIOCOLLECT_RANK / "
            "AIOCOLLECT_WORLD_SIZE, RANK / WORLD_SIZE, ...)"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise UsageError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    transport = _check_transport(transport, ssl)
    lazy = _check_links(links)
    tls = None if ssl is None else as_config(ssl)
    timeout = resolve_timeout(timeout)
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise UsageError(f"timeout must be a positive number, got {timeout!r}")
    # chunk_bytes=None: the default, which the rendezvous records choose (0 in the
    # record); elastic groups keep DEFAULT_CHUNK_BYTES, as every generation must agree.
    chunk = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise UsageError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    chosen = chunk_bytes is None and not elastic
    max_frame = DEFAULT_MAX_FRAME if chosen else chunk
    _fdlimit.raise_soft_limit()  # a descriptor per peer link and store connection
    if secret is None:
        secret = os.environ.get("AIOCOLLECT_SECRET") or None
    key = _auth.as_secret(secret)
    if not isinstance(insecure, bool):
        raise UsageError(f"insecure must be a bool, got {insecure!r}")
    insecure = insecure or insecure_from_env()
    if not isinstance(elastic, bool):
        raise UsageError(f"elastic must be a bool, got {elastic!r}")
    spec = resolve_store(store)
    if transport == "auto" and isinstance(spec, str) and spec.startswith("memory://"):
        transport = "memory"  # ranks in one process; else auto picks shm or tcp per link
    deadline = Deadline.after(timeout)
    if elastic:  # a store that outlives every member: never the embedded one
        store_obj, owned = await _elastic.open_elastic_store(
            spec, secret=key, insecure=insecure, timeout=timeout
        )
    else:
        store_obj, owned = await open_store(
            spec,
            rank=rank,
            secret=key,
            insecure=insecure,
            timeout=300.0 if timeout is None else timeout,
        )
    fabric = Fabric(rank, world_size, max_frame=max_frame)
    try:
        cfg = RendezvousConfig(
            name=name,
            rank=rank,
            world_size=world_size,
            transport=transport,
            host=listen_host(host, spec),
            secret=key,
            ssl=tls,
            insecure=insecure,
            chunk_bytes=0 if chosen else chunk,
            deadline=deadline,
            eager=neighbours(world_size, rank) if lazy else None,
        )
        endpoint, made = await rendezvous(store_obj, cfg, fabric, max_frame=max_frame)
    except BaseException:
        if owned:
            if not elastic:
                await _linger(store_obj, world_size)
            await store_obj.close()
        raise
    fabric.attach(made, endpoint.pulls, endpoint.hosts, endpoint.dialer)
    chunk = endpoint.chunk_bytes
    group = Group(
        fabric,
        WORLD_GID,
        list(range(world_size)),
        timeout=timeout,
        chunk_bytes=chunk,
        name=name,
        store=store_obj,
        sync_closers=[endpoint.close],
        closers=[endpoint.release],  # before the store closes
    )
    if elastic:  # the store is closed by whichever generation is the last
        return await _elastic.start(
            group,
            _elastic.ElasticState(
                _elastic.Shared(store_obj, owned),
                name,
                transport,
                key,
                cfg.host or "127.0.0.1",
                tls,
                insecure,
                chunk,
                timeout,
                lazy=lazy,
            ),
        )
    if owned:
        group.add_closer(store_obj.close)
    return group


#: Seconds at most a rank whose rendezvous failed keeps the embedded store it hosts, until
#: every other rank has connected to it and left: they then read why (RendezvousError)
#: instead of losing the store under them (StoreError).
FAILED_STORE_LINGER = 5.0


async def _linger(store: Store, world_size: int) -> None:
    server = getattr(store, "server", None)
    clients = getattr(server, "_conns", None)
    if clients is None:
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + FAILED_STORE_LINGER
    seen: set[int] = set()
    while loop.time() < end:
        seen.update(id(c) for c in clients)
        if len(seen) >= world_size and len(clients) <= 1:  # this rank's own connection
            return
        await asyncio.sleep(0.05)


class GroupOpener:
    """Returned by :func:`open_group`: ``await`` it for a Group, or use it with
    ``async with`` (closing gracefully on normal exit, aborting on an exception)."""

    def __init__(self, start: Callable[[], Coroutine[Any, Any, Group]]) -> None:
        # ``start`` forms the group: open_group's own call of _open, so its options keep
        # their types (mypy checks that call) instead of travelling as **kwargs
        self._start = start
        self._group: Group | None = None

    def __await__(self) -> Generator[Any, None, Group]:
        return self._start().__await__()

    def __getattr__(self, name: str) -> Any:
        if hasattr(Group, name):
            raise AttributeError(
                f"open_group() returns an opener, not a Group: use `group = await "
                f"open_group(...)` or `async with open_group(...) as group:` before calling "
                f".{name}"
            ) from None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    async def __aenter__(self) -> Group:
        self._group = await self._start()
        return self._group

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if exc is None:
            await group.aclose()
        else:
            group.abort(exc)  # the peers learn what this rank raised
            await asyncio.sleep(0)


def open_group(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    store: Store | str | None = None,
    transport: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    secret: bytes | str | None = None,
    host: str | None = None,
    ssl: SSLArg = None,
    name: str = "default",
    chunk_bytes: int | None = None,
    insecure: bool = False,
    elastic: bool = False,
    links: str | None = None,
) -> GroupOpener:
    """Form a group of ``world_size`` ranks and return it (awaitable / async with).

    Args:
        rank: this rank, 0 to ``world_size - 1`` (else from the environment:
            AIOCOLLECT_RANK, RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID).
        world_size: the number of ranks (else from the environment:
            AIOCOLLECT_WORLD_SIZE, WORLD_SIZE, ...).
        store: a Store or URL (``tcp://H:P``, ``file:///path``, ``redis://H:P/DB``,
            ``memory://NAME``); else AIOCOLLECT_STORE, else MASTER_ADDR/MASTER_PORT.
        transport: ``auto`` (default: shared memory to ranks on this host, TCP to the
            others), ``tcp``, ``tls`` (needs ``ssl``), ``memory``, ``shm`` (shared memory
            to every rank; all must be on one host). Ring size: AIOCOLLECT_SHM_RING_BYTES.
        timeout: default deadline in seconds for rendezvous and every collective
            (None: none). Left out: AIOCOLLECT_TIMEOUT (seconds or ``none``), else 300.
        secret: shared secret; every store connection and peer link must prove it.
            Else AIOCOLLECT_SECRET. Without one (protected mode) the embedded store and
            the peer listeners accept connections from this host only, and tell others
            how to set a secret.
        host: address to listen on and publish (else AIOCOLLECT_IFNAME, else the address
            that routes to the store).
        ssl: for ``transport="tls"``: a :class:`~aiocollect.tls.TLSConfig`, a (server,
            client) pair of ``ssl.SSLContext`` or one context for both.
        name: group name; distinct groups on one store need distinct names.
        chunk_bytes: pipelining chunk size (every rank must use the same).
        insecure: without a secret, accept store and peer connections from any host
            (also AIOCOLLECT_INSECURE=1); only on a network you trust.
        elastic: membership may change at ``group.regroup()`` points (survivors go on,
            processes in ``join_group`` are admitted). The store must outlive every member:
            the embedded TCP store is refused (UsageError); use ``aiocollect store``,
            Redis or a file store.
        links: ``lazy`` (the default): link at once only the peers this rank's
            algorithms exchange with (ring, tree, doubling and dissemination neighbours:
            at most 3 log2(world_size) + 2), every other peer at first use; ``eager``: link
            every pair now (the full mesh). Else AIOCOLLECT_LINKS.

    Returns:
        A :class:`GroupOpener`: ``await`` it for the :class:`~aiocollect.Group`, or use it
        with ``async with`` (closing the group gracefully on normal exit, aborting it on
        an exception). What follows is raised when it is awaited or entered.

    Raises:
        UsageError: bad arguments.
        RendezvousTimeout: ranks missing at the deadline (named).
        RendezvousError: the group could not form (the message says why).
        AuthenticationError: a secret was required and not proven.
        StoreError: the store failed.
    """
    return GroupOpener(
        lambda: _open(
            rank,
            world_size,
            store=store,
            transport=transport,
            timeout=timeout,
            secret=secret,
            host=host,
            ssl=ssl,
            name=name,
            chunk_bytes=chunk_bytes,
            insecure=insecure,
            elastic=elastic,
            links=links,
        )
    )


async def join_group(
    store: Store | str | None = None,
    *,
    name: str = "default",
    secret: bytes | str | None = None,
    transport: str = "auto",
    timeout: float | None = 300.0,
    host: str | None = None,
    ssl: SSLArg = None,
    insecure: bool = False,
) -> Group:
    """Join a running elastic group as a new process: wait until the members' next
    ``regroup()`` admits it and return that generation's Group (this process's rank
    follows the survivors', in arrival order among joiners). Members can see how many wait
    with ``group.joiners()``. Chunk size and default timeout are the group's.

    Args:
        store: the elastic group's store (a standalone TCP store, Redis, or file); else
            AIOCOLLECT_STORE, else MASTER_ADDR/MASTER_PORT.
        name: the group's name.
        secret: its shared secret (else AIOCOLLECT_SECRET).
        transport: as in :func:`open_group`.
        timeout: seconds to wait for admission (None: 300 s), then as long again to form.
        host: as in :func:`open_group`.
        ssl: as in :func:`open_group`.
        insecure: as in :func:`open_group`.

    Returns:
        The Group of the generation that admitted this process.

    Raises:
        UsageError: bad arguments, or an embedded store.
        RendezvousTimeout: no regroup admitted this process in time.
        RendezvousError: the generation could not form.
        AuthenticationError: a secret was required and not proven.
        StoreError: the store failed.
    """
    transport = _check_transport(transport, ssl)
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise UsageError(f"timeout must be a positive number, got {timeout!r}")
    if not isinstance(name, str) or not name:
        raise UsageError(f"name must be a non-empty str, got {name!r}")
    if secret is None:
        secret = os.environ.get("AIOCOLLECT_SECRET") or None
    key = _auth.as_secret(secret)
    insecure = insecure or insecure_from_env()
    spec = resolve_store(store)
    if transport == "auto" and isinstance(spec, str) and spec.startswith("memory://"):
        transport = "memory"
    store_obj, owned = await _elastic.open_elastic_store(
        spec, secret=key, insecure=insecure, timeout=timeout
    )
    state = _elastic.ElasticState(
        _elastic.Shared(store_obj, owned),
        name,
        transport,
        key,
        listen_host(host, spec),
        None if ssl is None else as_config(ssl),
        insecure,
        DEFAULT_CHUNK_BYTES,
        timeout,
        lazy=_check_links(None),
    )
    try:
        return await _elastic.join(state, timeout)
    except BaseException:
        if owned:
            await store_obj.close()
        raise
