"""The collectives over blocks of a group: ``allgather``, ``gather``, ``scatter``,
``reduce_scatter``, ``alltoall`` and the variable-size ``allgatherv`` and ``alltoallv``.

Each checks its arguments (UsageError before anything is sent), allocates or checks the
output, chooses the algorithm from the collective's registry and starts a Task running it
over the flat arrays, split into one block per rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, overload

import numpy as np

from aiocollect._buffers import Array, B, Buffer, as_array
from aiocollect.collectives import registry
from aiocollect.collectives.checks import check_rank, divisible, output, reduction
from aiocollect.engine.op import Op, split_even
from aiocollect.errors import UsageError
from aiocollect.fingerprint import pack
from aiocollect.group.core import GroupCore
from aiocollect.types import Collective, OpLike, ReduceOp

#: alltoallv's send_counts: one non-negative count per rank.
Counts = Sequence[int] | Array


def _flat(arr: Array) -> Array:
    return arr.reshape(-1)


class Blocks(GroupCore):
    """The block collectives of :class:`~aiocollect.Group`."""

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
        """Gather every rank's ``send`` into ``out`` of shape ``(world_size, *send.shape)``.

        Args:
            send: this rank's block (the same dtype and shape on every rank).
            out: where the blocks go (``world_size`` times ``send``'s size, its dtype);
                None: a new array.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``ring``, ``direct``, or ``pull`` where every rank reads the
                others' memory; None: by size, world size and links.

        Returns:
            A Task that gives ``out`` (or the new array).

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer, an ``out`` of the
                wrong dtype or size, a bad timeout or algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        res = output(out, (n, *arr.shape), arr.dtype)
        alg = self._planner.choose(registry.ALLGATHER, algorithm, arr.nbytes * n)
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
        """Like allgather, but only ``root`` gets the result (None elsewhere).

        Args:
            send: this rank's block (the same dtype and shape on every rank).
            out: on the root, where the blocks go; None: a new array (ignored elsewhere).
            root: the group rank that gets the blocks.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``direct``, the only one; None: that one.

        Returns:
            A Task that gives ``out`` (or the new array) on the root, None elsewhere.

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer or root, an ``out`` of
                the wrong dtype or size, a bad timeout or algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes or roots.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
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
        """Rank i receives block i of ``root``'s ``send`` (shape ``(world_size, *out.shape)``).

        Args:
            send: on the root, the blocks (``world_size`` times ``out``'s size, its dtype);
                ignored elsewhere.
            out: this rank's block (written).
            root: the group rank whose blocks are sent.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``direct``, the only one; None: that one.

        Returns:
            A Task that gives ``out``.

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer or root, no ``send`` on
                the root or one of the wrong dtype or size, a bad timeout or algorithm, or the group
                is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes or roots.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
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
        """Reduce ``send`` across ranks; rank r gets the r-th of ``world_size`` blocks.

        Args:
            send: this rank's data, its first axis divisible by the world size.
            out: where this rank's reduced block goes; None: a new array.
            op: a :class:`~aiocollect.ReduceOp` or its name.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``ring``, ``direct``, or ``pull`` where every rank reads the
                others' memory; None: by size, world size and links.

        Returns:
            A Task that gives ``out`` (or the new array).

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer, a first axis not
                divisible by the world size, an op the dtype cannot take, an ``out`` of the wrong
                dtype or size, a bad timeout or algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes or ops.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
        arr = as_array(send, "send", writable=False)
        n = self.world_size
        divisible(arr, n, "send")
        rop, ufunc = reduction(op, arr)
        res = output(out, (arr.shape[0] // n, *arr.shape[1:]), arr.dtype)
        alg = self._planner.choose(registry.REDUCE_SCATTER, algorithm, arr.nbytes)
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
        rank j.

        Args:
            send: this rank's blocks, its first axis divisible by the world size.
            out: where the received blocks go (``send``'s dtype and size); None: a new
                array.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``pairwise``, the only one; None: that one.

        Returns:
            A Task that gives ``out`` (or the new array).

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer, a first axis not
                divisible by the world size, an ``out`` of the wrong dtype or size, a bad timeout or
                algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
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

    def allgatherv(
        self, send: Buffer, *, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Task[list[Array]]:
        """Gather arrays whose first axis may differ per rank.

        Args:
            send: this rank's array (a scalar counts as one row; the same dtype and row
                shape on every rank).
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``ring``, the only one; None: that one.

        Returns:
            A Task that gives every rank's array, in rank order.

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer, a bad timeout or
                algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes of rows.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
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

        Args:
            send: this rank's rows (the same dtype and row shape on every rank).
            send_counts: how many rows go to each rank (``world_size`` non-negative
                counts summing to ``send``'s row count).
            out: where the received rows go, concatenated along axis 0 in rank order
                (its row count must equal the total received); None: a list.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``pairwise``, the only one; None: that one.

        Returns:
            A Task that gives the blocks received from each rank as a list in rank order,
            or ``out`` filled with them.

        Raises:
            UsageError: from the call, before anything is sent: a bad buffer, counts that do not fit
                ``send``, an ``out`` of the wrong dtype or row shape, a bad timeout or algorithm, or
                the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes or dtypes, or an ``out`` whose row
                count is not the total received.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
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
