"""The transports by name: what ``open_group(transport=...)``, ``aiocollect run``,
``aiocollect bench`` and ``aiocollect info`` offer.

A new transport is one module with a :class:`~aiocollect.transport.interface.Transport`
and one line in :data:`BUILTIN` (or, for a test or a plug-in, one :func:`register` call);
nothing else names transports (docs/design.md, "Transports").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiocollect.transport import memory, shm_transport, tcp_listener
from aiocollect.transport.interface import Transport

#: The built-in transports, in the order they are listed (``auto``, the default, first).
BUILTIN: tuple[Transport, ...] = (
    shm_transport.AUTO,
    tcp_listener.TCP,
    tcp_listener.TLS,
    memory.MEMORY,
    shm_transport.SHM,
)

_registry: dict[str, Transport] = {t.name: t for t in BUILTIN}


def names() -> tuple[str, ...]:
    """Every registered transport's name."""
    return tuple(_registry)


def get(name: str) -> Transport | None:
    """The transport registered as ``name``, or None."""
    return _registry.get(name)


def transports() -> tuple[Transport, ...]:
    """Every registered transport."""
    return tuple(_registry.values())


def register(transport: Transport) -> None:
    """Add ``transport`` under its name.

    Raises:
        ValueError: a transport of that name is registered already.
    """
    if transport.name in _registry:
        raise ValueError(f"a transport named {transport.name!r} is registered already")
    _registry[transport.name] = transport


def unregister(name: str) -> None:
    """Remove the transport registered as ``name`` (nothing if there is none)."""
    _registry.pop(name, None)


@contextmanager
def registered(transport: Transport) -> Iterator[Transport]:
    """``transport`` registered for the duration of the ``with`` block."""
    register(transport)
    try:
        yield transport
    finally:
        unregister(transport.name)
