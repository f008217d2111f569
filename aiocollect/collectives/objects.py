"""The object collectives' algorithms: serialised values (``aiocollect.objects``) moved
by the array algorithms, sizes first.

- broadcast: the root's size by binomial tree, checked against ``MAX_OBJECT_BYTES`` on
  every receiver before anything is allocated, then the bytes by binomial tree.
- gather (allgather_object, gather_object): allgatherv of the serialised values
  (``vector.gather_v`` with ``MAX_OBJECT_BYTES`` as the limit; by Bruck's rounds from
  ``select.BRUCK_MIN_RANKS`` ranks on, else by ring: ``vector.small_gather``), decoded on every
  rank or on the root only.

Decoding failures are ProtocolError naming the rank the bytes came from.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiocollect import objects
from aiocollect._buffers import Array
from aiocollect.collectives import tree, vector
from aiocollect.engine.op import Op
from aiocollect.errors import ProtocolError

_I64 = np.dtype(np.int64)


async def broadcast(o: Op, obj: Any, payload: bytes, root: int, allow_pickle: bool) -> Any:
    """``root``'s ``obj`` (serialised there as ``payload``; other ranks pass b"") on every
    rank: the root returns ``obj`` itself, the others the decoded copy.

    Raises:
        ProtocolError: the declared size or the bytes are not what a real rank sends.
    """
    size = np.array([len(payload)], dtype=_I64)
    await tree.broadcast(o, size, root, slot=0)
    await o.finish()
    if o.rank == root:
        data = np.frombuffer(bytearray(payload), np.uint8)
    else:
        parent = ((tree.tree_links((o.rank - root) % o.size, o.size)[0] or 0) + root) % o.size
        source = f"rank {root}" + ("" if parent == root else f" (through rank {parent})")
        declared = int(size[0])
        if not 0 <= declared <= objects.MAX_OBJECT_BYTES:
            raise ProtocolError(
                f"broadcast_object (op #{o.seq}): {source} declared a value of "
                f"{declared} bytes (at most {objects.MAX_OBJECT_BYTES})"
            )
        data = np.empty(declared, np.uint8)
    await tree.broadcast(o, data, root, slot=1)
    await o.finish()
    if o.rank == root:
        return obj
    return objects.loads(data.tobytes(), allow_pickle, f"broadcast_object (op #{o.seq}): {source}")


async def gather(
    o: Op, payload: Array, kind: str, root: int | None, allow_pickle: bool
) -> list[Any] | None:
    """Every rank's value (serialised as the uint8 ``payload``), in rank order, decoded on
    every rank (``root`` None) or on ``root`` only (None elsewhere). ``kind`` names the
    collective in errors.

    Raises:
        ProtocolError: a declared size or a value is not what a real rank sends.
    """
    gather = vector.small_gather(o.size)
    blocks = await vector.gather_v(o, payload, kind, objects.MAX_OBJECT_BYTES, gather)
    if root is not None and o.rank != root:
        return None
    return [
        objects.loads(b.tobytes(), allow_pickle, f"{kind} (op #{o.seq}): rank {r}")
        for r, (_, b) in enumerate(blocks)
    ]
