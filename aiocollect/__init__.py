"""aiocollect: asyncio-native collective communications.

``open_group`` forms a group of processes (or of tasks on one loop); its methods
(allreduce, broadcast, allgather, ...) return awaitable handles, so many collectives can be
in flight at once on one event loop.
"""

from __future__ import annotations

# First: decides whether the one-frame path loads compiled, before any of it is imported.
from aiocollect import _compiled  # noqa: F401
from aiocollect._buffers import Buffer
from aiocollect.api import join_group, open_group
from aiocollect.errors import (
    AiocollectError,
    AuthenticationError,
    GroupBrokenError,
    InternalError,
    MismatchError,
    PeerDisconnected,
    PeerError,
    PeerTimeout,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    StoreError,
    StoreTimeout,
    UsageError,
)
from aiocollect.group import Group
from aiocollect.stats import LinkStatistics, Statistics
from aiocollect.store import Store
from aiocollect.types import ReduceOp

__version__ = "0.1.0"
"""The installed aiocollect's version: the one place it is written (the package metadata,
``aiocollect --version`` and CHANGELOG.md's headings follow it)."""

SUM = ReduceOp.SUM
"""``ReduceOp.SUM``: elementwise sum (the default ``op``)."""
PROD = ReduceOp.PROD
"""``ReduceOp.PROD``: elementwise product."""
MIN = ReduceOp.MIN
"""``ReduceOp.MIN``: elementwise minimum."""
MAX = ReduceOp.MAX
"""``ReduceOp.MAX``: elementwise maximum."""
AVG = ReduceOp.AVG
"""``ReduceOp.AVG``: elementwise mean over the ranks, the sum divided by ``world_size``
(floating-point and complex dtypes)."""
BAND = ReduceOp.BAND
"""``ReduceOp.BAND``: elementwise bitwise and (integer and bool dtypes)."""
BOR = ReduceOp.BOR
"""``ReduceOp.BOR``: elementwise bitwise or (integer and bool dtypes)."""
BXOR = ReduceOp.BXOR
"""``ReduceOp.BXOR``: elementwise bitwise exclusive or (integer and bool dtypes)."""

__all__ = [
    "AVG",
    "BAND",
    "BOR",
    "BXOR",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "AiocollectError",
    "AuthenticationError",
    "Buffer",
    "Group",
    "GroupBrokenError",
    "InternalError",
    "LinkStatistics",
    "MismatchError",
    "PeerDisconnected",
    "PeerError",
    "PeerTimeout",
    "ProtocolError",
    "ReduceOp",
    "RendezvousError",
    "RendezvousTimeout",
    "Statistics",
    "Store",
    "StoreError",
    "StoreTimeout",
    "UsageError",
    "__version__",
    "join_group",
    "open_group",
]
