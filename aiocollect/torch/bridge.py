"""The c10d bridge: registers the ``"aiocollect"`` backend with ``torch.distributed`` and is
the creator torch calls for ``init_process_group("aiocollect")`` and every ``new_group`` of
it; also the ``Options`` the process group shows.

Where c10d's interfaces differ between torch releases, this module adapts by looking at
what the installed torch offers (attributes, signatures), never at its version number.

Only torch.distributed is imported at module level: ``import torch`` loads this module
through the ``torch.backends`` entry point, so aiocollect's groups are imported on the first
group's creation.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from aiocollect.torch.process_group import AiocollectProcessGroup

BACKEND_NAME = "aiocollect"
"""The name the backend is registered under: ``dist.init_process_group(backend="aiocollect")``."""

_lock = threading.Lock()


@dataclass
class Options:
    """What ``pg.options`` shows (the fields of gloo's ``Options`` that apply).

    Attributes:
        _timeout: the default deadline of this group's collectives (``timedelta(0)``: none).
        backend: the backend's name, ``"aiocollect"``.
    """

    _timeout: timedelta
    backend: str = BACKEND_NAME


def register() -> None:
    """Register the ``"aiocollect"`` backend with ``torch.distributed`` (CPU devices).

    Idempotent. It does not make aiocollect the default CPU backend: pass
    ``backend="aiocollect"`` to ``init_process_group`` or ``new_group``.

    Raises:
        ImportError: torch.distributed is not available in this torch build.
    """
    if not dist.is_available():
        raise ImportError("torch.distributed is not available in this torch build")
    with _lock:
        if BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu"])


def create_process_group(
    store: Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    *args: Any,
    **kwargs: Any,
) -> AiocollectProcessGroup:
    """The backend creator torch calls for ``init_process_group("aiocollect")`` and for
    every ``new_group`` of this backend.

    Forms an aiocollect group through ``store`` (the group's c10d PrefixStore) on this
    process's loop thread; blocks until every rank has joined.

    Args:
        store: the group's c10d store.
        rank: this process's rank in the group.
        world_size: the group's size.
        timeout: the rendezvous deadline and the default deadline of the group's
            collectives (``timedelta(0)`` or less: none).
        *args: anything a torch release passes beyond these (ignored).
        **kwargs: anything a torch release passes beyond these by name (ignored; the
            releases run, 2.9 to 2.15, pass the four above only).

    Returns:
        The process group, formed on every rank.

    Raises:
        RendezvousTimeout: some ranks did not join within ``timeout`` (named).
        RendezvousError: the rendezvous failed otherwise.
        StoreError: the store failed.
        AuthenticationError: a peer did not prove ``AIOCOLLECT_SECRET``.
    """
    del args, kwargs
    # Imported here, not at module level: see the module docstring.
    import aiocollect
    from aiocollect.group import Group
    from aiocollect.torch._loop import loop_thread
    from aiocollect.torch.process_group import AiocollectProcessGroup
    from aiocollect.torch.store import TorchStore

    total = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
    seconds = total if total > 0 else None
    adapter = TorchStore(store, timeout=seconds or 1800.0)
    thread = loop_thread()
    host = _listen_address(store)

    async def form() -> Group:
        # Incarnations of a group on one store (destroy + init again) get distinct names.
        generation = (await adapter.add("aiocollect/generation", 1) - 1) // world_size
        return await aiocollect.open_group(
            rank, world_size, store=adapter, name=f"torch-{generation}", timeout=seconds, host=host
        )

    group = thread.run(form())
    thread.track(group)
    return AiocollectProcessGroup(group, thread, store)


def _listen_address(store: Store) -> str:
    """Where this rank's links listen: AIOCOLLECT_IFNAME's address, else the address that
    routes to torchrun's MASTER_ADDR or to the TCPStore's host, else loopback."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    from aiocollect.api import listen_host

    target = os.environ.get("MASTER_ADDR")
    inner: Any = store
    while target is None and isinstance(inner, PrefixStore):
        inner = inner.underlying_store
    if target is None and isinstance(inner, TCPStore):
        target = inner.host
    return listen_host(None, f"tcp://{target or '127.0.0.1'}:0")


__all__ = ["BACKEND_NAME", "Options", "create_process_group", "register"]
