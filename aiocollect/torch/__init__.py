"""The ``"aiocollect"`` backend for ``torch.distributed``.

``import aiocollect.torch`` registers it (so does ``import torch``, through the
``torch.backends`` entry point), after which ``torch.distributed.init_process_group(
"aiocollect")`` works under torchrun, ``new_group(...)`` makes sub-groups, every c10d
collective runs on aiocollect and DistributedDataParallel trains with it (CPU tensors).

Registration never breaks ``import torch``: a failure is reported as a warning.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiocollect.torch.backend import AiocollectProcessGroup, create_process_group
    from aiocollect.torch.store import TorchStore
    from aiocollect.torch.work import Work

BACKEND_NAME = "aiocollect"

_lock = threading.Lock()
_LAZY = {
    "AiocollectProcessGroup": "aiocollect.torch.backend",
    "create_process_group": "aiocollect.torch.backend",
    "TorchStore": "aiocollect.torch.store",
    "Work": "aiocollect.torch.work",
}


def register() -> None:
    """Register the ``"aiocollect"`` backend with ``torch.distributed`` (CPU devices).

    Idempotent. It does not make aiocollect the default CPU backend: pass
    ``backend="aiocollect"`` to ``init_process_group`` or ``new_group``.

    Raises:
        ImportError: torch or torch.distributed is not available.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ImportError("torch.distributed is not available in this torch build")
    with _lock:
        if BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])


def _create(store: Any, rank: int, world_size: int, timeout: Any) -> Any:
    # Imported on first use, so that `import torch` stays cheap.
    from aiocollect.torch.backend import create_process_group

    return create_process_group(store, rank, world_size, timeout)


def _autoload() -> None:
    """The ``torch.backends`` entry point, called by ``import torch``; never raises."""
    try:
        register()
    except Exception as exc:
        warnings.warn(
            f"aiocollect: the torch backend 'aiocollect' was not registered "
            f"({exc!r}); `import aiocollect.torch` registers it explicitly",
            RuntimeWarning,
            stacklevel=2,
        )


def get_process_group(group: Any = None) -> AiocollectProcessGroup:
    """The :class:`AiocollectProcessGroup` behind a torch group (default: the world).

    Raises:
        UsageError: ``group`` is not served by the aiocollect backend.
    """
    import torch.distributed as dist

    from aiocollect.errors import UsageError
    from aiocollect.torch.backend import AiocollectProcessGroup

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, AiocollectProcessGroup):
        raise UsageError(f"{pg!r} is not an aiocollect process group")
    return pg


def check(group: Any = None) -> None:
    """Raise GroupBrokenError if a collective of ``group`` (default: the world) failed.

    Futures of failed collectives complete normally (DistributedDataParallel would
    otherwise terminate the process); call this after ``optimizer.step()`` to stop at the
    first bad step rather than at the next collective.
    """
    get_process_group(group).check()


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """gloo's ``monitored_barrier`` for an aiocollect group (default: the world), which
    ``torch.distributed.monitored_barrier`` refuses for any backend but gloo.

    Args:
        timeout: a ``timedelta`` (default: the group's default timeout).
        wait_all_ranks: rank 0 names every rank that did not arrive, not only the first.

    Raises:
        MonitoredBarrierError: ranks did not arrive in time (a RuntimeError; ``ranks``).
        UsageError: ``group`` is not served by the aiocollect backend.
    """
    get_process_group(group).monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocollect.torch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def _register_on_import() -> None:
    if importlib.util.find_spec("torch") is None:
        raise ImportError("aiocollect.torch needs PyTorch: pip install 'aiocollect[torch]'")
    _autoload()


_register_on_import()

__all__ = [
    "BACKEND_NAME",
    "AiocollectProcessGroup",
    "TorchStore",
    "Work",
    "check",
    "create_process_group",
    "get_process_group",
    "monitored_barrier",
    "register",
]
