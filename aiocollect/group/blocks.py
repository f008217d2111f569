"""The collectives over blocks of a group: ``allgather``, ``gather``, ``scatter``,
``reduce_scatter``, ``alltoall`` and the variable-size ``allgatherv`` and ``alltoallv``.

Each takes the plan of its call's shape (collectives/plan.py: the checks, raising
UsageError before anything is sent, the algorithm and the fingerprint), remembered per
shape so that a repeated call is one dict lookup; checks the buffers that change per call
(``out``, scatter's ``send``, alltoallv's counts: collectives/checks.py), allocating a
missing ``out``; and starts a Task running the algorithm over the flat arrays, split into
one block per rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, overload

from aiocollect._buffers import Array, B, Buffer, as_array
from aiocollect.collectives.checks import output, row_counts, rows_output, scatter_source
from aiocollect.engine.op import Op, split_even
from aiocollect.group.core import GroupCore
from aiocollect.types import OpLike, ReduceOp

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
            algorithm: ``ring``, ``direct``, ``pull`` where every rank reads the
                others' memory, or ``two_level`` (across hosts); None: by hosts, size,
                world size and links.

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
        key = ("allgather", arr.dtype, arr.size, algorithm)
        plan = self._plan(key) or self._remember(key, self._planner.allgather(arr, algorithm))
        fp, _, run, _, _, _ = plan

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
        arr = as_array(send, "send", writable=False, dtype=False)  # (the plan checks it)
        n = self.world_size
        key = ("gather", arr.dtype, arr.size, type(root), root, algorithm)
        plan = self._plan(key) or self._remember(key, self._planner.gather(arr, root, algorithm))
        fp, _, run, _, _, root = plan
        res = output(out, (n, *arr.shape), arr.dtype) if self.rank == root else None

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
        res = as_array(out, "out", writable=True, dtype=False)  # (the plan checks it)
        key = ("scatter", res.dtype, res.size, type(root), root, algorithm)
        plan = self._plan(key) or self._remember(key, self._planner.scatter(res, root, algorithm))
        fp, _, run, _, _, root = plan
        src = scatter_source(send, res, n) if self.rank == root else None

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
            algorithm: ``ring``, ``direct``, ``pull`` where every rank reads the
                others' memory, or ``two_level`` (across hosts); None: by hosts, size,
                world size and links.

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
        arr = as_array(send, "send", writable=False, dtype=False)  # (the plan checks it)
        n = self.world_size
        key = ("reduce_scatter", arr.dtype, arr.shape, type(op), op, algorithm)
        plan = self._plan(key) or self._remember(
            key, self._planner.reduce_scatter(arr, op, algorithm)
        )
        fp, _, run, ufunc, average, _ = plan
        res = output(out, (arr.shape[0] // n, *arr.shape[1:]), arr.dtype)

        async def body(o: Op) -> Buffer:
            await run(o, _flat(arr), _flat(res), ufunc, average)
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
        arr = as_array(send, "send", writable=False, dtype=False)  # (the plan checks it)
        n = self.world_size
        key = ("alltoall", arr.dtype, arr.shape, algorithm)
        plan = self._plan(key) or self._remember(key, self._planner.alltoall(arr, algorithm))
        fp, _, run, _, _, _ = plan
        res = output(out, arr.shape, arr.dtype)

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
            algorithm: ``ring`` or ``two_level`` (across hosts); None: ``two_level``
                where the group spans several hosts with several ranks on some, else
                ``ring``.

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
        arr = as_array(send, "send", writable=False, dtype=False)  # (the plan checks it)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        key = ("allgatherv", arr.dtype, algorithm)
        plan = self._plan(key) or self._remember(key, self._planner.allgatherv(arr, algorithm))
        fp, _, run, _, _, _ = plan

        async def body(o: Op) -> list[Array]:
            blocks: list[Array] = await run(o, arr)
            return blocks

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
        counts = row_counts(send_counts, arr, self.world_size)
        res = rows_output(out, arr)
        key = ("alltoallv", arr.dtype, algorithm)
        plan = self._plan(key) or self._remember(key, self._planner.alltoallv(arr, algorithm))
        fp, _, run, _, _, _ = plan

        async def body(o: Op) -> list[Array] | Buffer:
            blocks = await run(o, arr, counts, res)
            return blocks if out is None else out

        return self._start("alltoallv", fp, body, timeout)
