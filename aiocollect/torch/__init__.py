"""The ``"aiocollect"`` backend for ``torch.distributed``.

``import aiocollect.torch`` registers it (so does ``import torch``, through the
``torch.backends`` entry point), after which ``torch.distributed.init_process_group(
"aiocollect")`` works under torchrun, ``new_group(...)`` makes sub-groups, every c10d
collective runs on aiocollect and DistributedDataParallel trains with it (CPU tensors).

Registration never breaks ``import torch``: a failure is reported as a warning.

Modules: ``bridge`` (registration, the creator torch calls, options), ``process_group``
(the collective methods), ``_point_to_point`` (send, recv, all_to_all), ``_runner``
(running them on the loop thread), ``monitored`` (the monitored barrier), ``errors``,
``store`` (a c10d store as aiocollect's), ``work`` (the Work objects); the plans of the
calls in ``_plan``, ``_reductions``, ``_movement`` and ``_alltoall``.
"""

from __future__ import annotations

import importlib.util
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if importlib.util.find_spec("torch") is None:
    raise ImportError("aiocollect.torch needs PyTorch: pip install 'aiocollect[torch]'")

from aiocollect.torch.bridge import BACKEND_NAME, create_process_group, register

if TYPE_CHECKING:
    from aiocollect.torch.errors import CollectiveTimeout, MonitoredBarrierError
    from aiocollect.torch.process_group import AiocollectProcessGroup
    from aiocollect.torch.store import TorchStore
    from aiocollect.torch.work import Work

# Imported on first use, so that `import torch` (which imports this package) stays cheap.
_LAZY = {
    "AiocollectProcessGroup": "aiocollect.torch.process_group",
    "CollectiveTimeout": "aiocollect.torch.errors",
    "MonitoredBarrierError": "aiocollect.torch.errors",
    "TorchStore": "aiocollect.torch.store",
    "Work": "aiocollect.torch.work",
}


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
    """The :class:`AiocollectProcessGroup` behind a torch group.

    Args:
        group: a ``torch.distributed`` process group; None: the default (world) group.

    Returns:
        The aiocollect process group.

    Raises:
        UsageError: ``group`` is not served by the aiocollect backend.
    """
    import torch.distributed as dist

    from aiocollect.errors import UsageError
    from aiocollect.torch.process_group import AiocollectProcessGroup

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, AiocollectProcessGroup):
        raise UsageError(f"{pg!r} is not an aiocollect process group")
    return pg


def check(group: Any = None) -> None:
    """Raise if a collective of ``group`` failed.

    Futures of failed collectives made by DistributedDataParallel complete normally (torch's
    reducer would otherwise terminate the process); call this after ``backward()`` to stop
    at the first bad step rather than at the next collective.

    Args:
        group: a ``torch.distributed`` process group; None: the default (world) group.

    Raises:
        GroupBrokenError: a collective of the group failed (``__cause__``: its error).
        UsageError: ``group`` is not served by the aiocollect backend.
    """
    get_process_group(group).check()


def monitored_barrier(
    group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """gloo's ``monitored_barrier`` for an aiocollect group, which
    ``torch.distributed.monitored_barrier`` refuses for any backend but gloo.

    Args:
        group: a ``torch.distributed`` process group; None: the default (world) group.
        timeout: how long to wait; None: the group's default timeout.
        wait_all_ranks: rank 0 names every rank that did not arrive, not only the first.

    Raises:
        MonitoredBarrierError: ranks did not arrive in time (a RuntimeError; ``ranks``).
        UsageError: ``group`` is not served by the aiocollect backend.
    """
    get_process_group(group).monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def __getattr__(name: str) -> Any:
    """The lazily imported public names (``AiocollectProcessGroup``, ``TorchStore``...).

    Args:
        name: the attribute asked for.

    Returns:
        The class named ``name``.

    Raises:
        AttributeError: ``name`` is not a public name of this package.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocollect.torch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


_autoload()

__all__ = [
    "BACKEND_NAME",
    "AiocollectProcessGroup",
    "CollectiveTimeout",
    "MonitoredBarrierError",
    "TorchStore",
    "Work",
    "check",
    "create_process_group",
    "get_process_group",
    "monitored_barrier",
    "register",
]
