"""Key/value stores for rendezvous: the :class:`Store` contract and its backends.

``open_store`` turns the ``store=`` argument of ``open_group`` (a :class:`Store` or a URL)
into a store object.
"""

from __future__ import annotations

import urllib.parse

from aiocollect.errors import UsageError
from aiocollect.store.base import DEFAULT_TIMEOUT, Store
from aiocollect.store.file import FileStore
from aiocollect.store.memory import MemoryStore
from aiocollect.store.prefix import PrefixStore
from aiocollect.store.redis import RedisStore
from aiocollect.store.tcp import (
    TCPStore,
    TCPStoreServer,
    connect_tcp_store,
    serve_store,
    store_main,
)

SCHEMES = ("tcp", "file", "redis", "rediss", "memory")
_EXAMPLES = "tcp://HOST:PORT, file:///abs/path, redis://HOST:PORT/DB or memory://NAME"


async def open_store(
    spec: Store | str,
    *,
    rank: int,
    secret: bytes | str | None = None,
    insecure: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[Store, bool]:
    """Open the store named by ``spec``.

    URLs:

    - ``tcp://HOST:PORT``: a :class:`TCPStore`; rank 0 starts the embedded server when
      nothing listens there yet (it then lives as long as the returned store). ``secret``
      is required from every client when set; without one the embedded server accepts
      only this host's connections unless ``insecure``.
    - ``file:///abs/path``: a :class:`FileStore` in that directory (``secret`` unused; file
      permissions protect it).
    - ``redis://[:password@]HOST:PORT/DB`` (or ``rediss://``): a :class:`RedisStore`
      (``secret`` unused; Redis's own password applies).
    - ``memory://NAME``: a :class:`MemoryStore` shared by this process.

    Args:
        spec: a :class:`Store` (returned as is) or a URL.
        rank: this rank; rank 0 hosts the embedded TCP store.
        secret: shared secret for TCP stores, or None.
        insecure: without a secret, let the embedded TCP store accept other hosts.
        timeout: seconds to reach the store; also the store's default timeout.

    Returns:
        ``(store, owned)``: ``owned`` is True when the caller created the store and must
        ``close()`` it, False for a ``Store`` passed in.

    Raises:
        UsageError: malformed or unsupported URL, or bad ``rank``.
        StoreError, StoreTimeout, AuthenticationError: the store could not be reached.
    """
    if isinstance(spec, Store):
        return spec, False
    if not isinstance(spec, str):
        raise UsageError(f"store must be a Store or a URL ({_EXAMPLES}), not {spec!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UsageError(f"rank must be a non-negative int, not {rank!r}")
    scheme, _, _ = spec.partition("://")
    scheme = scheme.lower()
    if scheme not in SCHEMES or "://" not in spec:
        raise UsageError(f"unsupported store URL {spec!r}: expected {_EXAMPLES}")
    if scheme in ("redis", "rediss"):
        return RedisStore(spec, timeout=timeout), True
    url = urllib.parse.urlsplit(spec)
    if url.query or url.fragment:
        raise UsageError(f"store URL {spec!r}: query strings and fragments are not supported")
    if scheme == "tcp":
        host, port = _tcp_address(spec, url)
        is_host = rank == 0
        store = await connect_tcp_store(
            host, port, is_host=is_host, secret=secret, insecure=insecure, timeout=timeout
        )
        return store, True
    if scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise UsageError(f"file store URL {spec!r} must be file:///absolute/path")
        path = urllib.parse.unquote(url.path)
        if not path.startswith("/") or path == "/":
            raise UsageError(f"file store URL {spec!r} must name an absolute directory")
        return FileStore(path, timeout=timeout), True
    name = urllib.parse.unquote(url.netloc + url.path)  # memory
    if not name:
        raise UsageError(f"memory store URL {spec!r} needs a name: memory://NAME")
    return MemoryStore(name, timeout=timeout), True


def _tcp_address(spec: str, url: urllib.parse.SplitResult) -> tuple[str, int]:
    if url.path not in ("", "/") or url.username or url.password:
        raise UsageError(f"TCP store URL {spec!r} must be tcp://HOST:PORT")
    try:
        port = url.port
    except ValueError:
        raise UsageError(f"TCP store URL {spec!r}: the port must be 0..65535") from None
    if not url.hostname or port is None:
        raise UsageError(f"TCP store URL {spec!r} must be tcp://HOST:PORT")
    return url.hostname, port


__all__ = [
    "DEFAULT_TIMEOUT",
    "FileStore",
    "MemoryStore",
    "PrefixStore",
    "RedisStore",
    "Store",
    "TCPStore",
    "TCPStoreServer",
    "connect_tcp_store",
    "open_store",
    "serve_store",
    "store_main",
]
