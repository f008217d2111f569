"""Group: the public collective methods.

Each method validates its arguments (UsageError, before anything is sent), takes the next
sequence number at call time and returns an ``asyncio.Future`` (the awaitable handle): a
Task running the algorithm, or for one-frame allreduces and broadcasts a plain Future
driven by a callback schedule (engine/small.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import zlib
from collections.abc import Sequence
from typing import Any, overload

import numpy as np

from aiocollect import objects
from aiocollect._buffers import Array, B, Buffer, as_array
from aiocollect.collectives import objects as object_collectives
from aiocollect.collectives import registry
from aiocollect.collectives.checks import check_rank, check_tag, divisible, output, reduction
from aiocollect.engine.op import Op, split_even
from aiocollect.engine.small import Small, one_way
from aiocollect.errors import ProtocolError, UsageError
from aiocollect.fingerprint import Fingerprint, pack
from aiocollect.group_core import GroupCore
from aiocollect.transport.wire import P2P, Key
from aiocollect.types import Collective, OpLike, ReduceOp, dtype_code

#: Plans (argument checks' conclusions) a group keeps, see ``Group._remember``.
PLANS = 256
#: The buffer of a one-frame barrier (its frames are empty).
_EMPTY = np.empty(0, dtype=np.uint8)

#: alltoallv's send_counts: one non-negative count per rank.
Counts = Sequence[int] | Array


def _flat(arr: Array) -> Array:
    return arr.reshape(-1)


class Group(GroupCore):
    """A set of ranks that run collectives together. Obtain one with ``open_group``."""

    #: The elastic settings (``aiocollect.elastic.ElasticState``) of an elastic group.
    _elastic: Any = None

    # -- elastic groups (aiocollect.elastic) -----------------------------------------------

    def attach_elastic(self, state: Any) -> None:
        """Make this world group a generation of an elastic job: ``state`` is its
        ``aiocollect.elastic.ElasticState``, which ``regroup`` and ``joiners`` delegate to
        (called by ``aiocollect.elastic``, never by users)."""
        self._elastic = state

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
            raise UsageError("regroup() needs the world group of open_group(..., elastic=True)")
        result: Group = await self._elastic.regroup(self, min_size=min_size, timeout=timeout)
        return result

    async def joiners(self) -> int:
        """How many processes wait in ``join_group`` for this elastic group (not a
        collective: reads the store). Raises UsageError on a non-elastic group."""
        if self._elastic is None:
            raise UsageError("joiners() needs a group of open_group(..., elastic=True)")
        return int(await self._elastic.joiners(self))

    # -- point to point --------------------------------------------------------------------

    def send(
        self, buf: Buffer, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> asyncio.Future[None]:
        """Send ``buf`` to rank ``dst``; messages are matched by (source, tag) in order."""
        arr = as_array(buf, "buf", writable=False)
        dst = check_rank(dst, self.world_size, "dst")
        if dst == self.rank:
            raise UsageError("send to self: dst must differ from this rank")
        tag = check_tag(tag)
        fp, small = self._p2p_plan("send", arr, dst, -1, tag)
        counter = self._next_send(dst, tag)
        if small is not None:
            return self._quick(small, _flat(arr), None, None, timeout, counter)

        async def body(op: Op) -> None:
            for c, part in enumerate(op.chunks(_flat(arr)) or [_flat(arr)]):
                await op.send(dst, tag, c, part)

        return self._start("send", fp, body, timeout, p2p=(counter, tag))

    def recv(
        self, buf: Buffer, src: int | None = None, *, tag: int = 0, timeout: float | None = None
    ) -> asyncio.Future[int]:
        """Receive into ``buf`` from ``src`` (None: any rank); the handle gives the source."""
        arr = as_array(buf, "buf", writable=True)
        if src is not None:
            src = check_rank(src, self.world_size, "src")
            if src == self.rank:
                raise UsageError("recv from self: src must differ from this rank")
        if self.world_size == 1:
            raise UsageError("recv in a group of one rank can never complete")
        tag = check_tag(tag)
        if src is not None:
            fp, small = self._p2p_plan("recv", arr, -1, src, tag)
            counter = self._next_recv(src, tag)
            if small is not None:
                return self._quick(small, _flat(arr), None, src, timeout, counter)
        else:
            fp, counter = self._p2p_fingerprint(arr), -1

        async def body(op: Op) -> int:
            source, seq = (src, counter) if src is not None else await self._match_any(tag)
            for c, part in enumerate(op.chunks(_flat(arr)) or [_flat(arr)]):
                op.recv(source, tag, c, part, expect=fp, seq=seq)
            return source

        return self._start("recv", fp, body, timeout, p2p=(max(counter, 0), tag))

    def _p2p_plan(
        self, kind: str, arr: Array, dst: int, src: int, tag: int
    ) -> tuple[Fingerprint, Small | None]:
        """send's or recv's fingerprint of ``arr`` and, for a message of one frame, its
        one-frame program to ``dst`` or from ``src``, remembered per (dtype, size, peer,
        tag)."""
        key = (kind, arr.dtype, arr.size, dst, src, tag)
        plan = self._plan(key)
        if plan is None:
            fp = self._p2p_fingerprint(arr)
            small = None
            if arr.nbytes <= self.chunk_bytes:
                small = self._small(kind, one_way(dst, src, tag), fp, arr.nbytes, arr.dtype, P2P)
            plan = self._remember(key, (fp, small))
        return plan[0], plan[1]

    def _p2p_fingerprint(self, arr: Array) -> Fingerprint:
        """send's and recv's fingerprint of ``arr``, remembered per (dtype, size)."""
        key = ("p2p", arr.dtype, arr.size)
        plan = self._plan(key)
        if plan is None:
            plan = self._remember(key, (pack(Collective.SEND, arr),))
        fp: Fingerprint = plan[0]
        return fp

    async def _match_any(self, tag: int) -> tuple[int, int]:
        """Claim the first pending message with ``tag`` from any rank."""
        fabric = self._fabric
        while True:
            for peer in range(self.world_size):
                if peer == self.rank:
                    continue
                seq = self._recv_counters[(peer, tag)]
                link = fabric.links[self._ranks[peer]]
                if link.has_frame(Key(P2P, self._gid, seq, tag, 0)):
                    return peer, self._next_recv(peer, tag)
            await fabric.p2p_arrival()

    # -- synchronisation and data movement -------------------------------------------------

    def barrier(
        self, *, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Future[None]:
        """Complete once every rank has entered the barrier (``dissemination``, or at three
        and four ranks by default ``star``: through rank 0)."""
        key = ("barrier", algorithm)
        plan = self._plan(key)
        if plan is None:
            n = self.world_size
            alg = self._choose(registry.BARRIER, algorithm, 0)
            fp = pack(Collective.BARRIER, None, algorithm=alg.name)
            small = (
                self._small("barrier", alg.program(n, self.rank), fp, 0)
                if alg.program is not None and alg.empty_frames(n)
                else None
            )
            plan = self._remember(key, (fp, alg.run, small))
        fp, run, small = plan
        if small is not None:
            return self._quick(small, _EMPTY, None, None, timeout)
        return self._start("barrier", fp, run, timeout)

    def broadcast(
        self, buf: B, *, root: int = 0, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Future[B]:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (binomial tree or pipeline)."""
        arr = as_array(buf, "buf", writable=True, dtype=False)  # (the plan checks it)
        key = ("broadcast", arr.dtype, arr.size, type(root), root, algorithm)
        try:
            plan = self._plans.get(key)
        except TypeError:  # not hashable: not valid arguments, the checks say why
            plan = None
        fp, small, run, root = plan or self._broadcast_plan(key, arr, root, algorithm)
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        if small is not None:
            return self._quick(small, flat, None, buf, timeout)

        async def body(o: Op) -> B:
            await run(o, flat, root)
            return buf

        return self._start("broadcast", fp, body, timeout)

    def _broadcast_plan(
        self, key: tuple[Any, ...], arr: Array, root: Any, algorithm: Any
    ) -> tuple[Any, ...]:
        """broadcast's checks and choices (fingerprint, one-frame program or None, run,
        root), remembered under ``key`` (dtype, size, root and algorithm)."""
        dtype_code(arr.dtype)
        n = self.world_size
        root = check_rank(root, n, "root")
        alg = self._choose(registry.BROADCAST, algorithm, arr.nbytes)
        fp = pack(Collective.BROADCAST, arr, root=root, algorithm=alg.name)
        small, prog = None, alg.program
        if prog is not None and alg.one_frame(arr.nbytes, n, self.chunk_bytes):
            small = self._small("broadcast", prog(n, self.rank, root), fp, arr.nbytes, arr.dtype)
        return self._remember(key, (fp, small, alg.run, root))

    def chosen_algorithm(self, collective: str, nbytes: int) -> str:
        """The algorithm that ``algorithm=None`` runs for ``collective`` (``"allreduce"``,
        ``"barrier"``, ...) on a message of ``nbytes`` in this group (allgather: the
        gathered total), by size, world size and the group's links (docs/algorithms.md).
        The same on every rank.

        Raises:
            UsageError: no collective of that name takes ``algorithm=``.
        """
        reg = registry.REGISTRIES.get(collective) if isinstance(collective, str) else None
        if reg is None:
            raise UsageError(
                f"no collective {collective!r}; one of {', '.join(registry.REGISTRIES)}"
            )
        return self._choose(reg, None, nbytes).name

    def _choose(
        self, reg: registry.Registry[Any, Any], algorithm: str | None, nbytes: int
    ) -> registry.Algorithm[Any, Any]:
        """``reg.choose`` with what this group's links are (the same on every rank)."""
        return reg.choose(algorithm, nbytes, self.world_size, self._one_thread, self._fabric.pulls)

    @functools.cached_property
    def _one_thread(self) -> bool:
        """Whether every peer of this group runs on this thread (in-process memory links:
        the same answer on every rank), for the automatic algorithm choice. A group's
        links are fixed when it forms, so this is asked once, not per call."""
        links, me = self._fabric.links, self._fabric.rank
        peers = [links.get(r) for r in self._ranks if r != me]
        return bool(peers) and all(link is not None and link.caps.same_thread for link in peers)

    def _plan(self, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The plan remembered for ``key``, or None (also for an unhashable key: not valid
        arguments, whose checks then say why)."""
        try:
            return self._plans.get(key)
        except TypeError:
            return None

    def _remember(self, key: tuple[Any, ...], plan: tuple[Any, ...]) -> tuple[Any, ...]:
        """Keep ``plan`` for ``key`` (unhashable keys are not kept; at most ``PLANS``: a
        program calling with ever new sizes starts over rather than grow)."""
        plans = self._plans
        if len(plans) >= PLANS:
            plans.clear()
        with contextlib.suppress(TypeError):
            plans[key] = plan
        return plan

    def allreduce(
        self,
        buf: B,
        *,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Future[B]:
        """Reduce ``buf`` across ranks, in place on every rank. Algorithms: ``ring``
        (bandwidth), ``recursive_doubling`` (latency), ``halving_doubling``, ``star``
        (through rank 0: few messages, few ranks), ``pull`` (reads the peers' buffers
        where every rank can: shared memory); default by size, world size and links."""
        arr = as_array(buf, "buf", writable=True, dtype=False)  # (the plan checks it)
        key = ("allreduce", arr.dtype, arr.size, type(op), op, algorithm)
        try:
            plan = self._plans.get(key)
        except TypeError:  # not hashable: not valid arguments, the checks say why
            plan = None
        fp, small, run, ufunc, average = plan or self._allreduce_plan(key, arr, op, algorithm)
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        if small is not None:
            return self._quick(small, flat, ufunc, buf, timeout)

        async def body(o: Op) -> B:
            await run(o, flat, ufunc, average)
            return buf

        return self._start("allreduce", fp, body, timeout)

    def _allreduce_plan(
        self, key: tuple[Any, ...], arr: Array, op: Any, algorithm: Any
    ) -> tuple[Any, ...]:
        """allreduce's checks and choices (fingerprint, one-frame program or None, run,
        ufunc, average), remembered under ``key`` (dtype, size, op and algorithm)."""
        dtype_code(arr.dtype)
        rop, ufunc = reduction(op, arr)
        n = self.world_size
        alg = self._choose(registry.ALLREDUCE, algorithm, arr.nbytes)
        fp = pack(Collective.ALLREDUCE, arr, op=rop, algorithm=alg.name)
        average = rop is ReduceOp.AVG
        small, prog = None, alg.program
        if prog is not None and alg.one_frame(arr.nbytes, n, self.chunk_bytes):
            small = self._small("allreduce", prog(n, self.rank, average), fp, arr.nbytes, arr.dtype)
        return self._remember(key, (fp, small, alg.run, ufunc, average))

    def reduce(
        self,
        buf: B,
        *,
        root: int = 0,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[B]:
        """Reduce ``buf`` across ranks into ``root``'s ``buf``; others' stay unchanged."""
        arr = as_array(buf, "buf", writable=True)
        root = check_rank(root, self.world_size, "root")
        rop, ufunc = reduction(op, arr)
        alg = registry.REDUCE.choose(algorithm, 0, self.world_size)
        fp = pack(Collective.REDUCE, arr, op=rop, root=root, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> B:
            await run(o, _flat(arr), root, ufunc, rop is ReduceOp.AVG)
            return buf

        return self._start("reduce", fp, body, timeout)

    @overload
    def allgather(
        self,
        send: Buffer,
        out: None = None,
        *,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Array]: ...
    @overload
    def allgather(
        self, send: Buffer, out: B, *, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Task[B]: ...

    def allgather(
        self,
        send: Buffer,
        out: Buffer | None = None,
        *,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Any]:
        """Gather every rank's ``send`` into ``out`` of shape ``(world_size, *send.shape)``
        (``ring``, ``direct``, or ``pull`` where every rank reads the others' memory)."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        res = output(out, (n, *arr.shape), arr.dtype)
        alg = self._choose(registry.ALLGATHER, algorithm, arr.nbytes * n)
        fp = pack(Collective.ALLGATHER, arr, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> Buffer:
            await run(o, _flat(arr), split_even(_flat(res), n))
            return res if out is None else out

        return self._start("allgather", fp, body, timeout)

    @overload
    def gather(
        self,
        send: Buffer,
        out: None = None,
        *,
        root: int = 0,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Array | None]: ...
    @overload
    def gather(
        self,
        send: Buffer,
        out: B,
        *,
        root: int = 0,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[B | None]: ...

    def gather(
        self,
        send: Buffer,
        out: Buffer | None = None,
        *,
        root: int = 0,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Any]:
        """Like allgather, but only ``root`` gets the result (None elsewhere)."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        root = check_rank(root, n, "root")
        res = output(out, (n, *arr.shape), arr.dtype) if self.rank == root else None
        alg = registry.GATHER.choose(algorithm, 0, n)
        fp = pack(Collective.GATHER, arr, root=root, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> Buffer | None:
            blocks = None if res is None else split_even(_flat(res), n)
            await run(o, _flat(arr), blocks, root)
            if res is None:
                return None
            return res if out is None else out

        return self._start("gather", fp, body, timeout)

    def scatter(
        self,
        send: Buffer | None,
        out: B,
        *,
        root: int = 0,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[B]:
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
                    f"{(n, *res.shape)} of {res.dtype}"
                )
        alg = registry.SCATTER.choose(algorithm, 0, n)
        fp = pack(Collective.SCATTER, res, root=root, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> B:
            blocks = None if src is None else split_even(_flat(src), n)
            await run(o, blocks, _flat(res), root)
            return out

        return self._start("scatter", fp, body, timeout)

    @overload
    def reduce_scatter(
        self,
        send: Buffer,
        out: None = None,
        *,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Array]: ...
    @overload
    def reduce_scatter(
        self,
        send: Buffer,
        out: B,
        *,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[B]: ...

    def reduce_scatter(
        self,
        send: Buffer,
        out: Buffer | None = None,
        *,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Any]:
        """Reduce ``send`` across ranks; rank r gets the r-th of ``world_size`` blocks
        (``ring``, ``direct``, or ``pull`` where every rank reads the others' memory)."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        divisible(arr, n, "send")
        rop, ufunc = reduction(op, arr)
        res = output(out, (arr.shape[0] // n, *arr.shape[1:]), arr.dtype)
        alg = self._choose(registry.REDUCE_SCATTER, algorithm, arr.nbytes)
        fp = pack(Collective.REDUCE_SCATTER, arr, op=rop, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> Buffer:
            await run(o, _flat(arr), _flat(res), ufunc, rop is ReduceOp.AVG)
            return res if out is None else out

        return self._start("reduce_scatter", fp, body, timeout)

    @overload
    def alltoall(
        self,
        send: Buffer,
        out: None = None,
        *,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Array]: ...
    @overload
    def alltoall(
        self, send: Buffer, out: B, *, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Task[B]: ...

    def alltoall(
        self,
        send: Buffer,
        out: Buffer | None = None,
        *,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Any]:
        """Block i of ``send`` (split along axis 0) goes to rank i; ``out`` gets block j from
        rank j."""
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        divisible(arr, n, "send")
        res = output(out, arr.shape, arr.dtype)
        alg = registry.ALLTOALL.choose(algorithm, 0, n)
        fp = pack(Collective.ALLTOALL, arr, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> Buffer:
            await run(o, split_even(_flat(arr), n), split_even(_flat(res), n))
            return res if out is None else out

        return self._start("alltoall", fp, body, timeout)

    # -- variable-size exchange ------------------------------------------------------------

    def allgatherv(
        self, send: Buffer, *, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Task[list[Array]]:
        """Gather arrays whose first axis may differ per rank; returns them in rank order."""
        arr = as_array(send, "send", writable=False)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        alg = registry.ALLGATHERV.choose(algorithm, 0, self.world_size)
        fp = pack(Collective.ALLGATHERV, arr, count=0, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> list[Array]:
            return await run(o, arr)

        return self._start("allgatherv", fp, body, timeout)

    @overload
    def alltoallv(
        self,
        send: Buffer,
        send_counts: Counts,
        *,
        out: None = None,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[list[Array]]: ...
    @overload
    def alltoallv(
        self,
        send: Buffer,
        send_counts: Counts,
        *,
        out: B,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[B]: ...

    def alltoallv(
        self,
        send: Buffer,
        send_counts: Counts,
        *,
        out: Buffer | None = None,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[Any]:
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
            raise UsageError(
                f"out must have dtype {arr.dtype} and rows of shape "
                f"{arr.shape[1:]}, got {res.dtype} {res.shape}"
            )
        alg = registry.ALLTOALLV.choose(algorithm, 0, n)
        fp = pack(Collective.ALLTOALLV, arr, count=0, algorithm=alg.name)
        run = alg.run

        async def body(o: Op) -> list[Array] | Buffer:
            blocks = await run(o, arr, counts, res)
            return blocks if out is None else out

        return self._start("alltoallv", fp, body, timeout)

    # -- objects ---------------------------------------------------------------------------

    def broadcast_object(
        self,
        obj: Any = None,
        *,
        root: int = 0,
        allow_pickle: bool = False,
        timeout: float | None = None,
    ) -> asyncio.Task[Any]:
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
        fp = pack(Collective.OBJECT, None, count=0, root=root)

        async def body(o: Op) -> Any:
            return await object_collectives.broadcast(o, obj, payload, root, allow_pickle)

        return self._start("broadcast_object", fp, body, timeout)

    def allgather_object(
        self, obj: Any, *, allow_pickle: bool = False, timeout: float | None = None
    ) -> asyncio.Task[list[Any]]:
        """Every rank's value, in rank order, on every rank (each an equal value of the
        same types as the one sent).

        Raises:
            UsageError: from the call, before anything is sent (see broadcast_object).
            ProtocolError: (the handle) a rank's bytes are not a value a real rank could
                have sent; the group is then broken everywhere.
        """
        return self._objects("allgather_object", obj, None, allow_pickle, timeout)

    def gather_object(
        self, obj: Any, *, root: int = 0, allow_pickle: bool = False, timeout: float | None = None
    ) -> asyncio.Task[list[Any] | None]:
        """Every rank's value, in rank order, on ``root`` (None elsewhere). Raises as
        allgather_object (the root decodes, so a malformed value fails there)."""
        root = check_rank(root, self.world_size, "root")
        return self._objects("gather_object", obj, root, allow_pickle, timeout)

    def _objects(
        self, kind: str, obj: Any, root: int | None, allow_pickle: bool, timeout: float | None
    ) -> asyncio.Task[Any]:
        """Serialise ``obj`` and start the gather of every rank's value, decoded on every
        rank (``root`` None) or on ``root`` only."""
        payload = np.frombuffer(objects.dumps(obj, allow_pickle), np.uint8)
        fp = pack(Collective.OBJECT, payload, count=0, root=-1 if root is None else root)

        async def body(o: Op) -> list[Any] | None:
            return await object_collectives.gather(o, payload, kind, root, allow_pickle)

        return self._start(kind, fp, body, timeout)

    # -- sub-groups ------------------------------------------------------------------------

    def split(
        self, color: int | None, *, key: int = 0, timeout: float | None = None
    ) -> asyncio.Task[Group | None]:
        """Collective: ranks passing the same ``color`` form a new Group, ordered by
        ``key`` then rank; ``color=None`` opts out (the handle gives None). Sub-groups share
        this group's links, have their own sequence numbers, run concurrently with it and
        close with it."""
        if color is not None and (
            isinstance(color, bool) or not isinstance(color, int) or color < 0
        ):
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
                if not (
                    type(entry) is list
                    and len(entry) == 2
                    and type(entry[1]) is int
                    and (entry[0] is None or type(entry[0]) is int)
                ):
                    # a malformed (color, key) from a peer: break the group like in an op
                    raise self._fabric.cause(
                        ProtocolError(
                            f"split (op #{split_seq}): rank {r} sent a malformed color and key"
                        )
                    )
            if color is None:
                return None
            members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
            ranks = [self._ranks[r] for _, r in members]
            gid = zlib.crc32(f"{self._gid}/{split_seq}/{color}".encode()) or 1
            child = Group(
                self._fabric,
                gid,
                ranks,
                timeout=self.timeout,
                chunk_bytes=self.chunk_bytes,
                name=f"{self.name}.{color}",
                parent=root,
            )
            root._children.append(child)
            return child

        return asyncio.get_running_loop().create_task(make())
