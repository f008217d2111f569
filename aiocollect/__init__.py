"""aiocollect: asyncio-native collective communications.

``open_group`` forms a group of processes (or of tasks on one loop); its methods
(allreduce, broadcast, allgather, ...) return awaitable handles, so many collectives can be
in flight at once on one event loop.
"""

from __future__ import annotations

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

SUM = ReduceOp.SUM
PROD = ReduceOp.PROD
MIN = ReduceOp.MIN
MAX = ReduceOp.MAX
AVG = ReduceOp.AVG
BAND = ReduceOp.BAND
BOR = ReduceOp.BOR
BXOR = ReduceOp.BXOR

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
