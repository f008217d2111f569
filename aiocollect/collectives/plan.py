"""A call's checks and plan: what a group concludes once per (collective, shape, options).

:class:`Planner` (one per group) takes a collective call's arguments, runs its checks
(raising UsageError before any byte is sent), chooses the algorithm (``algorithm=``, or
the automatic choice of the collective's registry for this group's size and links),
packs the fingerprint and, where the message fits in one frame, binds the algorithm's
one-frame program to the group's links (engine/small.py). The result is a :class:`Plan`,
which the group remembers per call shape, so that a repeated call is one dict lookup
(``aiocollect.group``, ``_plan``/``_remember``). Every collective over buffers, and
send/recv, has one method here (the object collectives, whose payload is serialised per
call, check their root in group/objects.py); what changes from call to call with the same
shape (the buffers themselves, an ``out`` buffer, scatter's ``send``, alltoallv's counts)
is checked per call by the group's method (checks.py).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from aiocollect._buffers import Array
from aiocollect.collectives import registry
from aiocollect.collectives.checks import check_rank, divisible, reduction
from aiocollect.engine.fabric import Fabric
from aiocollect.engine.small import Program, Small, one_way
from aiocollect.engine.topology import Topology
from aiocollect.errors import UsageError
from aiocollect.fingerprint import Fingerprint, pack
from aiocollect.transport.wire import DATA, P2P
from aiocollect.types import Collective, ReduceOp, dtype_code

#: The name of a collective's two-level algorithm (collectives/hierarchical.py).
TWO_LEVEL = "two_level"


class Plan(NamedTuple):
    """What a group remembers of a call: its fingerprint, its one-frame operation (or
    None: it runs ``run`` as a Task) and what ``run`` takes besides the operation."""

    #: The operation's fingerprint (checked against every peer's).
    fp: Fingerprint
    #: The one-frame operation bound to the group's links, or None.
    small: Small | None
    #: The algorithm (a coroutine function over the Op and the call's flat arrays or
    #: blocks), or None where only the fingerprint is planned (send and recv).
    run: Any = None
    #: The reduction's ufunc (allreduce, reduce, reduce_scatter).
    ufunc: Any = None
    #: Whether the reduction averages (``ReduceOp.AVG``).
    average: bool = False
    #: The root's group rank, checked (broadcast, reduce, gather, scatter).
    root: int = 0


class Planner:
    """The checks and choices of one group's calls: world ranks ``ranks`` of group
    ``gid`` on ``fabric``, messages cut into ``chunk_bytes``."""

    def __init__(self, fabric: Fabric, gid: int, ranks: list[int], chunk_bytes: int) -> None:
        self.fabric = fabric
        self.gid = gid
        self.ranks = ranks
        self.rank = ranks.index(fabric.rank)
        self.world_size = len(ranks)
        self.chunk_bytes = chunk_bytes

    @functools.cached_property
    def one_thread(self) -> bool:
        """Whether every peer of this group runs on this thread (in-process memory links:
        the same answer on every rank), for the automatic algorithm choice. A group's
        links are fixed when it forms, so this is asked once, not per call."""
        links, me = self.fabric.links, self.fabric.rank
        peers = [links.get(r) for r in self.ranks if r != me]
        return bool(peers) and all(link is not None and link.caps.same_thread for link in peers)

    @functools.cached_property
    def topology(self) -> Topology:
        """Which of this group's ranks share a host (from the rendezvous's host identity:
        the same on every rank of the group; asked once, hosts never change)."""
        hosts = self.fabric.hosts
        ids = [hosts[r] if r < len(hosts) else -1 - r for r in self.ranks]
        return Topology.of(ids, self.rank)

    def choose(
        self, reg: registry.Registry[Any, Any], algorithm: str | None, nbytes: int
    ) -> registry.Algorithm[Any, Any]:
        """``reg.choose`` with what this group's links are (the same on every rank);
        the automatic choice is the collective's two-level algorithm (``two_level``)
        wherever it has one and the group spans several hosts with several ranks on some.

        Args:
            reg: the collective's registry.
            algorithm: the name the call forced, or None for the automatic choice.
            nbytes: the message size the choice goes by.

        Returns:
            The algorithm.

        Raises:
            UsageError: ``algorithm`` is not one of the collective's.
        """
        auto = algorithm is None or algorithm == "auto"
        if auto and TWO_LEVEL in reg.algorithms and self.topology.two_level:
            return reg.algorithms[TWO_LEVEL]
        return reg.choose(algorithm, nbytes, self.world_size, self.one_thread, self.fabric.pulls)

    def chosen(self, collective: str, nbytes: int) -> str:
        """The algorithm the automatic choice runs for ``collective`` on a message of
        ``nbytes`` in this group (``Group.chosen_algorithm``).

        Raises:
            UsageError: no collective of that name takes ``algorithm=``.
        """
        reg = registry.REGISTRIES.get(collective) if isinstance(collective, str) else None
        if reg is None:
            raise UsageError(
                f"no collective {collective!r}; one of {', '.join(registry.REGISTRIES)}"
            )
        return self.choose(reg, None, nbytes).name

    def bind(
        self,
        kind: str,
        program: Program,
        fp: Fingerprint,
        nbytes: int,
        dtype: Any = None,
        frame_kind: int = DATA,
    ) -> Small | None:
        """``program`` bound to this group's links and frame headers, for buffers of
        ``dtype`` and frames of ``frame_kind`` (DATA, or P2P for send/recv); None where a
        link it needs is not made yet (links on demand: the operation then runs as a
        Task, which makes them first).

        Args:
            kind: the operation's name ("allreduce", ...).
            program: this rank's one-frame program.
            fp: the operation's fingerprint.
            nbytes: the buffer's size in bytes.
            dtype: the buffer's dtype (None: empty frames).
            frame_kind: DATA or P2P.

        Returns:
            The one-frame operation, ready to run per call, or None.
        """
        fabric = self.fabric
        links = fabric.links
        for st in program.steps:
            for peer in (st.send_to, st.recv_from):
                if peer >= 0 and self.ranks[peer] not in links:
                    return None
        return Small(
            kind,
            program,
            self.gid,
            fp,
            self.ranks,
            fabric.links,
            nbytes,
            dtype,
            frame_kind,
            fabric.spins,
        )

    # -- the plans ---------------------------------------------------------------------------

    def barrier(self, algorithm: str | None) -> Plan:
        """barrier's plan (empty frames: one-frame wherever the program covers the world
        size).

        Raises:
            UsageError: an unknown ``algorithm``.
        """
        n = self.world_size
        alg = self.choose(registry.BARRIER, algorithm, 0)
        fp = pack(Collective.BARRIER, None, algorithm=alg.name)
        small = (
            self.bind("barrier", alg.program(n, self.rank), fp, 0)
            if alg.program is not None and alg.empty_frames(n)
            else None
        )
        return Plan(fp, small, alg.run)

    def broadcast(self, arr: Array, root: Any, algorithm: Any) -> Plan:
        """broadcast's checks and plan for ``arr`` (its dtype and size) from ``root``.

        Raises:
            UsageError: a dtype aiocollect does not carry, a root out of range or not an
                int, an unknown ``algorithm``.
        """
        dtype_code(arr.dtype)
        n = self.world_size
        root = check_rank(root, n, "root")
        alg = self.choose(registry.BROADCAST, algorithm, arr.nbytes)
        fp = pack(Collective.BROADCAST, arr, root=root, algorithm=alg.name)
        small, prog = None, alg.program
        if prog is not None and alg.one_frame(arr.nbytes, n, self.chunk_bytes):
            small = self.bind("broadcast", prog(n, self.rank, root), fp, arr.nbytes, arr.dtype)
        return Plan(fp, small, alg.run, root=root)

    def allreduce(self, arr: Array, op: Any, algorithm: Any) -> Plan:
        """allreduce's checks and plan for ``arr`` (its dtype and size) and ``op``.

        Raises:
            UsageError: a dtype aiocollect does not carry, an op the dtype cannot take,
                an unknown ``algorithm``.
        """
        dtype_code(arr.dtype)
        rop, ufunc = reduction(op, arr)
        n = self.world_size
        alg = self.choose(registry.ALLREDUCE, algorithm, arr.nbytes)
        fp = pack(Collective.ALLREDUCE, arr, op=rop, algorithm=alg.name)
        average = rop is ReduceOp.AVG
        small, prog = None, alg.program
        if prog is not None and alg.one_frame(arr.nbytes, n, self.chunk_bytes):
            small = self.bind("allreduce", prog(n, self.rank, average), fp, arr.nbytes, arr.dtype)
        return Plan(fp, small, alg.run, ufunc, average)

    def reduce(self, arr: Array, root: Any, op: Any, algorithm: Any) -> Plan:
        """reduce's checks and plan for ``arr`` (its dtype and size) into ``root`` by
        ``op`` (a Task: no one-frame program).

        Raises:
            UsageError: a dtype aiocollect does not carry, a root out of range or not an
                int, an op the dtype cannot take, an unknown ``algorithm``.
        """
        dtype_code(arr.dtype)
        root = check_rank(root, self.world_size, "root")
        rop, ufunc = reduction(op, arr)
        alg = self.choose(registry.REDUCE, algorithm, 0)
        fp = pack(Collective.REDUCE, arr, op=rop, root=root, algorithm=alg.name)
        return Plan(fp, None, alg.run, ufunc, rop is ReduceOp.AVG, root)

    # The block collectives run as Tasks: their plans have no one-frame program. The
    # group's method checks the buffers that change per call (``out``, scatter's ``send``,
    # alltoallv's counts; checks.py).

    def allgather(self, arr: Array, algorithm: Any) -> Plan:
        """allgather's plan for ``arr`` (its dtype and size: its dtype checked by the
        caller's ``as_array``), the automatic choice going by the gathered total.

        Raises:
            UsageError: an unknown ``algorithm``; a dtype aiocollect does not carry.
        """
        alg = self.choose(registry.ALLGATHER, algorithm, arr.nbytes * self.world_size)
        fp = pack(Collective.ALLGATHER, arr, algorithm=alg.name)
        return Plan(fp, None, alg.run)

    def gather(self, arr: Array, root: Any, algorithm: Any) -> Plan:
        """gather's checks and plan for ``arr`` (its dtype and size) to ``root``.

        Raises:
            UsageError: a dtype aiocollect does not carry, a root out of range or not an
                int, an unknown ``algorithm``.
        """
        return self._rooted(Collective.GATHER, registry.GATHER, arr, root, algorithm)

    def scatter(self, out: Array, root: Any, algorithm: Any) -> Plan:
        """scatter's checks and plan for the received block ``out`` (its dtype and size)
        from ``root`` (the root's ``send`` is checked per call: checks.scatter_source).

        Raises:
            UsageError: a dtype aiocollect does not carry, a root out of range or not an
                int, an unknown ``algorithm``.
        """
        return self._rooted(Collective.SCATTER, registry.SCATTER, out, root, algorithm)

    def _rooted(
        self,
        collective: Collective,
        reg: registry.Registry[Any, Any],
        arr: Array,
        root: Any,
        algorithm: Any,
    ) -> Plan:
        """The plan of a rooted block collective (gather, scatter): ``arr``'s dtype, the
        root and the algorithm checked in that order."""
        dtype_code(arr.dtype)
        root = check_rank(root, self.world_size, "root")
        alg = self.choose(reg, algorithm, 0)
        fp = pack(collective, arr, root=root, algorithm=alg.name)
        return Plan(fp, None, alg.run, root=root)

    def reduce_scatter(self, arr: Array, op: Any, algorithm: Any) -> Plan:
        """reduce_scatter's checks and plan for ``arr`` (its dtype and shape) by ``op``.

        Raises:
            UsageError: a dtype aiocollect does not carry, a first axis not divisible by
                the world size, an op the dtype cannot take, an unknown ``algorithm``.
        """
        dtype_code(arr.dtype)
        divisible(arr, self.world_size, "send")
        rop, ufunc = reduction(op, arr)
        alg = self.choose(registry.REDUCE_SCATTER, algorithm, arr.nbytes)
        fp = pack(Collective.REDUCE_SCATTER, arr, op=rop, algorithm=alg.name)
        return Plan(fp, None, alg.run, ufunc, rop is ReduceOp.AVG)

    def alltoall(self, arr: Array, algorithm: Any) -> Plan:
        """alltoall's checks and plan for ``arr`` (its dtype and shape).

        Raises:
            UsageError: a dtype aiocollect does not carry, a first axis not divisible by
                the world size, an unknown ``algorithm``.
        """
        dtype_code(arr.dtype)
        divisible(arr, self.world_size, "send")
        alg = self.choose(registry.ALLTOALL, algorithm, 0)
        fp = pack(Collective.ALLTOALL, arr, algorithm=alg.name)
        return Plan(fp, None, alg.run)

    def allgatherv(self, arr: Array, algorithm: Any) -> Plan:
        """allgatherv's checks and plan for rows of ``arr``'s dtype (the row counts are
        exchanged, not planned: the fingerprint's count is 0).

        Raises:
            UsageError: a dtype aiocollect does not carry, an unknown ``algorithm``.
        """
        dtype_code(arr.dtype)
        alg = self.choose(registry.ALLGATHERV, algorithm, 0)
        fp = pack(Collective.ALLGATHERV, arr, count=0, algorithm=alg.name)
        return Plan(fp, None, alg.run)

    def alltoallv(self, arr: Array, algorithm: Any) -> Plan:
        """alltoallv's plan for rows of ``arr``'s dtype (its dtype checked by the caller's
        ``as_array``; the counts are checked per call: checks.row_counts).

        Raises:
            UsageError: an unknown ``algorithm``; a dtype aiocollect does not carry.
        """
        alg = self.choose(registry.ALLTOALLV, algorithm, 0)
        fp = pack(Collective.ALLTOALLV, arr, count=0, algorithm=alg.name)
        return Plan(fp, None, alg.run)

    def p2p(self, kind: str, arr: Array, dst: int, src: int, tag: int) -> Plan:
        """send's (``dst``) or recv's (``src``) plan for ``arr``: its fingerprint and, for
        a message of one frame, its one-frame program (the peer and tag checked by the
        caller)."""
        fp = self.p2p_fingerprint(arr)
        small = None
        if arr.nbytes <= self.chunk_bytes:
            small = self.bind(kind, one_way(dst, src, tag), fp, arr.nbytes, arr.dtype, P2P)
        return Plan(fp, small)

    def p2p_fingerprint(self, arr: Array) -> Fingerprint:
        """send's and recv's fingerprint of ``arr``.

        Raises:
            UsageError: a dtype aiocollect does not carry.
        """
        return pack(Collective.SEND, arr)
