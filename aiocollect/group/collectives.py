"""The in-place collectives of a group: ``barrier``, ``broadcast``, ``allreduce``,
``reduce``, and which algorithm the automatic choice runs (``chosen_algorithm``).

Each method plans a call once per shape (collectives/plan.py: the checks, raising
UsageError before anything is sent, the algorithm, the fingerprint, the one-frame
program), remembers the plan (a repeated call is one dict lookup) and starts it: a
one-frame operation (engine/small.py) or a Task running the algorithm.
"""

from __future__ import annotations

import asyncio

import numpy as np

from aiocollect._buffers import B, as_array
from aiocollect.engine.op import Op
from aiocollect.group.core import GroupCore
from aiocollect.types import OpLike, ReduceOp

#: The buffer of a one-frame barrier (its frames are empty).
_EMPTY = np.empty(0, dtype=np.uint8)


class InPlace(GroupCore):
    """``barrier``, ``broadcast``, ``allreduce`` and ``reduce`` of
    :class:`~aiocollect.Group`."""

    def chosen_algorithm(self, collective: str, nbytes: int) -> str:
        """The algorithm that ``algorithm=None`` runs for ``collective`` on a message of
        ``nbytes`` in this group, by size, world size and the group's links
        (docs/algorithms.md). The same on every rank.

        Args:
            collective: a collective that takes ``algorithm=`` (``"allreduce"``,
                ``"barrier"``, ...).
            nbytes: the message size in bytes (allgather: the gathered total).

        Returns:
            The algorithm's name, as ``algorithm=`` takes it.

        Raises:
            UsageError: no collective of that name takes ``algorithm=``.
        """
        return self._planner.chosen(collective, nbytes)

    def barrier(
        self, *, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Future[None]:
        """Complete once every rank has entered the barrier.

        Args:
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``dissemination``, ``star`` (through rank 0) or ``two_level``
                (across hosts); None: ``two_level`` where the group spans several hosts
                with several ranks on some, else ``star`` at three and four ranks, else
                ``dissemination``.

        Returns:
            A handle (an ``asyncio.Future``) that completes with None.

        Raises:
            UsageError: from the call: an unknown algorithm, a bad timeout, or the group
                is closed.
            MismatchError: (the handle) the ranks called different collectives.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
        key = ("barrier", algorithm)
        plan = self._plan(key)
        if plan is None:
            plan = self._remember(key, self._planner.barrier(algorithm))
        fp, small, run, _, _, _ = plan
        if small is not None:
            return self._quick(small, _EMPTY, None, None, timeout)
        return self._start("barrier", fp, run, timeout)

    def broadcast(
        self, buf: B, *, root: int = 0, timeout: float | None = None, algorithm: str | None = None
    ) -> asyncio.Future[B]:
        """Copy ``root``'s ``buf`` into every rank's ``buf``.

        Args:
            buf: a contiguous buffer of the same dtype and size on every rank (written
                on all but the root).
            root: the group rank whose buffer is sent.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``binomial`` (tree), ``pipeline``, ``pull`` (reads the root's
                buffer where every rank can: shared memory), ``two_level`` (across
                hosts); None: by hosts, size, world size and links.

        Returns:
            A handle (an ``asyncio.Future``) that completes with ``buf``.

        Raises:
            UsageError: from the call: a bad or read-only buffer, a dtype aiocollect does
                not carry, a bad root, timeout or algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes, dtypes or roots.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
        arr = as_array(buf, "buf", writable=True, dtype=False)  # (the plan checks it)
        key = ("broadcast", arr.dtype, arr.size, type(root), root, algorithm)
        try:
            plan = self._plans.get(key)
        except TypeError:  # not hashable: not valid arguments, the checks say why
            plan = None
        fp, small, run, _, _, root = plan or self._remember(
            key, self._planner.broadcast(arr, root, algorithm)
        )
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        if small is not None:
            return self._quick(small, flat, None, buf, timeout)

        async def body(o: Op) -> B:
            await run(o, flat, root)
            return buf

        return self._start("broadcast", fp, body, timeout)

    def allreduce(
        self,
        buf: B,
        *,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Future[B]:
        """Reduce ``buf`` across ranks, in place on every rank.

        Args:
            buf: a writable contiguous buffer of the same dtype and size on every rank.
            op: a :class:`~aiocollect.ReduceOp` or its name (``"sum"``, ``"max"``, ...).
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``ring`` (bandwidth), ``recursive_doubling`` (latency),
                ``halving_doubling``, ``star`` (through rank 0: few messages, few ranks),
                ``pull`` (reads the peers' buffers where every rank can: shared memory),
                ``segment`` (copies through shared segments on one host), ``two_level``
                (across hosts); None: by hosts, size, world size and links.

        Returns:
            A handle (an ``asyncio.Future``) that completes with ``buf``.

        Raises:
            UsageError: from the call: a bad or read-only buffer, a dtype aiocollect does
                not carry, an op the dtype cannot take, a bad timeout or algorithm, or the
                group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes, dtypes or ops.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
        arr = as_array(buf, "buf", writable=True, dtype=False)  # (the plan checks it)
        key = ("allreduce", arr.dtype, arr.size, type(op), op, algorithm)
        try:
            plan = self._plans.get(key)
        except TypeError:  # not hashable: not valid arguments, the checks say why
            plan = None
        fp, small, run, ufunc, average, _ = plan or self._remember(
            key, self._planner.allreduce(arr, op, algorithm)
        )
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        if small is not None:
            return self._quick(small, flat, ufunc, buf, timeout)

        async def body(o: Op) -> B:
            await run(o, flat, ufunc, average)
            return buf

        return self._start("allreduce", fp, body, timeout)

    def reduce(
        self,
        buf: B,
        *,
        root: int = 0,
        op: OpLike = ReduceOp.SUM,
        timeout: float | None = None,
        algorithm: str | None = None,
    ) -> asyncio.Task[B]:
        """Reduce ``buf`` across ranks into ``root``'s ``buf``; others' stay unchanged.

        Args:
            buf: a writable contiguous buffer of the same dtype and size on every rank.
            root: the group rank that gets the result.
            op: a :class:`~aiocollect.ReduceOp` or its name.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).
            algorithm: ``binomial`` (tree) or ``two_level`` (across hosts); None:
                ``two_level`` where the group spans several hosts with several ranks on
                some, else ``binomial``.

        Returns:
            A Task that gives ``buf``.

        Raises:
            UsageError: from the call: a bad or read-only buffer, a bad root, an op the
                dtype cannot take, a bad timeout or algorithm, or the group is closed.
            MismatchError: (the handle) the ranks called different collectives or passed
                different sizes, dtypes, ops or roots.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) a peer's connection was lost.
        """
        arr = as_array(buf, "buf", writable=True, dtype=False)  # (the plan checks it)
        key = ("reduce", arr.dtype, arr.size, type(root), root, type(op), op, algorithm)
        plan = self._plan(key) or self._remember(
            key, self._planner.reduce(arr, root, op, algorithm)
        )
        fp, _, run, ufunc, average, root = plan

        async def body(o: Op) -> B:
            await run(o, arr.reshape(-1), root, ufunc, average)
            return buf

        return self._start("reduce", fp, body, timeout)
