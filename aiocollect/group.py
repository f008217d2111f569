"""Group: the public collective methods.

Each method validates its arguments (UsageError, before anything is sent), takes the next
sequence number at call time and returns an ``asyncio.Future`` (the awaitable handle): a
Task running the algorithm, or for one-frame allreduces and broadcasts a plain Future
driven by a callback schedule (engine/small.py).
"""

from __future__ import annotations

import asyncio
import os
import zlib
from typing import Any

import numpy as np

from aiocollect import objects
from aiocollect._buffers import Array, as_array
from aiocollect.collectives import barrier as _barrier
from aiocollect.collectives import direct, doubling, pipeline, ring, tree
from aiocollect.collectives.checks import (
    check_rank,
    check_tag,
    divisible,
    fingerprint,
    output,
    reduction,
)
from aiocollect.collectives.select import choose
from aiocollect.engine.op import Op, flat_blocks, split_even
from aiocollect.engine.reduce import copy_into
from aiocollect.errors import MismatchError, ProtocolError, UsageError
from aiocollect.group_core import GroupCore
from aiocollect.types import Collective, ReduceOp

_I64 = np.dtype(np.int64)


def _pulled(op: Op, peer: int, block_bytes: int) -> bool:
    """Whether frames of a ``block_bytes`` block (in chunks) between this rank and group
    rank ``peer`` are pulled out of the sender's memory (shared memory), in either
    direction: the ring then skips its up-front copies (see reduce_scatter, allgather)."""
    frame = min(block_bytes, op.chunk_bytes)
    link = op.link(peer)
    return link.pulls(frame) or not link.copies(frame)


def _flat(arr: Array) -> Array:
    return arr.reshape(-1)


def _host_memory() -> int:
    """Bytes one rank may declare in allgatherv: this host's physical memory (no block
    larger could be received here), at most 2**56 so that sizes cannot overflow int64."""
    try:
        return min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1 << 56)
    except (ValueError, OSError, AttributeError):
        return 1 << 56


async def _gather_v(o: Op, arr: Array, kind: str,
                    limit: int | None = None) -> list[tuple[int, Array]]:
    """The two phases of allgatherv: every rank's (rows, row size), then the rows, by ring.
    Returns (rows, flat block) per rank, in rank order. Each rank's declared size is checked
    before anything is allocated: negative, or above ``limit`` bytes (default: this host's
    memory), is a ProtocolError (no real rank sends that); rows of another size than this
    rank's are a MismatchError."""
    limit = _host_memory() if limit is None else limit
    n = o.size
    row = int(np.prod(arr.shape[1:]))
    sizes = np.zeros((n, 2), dtype=_I64)
    sizes[o.rank] = (arr.shape[0], row)
    await ring.allgather(o, list(sizes), slot0=0)
    await o.finish()
    declared = sizes.tolist()
    for r, (rows, rrow) in enumerate(declared):
        if r != o.rank and (rows < 0 or rrow < 0 or rows * max(rrow, 1) * arr.itemsize > limit):
            via = (o.rank - 1) % n
            raise ProtocolError(
                f"{kind} (op #{o.seq}): rank {r} declared {rows} rows of {rrow} elements of "
                f"{arr.itemsize} bytes (at most {limit} bytes"
                + ("" if via == r else f"; received from rank {via}") + ")")
    for r, (_, rrow) in enumerate(declared):
        if rrow != row:
            raise MismatchError(
                f"{kind}: rank {r} sent rows of {rrow} elements, rank {o.rank} "
                f"rows of {row} (shape {arr.shape})")
    bounds = np.concatenate([[0], np.cumsum(sizes[:, 0] * row)])
    total = np.empty(int(bounds[-1]), dtype=arr.dtype)
    blocks = [total[bounds[i]:bounds[i + 1]] for i in range(n)]
    blocks[o.rank][...] = _flat(arr)
    await ring.allgather(o, blocks, slot0=ring.AG_SLOT)
    await o.finish()  # the last receives land after ring.allgather returns
    return [(rows, block) for (rows, _), block in zip(declared, blocks, strict=True)]


class Group(GroupCore):
    """A set of ranks that run collectives together. Obtain one with ``open_group``."""

    #: The elastic settings (``aiocollect.elastic.ElasticState``) of an elastic group.
    _elastic: Any = None

    # -- elastic groups (aiocollect.elastic) -----------------------------------------------

    @property
    def generation(self) -> int:
        """How many regroups formed this group (0: the group ``open_group`` formed)."""
        root: Any = self
        while root._parent is not None:  # a sub-group belongs to its world group's
            root = root._parent
        return 0 if root._elastic is None else int(root._elastic.generation)

    async def regroup(self, *, min_size: int = 1, timeout: float | None = None) -> Group:
        """Collective of the live members of an elastic group (healthy or broken): form
        and return the next generation, of the members that call it (relative order kept)
        and the processes waiting in ``join_group`` (in arrival order). Members known dead
        are not waited for; silent ones are dropped after ``timeout`` (default: the
        group's). This generation, its sub-groups and in-flight handles end with
        GroupBrokenError.

        Raises:
            UsageError: not an elastic world group, or already regrouped.
            RendezvousError: fewer than ``min_size`` members, or this rank was left out.
            StoreError: the store failed.
        """
        if self._elastic is None:  # sub-groups have none either
            raise UsageError("regroup() needs the world group of open_group(..., "
                             "elastic=True)")
        result: Group = await self._elastic.regroup(self, min_size=min_size, timeout=timeout)
        return result

    async def joiners(self) -> int:
        """How many processes wait in ``join_group`` for this elastic group (not a
        collective: reads the store). Raises UsageError on a non-elastic group."""
        if self._elastic is None:
            raise UsageError("joiners() needs a group of open_group(..., elastic=True)")
        return int(await self._elastic.joiners(self))

    # -- point to point --------------------------------------------------------------------

    def send(self, buf: Any, dst: int, *, tag: int = 0,
             timeout: float | None = None) -> asyncio.Task[None]:
        """Send ``buf`` to rank ``dst``; messages are matched by (source, tag) in order."""
        arr = as_array(buf, "buf", writable=False)
        dst = check_rank(dst, self.world_size, "dst")
        if dst == self.rank:
            raise UsageError("send to self: dst must differ from this rank")
        tag = check_tag(tag)
        fp = fingerprint(Collective.SEND, arr)
        counter = self._next_send(dst, tag)

        async def body(op: Op) -> None:
            for c, part in enumerate(op.chunks(_flat(arr)) or [_flat(arr)]):
                await op.send(dst, tag, c, part)

        return self._start("send", fp, body, timeout, p2p=(counter, tag))

    def recv(self, buf: Any, src: int | None = None, *, tag: int = 0,
             timeout: float | None = None) -> asyncio.Task[int]:
        """Receive into ``buf`` from ``src`` (None: any rank); the handle gives the source."""
        arr = as_array(buf, "buf", writable=True)
        if src is not None:
            src = check_rank(src, self.world_size, "src")
            if src == self.rank:
                raise UsageError("recv from self: src must differ from this rank")
        if self.world_size == 1:
            raise UsageError("recv in a group of one rank can never complete")
        tag = check_tag(tag)
        fp = fingerprint(Collective.SEND, arr)
        counter = -1 if src is None else self._next_recv(src, tag)

        async def body(op: Op) -> int:
            source, seq = (src, counter) if src is not None else await self._match_any(tag)
            for c, part in enumerate(op.chunks(_flat(arr)) or [_flat(arr)]):
                op.recv(source, tag, c, part, expect=fp, seq=seq)
            return source

        return self._start("recv", fp, body, timeout, p2p=(max(counter, 0), tag))

    async def _match_any(self, tag: int) -> tuple[int, int]:
        """Claim the first pending message with ``tag`` from any rank."""
        fabric = self._fabric
        while True:
            for peer in range(self.world_size):
                if peer == self.rank:
                    continue
                seq = self._recv_counters[(peer, tag)]
                link = fabric.links[self._ranks[peer]]
                if link.has_frame((2, self._gid, seq, tag, 0)):
                    return peer, self._next_recv(peer, tag)
            await fabric.p2p_arrival()

    # -- synchronisation and data movement -------------------------------------------------

    def barrier(self, *, timeout: float | None = None,
                algorithm: str | None = None) -> asyncio.Task[None]:
        """Complete once every rank has entered the barrier (dissemination)."""
        alg = choose("barrier", algorithm, 0, self.world_size)
        return self._start("barrier", fingerprint(Collective.BARRIER, None, alg=alg),
                           _barrier.barrier, timeout)

    def broadcast(self, buf: Any, *, root: int = 0, timeout: float | None = None,
                  algorithm: str | None = None) -> asyncio.Future[Any]:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (binomial tree or pipeline)."""
        arr = as_array(buf, "buf", writable=True)
        root = check_rank(root, self.world_size, "root")
        alg = choose("broadcast", algorithm, arr.nbytes, self.world_size)
        fp = fingerprint(Collective.BROADCAST, arr, root=root, alg=alg)
        if alg == 0 and self.world_size > 1 and 0 < arr.nbytes <= self.chunk_bytes:
            return self._schedule("broadcast", fp,
                                  lambda o: tree.small_steps(o, _flat(arr), root), buf, timeout)
        run = (tree.broadcast, pipeline.broadcast)[alg]

        async def body(op: Op) -> Any:
            await run(op, _flat(arr), root)
            return buf

        return self._start("broadcast", fp, body, timeout)

    def allreduce(self, buf: Any, *, op: Any = ReduceOp.SUM, timeout: float | None = None,
                  algorithm: str | None = None) -> asyncio.Future[Any]:
        """Reduce ``buf`` across ranks, in place on every rank. Algorithms: ``ring``
        (bandwidth), ``recursive_doubling`` (latency), ``halving_doubling``; default by size."""
        arr = as_array(buf, "buf", writable=True)
        rop, ufunc = reduction(op, arr)
        n = self.world_size
        alg = choose("allreduce", algorithm, arr.nbytes, n)
        fp = fingerprint(Collective.ALLREDUCE, arr, op=rop, alg=alg)
        if alg == 1 and n > 1 and not n & (n - 1) and 0 < arr.nbytes <= self.chunk_bytes:
            return self._schedule(
                "allreduce", fp, lambda o: doubling.small_steps(o, _flat(arr), ufunc,
                                                                rop is ReduceOp.AVG),
                buf, timeout)

        async def body(o: Op) -> Any:
            flat = _flat(arr)
            if alg == 0:
                blocks = flat_blocks(flat, n)
                gathered = ring.post_allgather(o, blocks)
                nxt = (o.rank + 1) % n

                async def forward(c: int, chunk: Array) -> None:
                    if rop is ReduceOp.AVG:
                        chunk /= n
                    await o.send(nxt, ring.AG_SLOT, c, chunk)

                await ring.reduce_scatter(o, blocks, ufunc, finished=forward)
                await ring.allgather(o, blocks, posted=gathered, first_sent=True)
                return buf
            await (doubling.recursive_doubling, doubling.halving_doubling)[alg - 1](
                o, flat, ufunc)
            if rop is ReduceOp.AVG:
                flat /= n
            return buf

        return self._start("allreduce", fp, body, timeout)

    def reduce(self, buf: Any, *, root: int = 0, op: Any = ReduceOp.SUM,
               timeout: float | None = None,
               algorithm: str | None = None) -> asyncio.Task[Any]:
        """Reduce ``buf`` across ranks into ``root``'s ``buf``; others' stay unchanged."""
        arr = as_array(buf, "buf", writable=True)
        root = check_rank(root, self.world_size, "root")
        rop, ufunc = reduction(op, arr)
        choose("reduce", algorithm, 0, self.world_size)
        fp = fingerprint(Collective.REDUCE, arr, op=rop, root=root)

        async def body(o: Op) -> Any:
            work = _flat(arr) if o.rank == root else _flat(arr).copy()
            await tree.reduce(o, work, root, ufunc)
            await o.finish()
            if o.rank == root and rop is ReduceOp.AVG:
                work /= self.world_size
            return buf

        return self._start("reduce", fp, body, timeout)

    def allgather(self, send: Any, out: Any = None, *, timeout: float | None = None,
                  algorithm: str | None = None) -> asyncio.Task[Any]:
        """Gather every rank's ``send`` into ``out`` of shape ``(world_size, *send.shape)``
        (``ring`` or ``direct``)."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        res = output(out, (n, *arr.shape), arr.dtype)
        alg = choose("allgather", algorithm, arr.nbytes * n, n)
        fp = fingerprint(Collective.ALLGATHER, arr, alg=alg)

        async def body(o: Op) -> Any:
            blocks = list(split_even(_flat(res), n))
            if alg == 0 and n > 1 and _pulled(o, (o.rank + 1) % n, arr.nbytes):
                # the successor pulls straight from ``send``: copy it into place meanwhile
                await ring.allgather(o, blocks, own=_flat(arr))
            else:
                await copy_into(blocks[o.rank], _flat(arr))
                await (ring.allgather, direct.allgather)[alg](o, blocks)
            return res if out is None else out

        return self._start("allgather", fp, body, timeout)

    def gather(self, send: Any, out: Any = None, *, root: int = 0,
               timeout: float | None = None,
               algorithm: str | None = None) -> asyncio.Task[Any]:
        """Like allgather, but only ``root`` gets the result (None elsewhere)."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        root = check_rank(root, n, "root")
        res = output(out, (n, *arr.shape), arr.dtype) if self.rank == root else None
        choose("gather", algorithm, 0, self.world_size)
        fp = fingerprint(Collective.GATHER, arr, root=root)

        async def body(o: Op) -> Any:
            blocks = None if res is None else split_even(_flat(res), n)
            await direct.gather(o, _flat(arr), blocks, root)
            if res is None:
                return None
            return res if out is None else out

        return self._start("gather", fp, body, timeout)

    def scatter(self, send: Any, out: Any, *, root: int = 0,
                timeout: float | None = None,
                algorithm: str | None = None) -> asyncio.Task[Any]:
        """Rank i receives block i of ``root``'s ``send`` (shape ``(world_size, *out.shape)``)."""
        n = self.world_size
        root = check_rank(root, n, "root")
        res = as_array(out, "out", writable=True)
        src: Array | None = None
        if self.rank == root:
            if send is None:
                raise UsageError("scatter: the root must pass send")
            src = as_array(send, "send", writable=False)
            if src.dtype != res.dtype or src.size != n * res.size:
                raise UsageError(
                    f"scatter: send has shape {src.shape} and dtype {src.dtype}; expected "
                    f"{(n, *res.shape)} of {res.dtype}")
        choose("scatter", algorithm, 0, self.world_size)
        fp = fingerprint(Collective.SCATTER, res, root=root)

        async def body(o: Op) -> Any:
            blocks = None if src is None else split_even(_flat(src), n)
            await direct.scatter(o, blocks, _flat(res), root)
            return out

        return self._start("scatter", fp, body, timeout)

    def reduce_scatter(self, send: Any, out: Any = None, *, op: Any = ReduceOp.SUM,
                       timeout: float | None = None,
                       algorithm: str | None = None) -> asyncio.Task[Any]:
        """Reduce ``send`` across ranks; rank r gets the r-th of ``world_size`` blocks
        (``ring`` or ``direct``)."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        divisible(arr, n, "send")
        rop, ufunc = reduction(op, arr)
        res = output(out, (arr.shape[0] // n, *arr.shape[1:]), arr.dtype)
        alg = choose("reduce_scatter", algorithm, arr.nbytes, n)
        fp = fingerprint(Collective.REDUCE_SCATTER, arr, op=rop, alg=alg)

        async def body(o: Op) -> Any:
            r, dest = o.rank, _flat(res)
            blocks = list(split_even(_flat(arr), n))
            if alg == 1:
                blocks[r] = blocks[r].copy()
                await direct.reduce_scatter(o, blocks, ufunc)
            else:
                # The ring reduces every block but the one it sends first, (r-1), exactly
                # once; that one stays a view of the input, this rank's own block goes
                # straight into the output. Over links that pull, the reductions run out of
                # place from the input (``sources``) into fresh arrays, so nothing is copied
                # before the first pull; over TCP the input is copied first and reduced in
                # place, which measured faster there (8-9 against 12-14 ms at 16 MiB).
                pulled = n > 1 and _pulled(o, (r - 1) % n, blocks[0].nbytes)
                sources = list(blocks) if pulled else None
                for b in range(n):
                    if b == r:
                        if not pulled:
                            dest[...] = blocks[b]
                        blocks[b] = dest
                    elif b != (r - 1) % n:
                        blocks[b] = np.empty_like(blocks[b]) if pulled else blocks[b].copy()
                await ring.reduce_scatter(o, blocks, ufunc, sources=sources)
            mine = blocks[r]
            if rop is ReduceOp.AVG:
                mine /= n
            if mine is not dest:
                dest[...] = mine
            return res if out is None else out

        return self._start("reduce_scatter", fp, body, timeout)

    def alltoall(self, send: Any, out: Any = None, *,
                 timeout: float | None = None,
                 algorithm: str | None = None) -> asyncio.Task[Any]:
        """Block i of ``send`` (split along axis 0) goes to rank i; ``out`` gets block j from
        rank j."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        divisible(arr, n, "send")
        res = output(out, arr.shape, arr.dtype)
        choose("alltoall", algorithm, 0, self.world_size)
        fp = fingerprint(Collective.ALLTOALL, arr)

        async def body(o: Op) -> Any:
            await direct.alltoall(o, split_even(_flat(arr), n), split_even(_flat(res), n))
            return res if out is None else out

        return self._start("alltoall", fp, body, timeout)

    def allgatherv(self, send: Any, *, timeout: float | None = None,
                   algorithm: str | None = None) -> asyncio.Task[list[Any]]:
        """Gather arrays whose first axis may differ per rank; returns them in rank order."""
        arr = as_array(send, "send", writable=False)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        choose("allgatherv", algorithm, 0, self.world_size)
        fp = fingerprint(Collective.ALLGATHERV, arr, count=0)

        async def body(o: Op) -> list[Any]:
            blocks = await _gather_v(o, arr, "allgatherv")
            return [b.reshape(rows, *arr.shape[1:]) for rows, b in blocks]

        return self._start("allgatherv", fp, body, timeout)

    # -- objects ---------------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None, *, root: int = 0, allow_pickle: bool = False,
                         timeout: float | None = None) -> asyncio.Task[Any]:
        """Send ``root``'s value to every rank; every rank gets an equal value of the same
        types (see :mod:`aiocollect.objects` for what travels without pickle).

        Raises:
            UsageError: on the root, from the call, before anything is sent: the value
                cannot travel exactly without pickle (and ``allow_pickle`` is False), or it
                is larger than ``objects.MAX_OBJECT_BYTES`` serialised.
            ProtocolError: (the handle, on a receiving rank) the bytes that arrived are not
                a value a real rank could have sent; the group is then broken everywhere.
        """
        root = check_rank(root, self.world_size, "root")
        payload = objects.dumps(obj, allow_pickle) if self.rank == root else b""
        fp = fingerprint(Collective.OBJECT, None, count=0, root=root)

        async def body(o: Op) -> Any:
            size = np.array([len(payload)], dtype=_I64)
            await tree.broadcast(o, size, root, slot=0)
            await o.finish()
            if o.rank == root:
                data = np.frombuffer(bytearray(payload), np.uint8)
            else:
                parent = ((tree.tree_links((o.rank - root) % o.size, o.size)[0] or 0)
                          + root) % o.size
                source = f"rank {root}" + ("" if parent == root else f" (through rank {parent})")
                declared = int(size[0])
                if not 0 <= declared <= objects.MAX_OBJECT_BYTES:
                    raise ProtocolError(
                        f"broadcast_object (op #{o.seq}): {source} declared a value of "
                        f"{declared} bytes (at most {objects.MAX_OBJECT_BYTES})")
                data = np.empty(declared, np.uint8)
            await tree.broadcast(o, data, root, slot=1)
            await o.finish()
            if o.rank == root:
                return obj
            return objects.loads(data.tobytes(), allow_pickle,
                                 f"broadcast_object (op #{o.seq}): {source}")

        return self._start("broadcast_object", fp, body, timeout)

    def allgather_object(self, obj: Any, *, allow_pickle: bool = False,
                         timeout: float | None = None) -> asyncio.Task[list[Any]]:
        """Every rank's value, in rank order, on every rank (each an equal value of the
        same types as the one sent).

        Raises:
            UsageError: from the call, before anything is sent (see broadcast_object).
            ProtocolError: (the handle) a rank's bytes are not a value a real rank could
                have sent; the group is then broken everywhere.
        """
        return self._objects("allgather_object", obj, None, allow_pickle, timeout)

    def gather_object(self, obj: Any, *, root: int = 0, allow_pickle: bool = False,
                      timeout: float | None = None) -> asyncio.Task[list[Any] | None]:
        """Every rank's value, in rank order, on ``root`` (None elsewhere). Raises as
        allgather_object (the root decodes, so a malformed value fails there)."""
        root = check_rank(root, self.world_size, "root")
        return self._objects("gather_object", obj, root, allow_pickle, timeout)

    def _objects(self, kind: str, obj: Any, root: int | None, allow_pickle: bool,
                 timeout: float | None) -> asyncio.Task[Any]:
        """allgatherv of the serialised values (sizes checked against MAX_OBJECT_BYTES),
        decoded on every rank (``root`` None) or on ``root`` only."""
        payload = np.frombuffer(objects.dumps(obj, allow_pickle), np.uint8)
        fp = fingerprint(Collective.OBJECT, payload, count=0, root=-1 if root is None else root)

        async def body(o: Op) -> list[Any] | None:
            blocks = await _gather_v(o, payload, kind, objects.MAX_OBJECT_BYTES)
            if root is not None and o.rank != root:
                return None
            return [objects.loads(b.tobytes(), allow_pickle, f"{kind} (op #{o.seq}): rank {r}")
                    for r, (_, b) in enumerate(blocks)]

        return self._start(kind, fp, body, timeout)

    # -- variable-size exchange and sub-groups ---------------------------------------------

    def alltoallv(self, send: Any, send_counts: Any, *, out: Any = None,
                  timeout: float | None = None,
                  algorithm: str | None = None) -> asyncio.Task[Any]:
        """Rows ``[sum(send_counts[:i]), sum(send_counts[:i+1]))`` of ``send`` go to rank i.

        Returns the blocks received from each rank as a list in rank order, or, when ``out``
        is given, ``out`` filled with them concatenated along axis 0 (its row count must
        equal the total received).
        """
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        counts = [int(c) for c in np.asarray(send_counts).reshape(-1)]
        if len(counts) != n or min(counts, default=0) < 0:
            raise UsageError(f"send_counts must hold {n} non-negative counts, got {counts}")
        if arr.ndim == 0 or sum(counts) != arr.shape[0]:
            raise UsageError(f"send_counts sum to {sum(counts)} but send has shape {arr.shape}")
        res = None if out is None else as_array(out, "out", writable=True)
        if res is not None and (res.dtype != arr.dtype or res.shape[1:] != arr.shape[1:]):
            raise UsageError(f"out must have dtype {arr.dtype} and rows of shape "
                             f"{arr.shape[1:]}, got {res.dtype} {res.shape}")
        choose("alltoallv", algorithm, 0, n)
        fp = fingerprint(Collective.ALLTOALLV, arr, count=0)
        row = int(np.prod(arr.shape[1:]))

        async def body(o: Op) -> Any:
            mine = np.array([[c, row] for c in counts], dtype=_I64)
            theirs = np.empty_like(mine)
            await direct.alltoall(o, list(mine), list(theirs), slot=0)
            await o.finish()
            if (theirs[:, 1] != row).any():
                raise MismatchError(f"alltoallv: ranks sent rows of {theirs[:, 1].tolist()} "
                                    f"elements, rank {o.rank} rows of {row}")
            rows = theirs[:, 0]
            total = int(rows.sum())
            if res is not None and res.shape[0] != total:
                raise UsageError(f"alltoallv: out has {res.shape[0]} rows, {total} arrive")
            dest = _flat(res) if res is not None else np.empty(total * row, arr.dtype)
            rb = np.concatenate([[0], np.cumsum(rows * row)])
            sb = np.concatenate([[0], np.cumsum(np.array(counts, dtype=_I64) * row)])
            flat = _flat(arr)
            await direct.alltoall(o, [flat[sb[i]:sb[i + 1]] for i in range(n)],
                                  [dest[rb[i]:rb[i + 1]] for i in range(n)], slot=1)
            if res is not None:
                return out
            return [dest[rb[i]:rb[i + 1]].reshape(int(rows[i]), *arr.shape[1:])
                    for i in range(n)]

        return self._start("alltoallv", fp, body, timeout)

    def split(self, color: int | None, *, key: int = 0,
              timeout: float | None = None) -> asyncio.Task[Group | None]:
        """Collective: ranks passing the same ``color`` form a new Group, ordered by
        ``key`` then rank; ``color=None`` opts out (the handle gives None). Sub-groups share
        this group's links, have their own sequence numbers, run concurrently with it and
        close with it."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                                  or color < 0):
            raise UsageError(f"color must be a non-negative int or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise UsageError(f"key must be an int, got {key!r}")
        split_seq = self._seq
        task = self.allgather_object([color, key], timeout=timeout)
        root: GroupCore = self
        while root._parent is not None:
            root = root._parent

        async def make() -> Group | None:
            entries = await task
            for r, entry in enumerate(entries):
                if not (type(entry) is list and len(entry) == 2 and type(entry[1]) is int
                        and (entry[0] is None or type(entry[0]) is int)):
                    # a malformed (color, key) from a peer: break the group like in an op
                    raise self._fabric.cause(ProtocolError(
                        f"split (op #{split_seq}): rank {r} sent a malformed color and key"))
            if color is None:
                return None
            members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
            ranks = [self._ranks[r] for _, r in members]
            gid = zlib.crc32(f"{self._gid}/{split_seq}/{color}".encode()) or 1
            child = Group(self._fabric, gid, ranks, timeout=self.timeout,
                          chunk_bytes=self.chunk_bytes, name=f"{self.name}.{color}",
                          parent=root)
            root._children.append(child)
            return child

        return asyncio.get_running_loop().create_task(make())
