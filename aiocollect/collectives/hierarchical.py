"""Two-level collectives (allreduce, broadcast, reduce, allgather(v), reduce_scatter,
barrier): inside each host, between hosts, inside each host again.

Where a group spans H hosts with several ranks on some (R_h ranks on host h; the topology
from the rendezvous's host identity, :mod:`aiocollect.engine.topology`), each phase is an
existing whole algorithm over a subset of the operation's ranks (a
:class:`~aiocollect.engine.phase.Phase`), so the same-host phases run over same-host links
(shared memory and its pulls) and only the middle phase crosses between hosts.

Schedules (S bytes):

- one leader (``S <= LEADERS_MAX``): binomial reduce to each host's leader (its lowest
  rank), recursive doubling among the H leaders, binomial broadcast from the leader.
  ceil(log2 R) + ceil(log2 H) + ceil(log2 R) steps; between hosts one message of S per
  leader and exchange: log2(H) exchanges (plus a fold where H is not a power of two).
- several leaders (larger): ring reduce-scatter inside each host (local rank i ends with
  block i of R_h), a ring allreduce of each share among the ranks that hold it on every
  host (local rank i of every host: the i-th inter-host ring; where hosts have different
  R_h the shares are cut at every host's block bounds, and a rank takes part in the ring
  of each piece of its block), ring allgather inside each host. Between hosts each host
  sends 2(H-1)/H x S in all, spread over its R_h ranks' connections (a flat ring sends
  2(n-1)/n x S per rank, so R_h times that per host in a blocked placement and up to twice
  more in a cyclic one).

A whole algorithm may leave its last receives to the operation's ``finish``; each phase
ends with it (every receive of the phase landed, every send left), so the next phase
reads complete data.

- broadcast: the root's host is represented by the root, every other host by its
  leader; the flat broadcast the automatic choice takes for H ranks and S bytes (binomial
  or pipeline) runs among those H, then inside every host from its representative. Each
  host receives S once.
- reduce: binomial reduce inside each host to its representative (the root on its host,
  the leader elsewhere), then among the H representatives to the root: each host sends
  S at most once between hosts.
- allgather: the ranks of a host send their blocks to its leader; the leaders run a ring
  allgather of the hosts' blocks (packed host by host); each leader broadcasts every block
  inside its host (binomial). Each host receives the (n - R_h) other blocks once.
- reduce_scatter: binomial reduce of the whole input inside each host to its leader; ring
  reduce-scatter among the leaders of the hosts' blocks (packed host by host), so each
  leader holds its host's blocks reduced; the leader sends each rank its block. Each host
  sends (H-1)/H x S between hosts; inside a host the leader receives more than a flat
  algorithm's ranks do.
- allgatherv: the allgather above twice, for the (rows, row size) of every rank and then
  for the rows (blocks of any size; :func:`~aiocollect.collectives.vector.gather_v` checks
  the sizes in between).
- barrier: the ranks of a host report to its leader, the leaders run a dissemination
  barrier (ceil(log2 H) rounds of one empty frame per leader), each leader releases its
  host's ranks: 2 + ceil(log2 H) steps, only the leaders' frames cross between hosts.

Every element is reduced in one fixed order (the host's tree or ring, then the
inter-host algorithm) and copied from there, so every rank gets the same bits.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from aiocollect._buffers import Array
from aiocollect.collectives import barrier as flat_barrier
from aiocollect.collectives import doubling, pipeline, ring, select, tree, vector
from aiocollect.engine.op import Op, flat_blocks, split_even
from aiocollect.engine.phase import PHASE_SHIFT, Phase
from aiocollect.engine.reduce import copy_into, settle
from aiocollect.engine.topology import Topology

#: Allreduces up to this many bytes go through one leader per host; larger ones through
#: every local rank (docs/algorithms.md, "Two levels").
LEADERS_MAX = 64 * 1024

# Slot bases of the phases (each phase's algorithm uses slots below 1 << PHASE_SHIFT).
_REDUCE, _LEADERS, _BROADCAST, _SCATTER, _GATHER = (k << PHASE_SHIFT for k in range(1, 6))
#: The inter-host rings of the pieces: piece p at ``_PIECES + p << PHASE_SHIFT``.
_PIECES = 8 << PHASE_SHIFT
#: allgatherv's second exchange (the rows): its phases' slots offset by this.
_ROWS = 1 << (PHASE_SHIFT + 16)


@lru_cache(maxsize=64)
def _topology(host_ids: tuple[int, ...], rank: int) -> Topology:
    return Topology.of(host_ids, rank)


def topology(op: Op) -> Topology:
    """The topology of ``op``'s ranks, from the host index of each world rank the fabric
    holds (unknown: every rank its own host)."""
    hosts = op.fabric.hosts
    ids = tuple(hosts[r] if r < len(hosts) else -1 - r for r in op.ranks)
    return _topology(ids, op.rank)


async def allreduce(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` in place on every rank in two levels (``average``: then
    divide by the world size)."""
    topo = topology(op)
    if buf.nbytes <= LEADERS_MAX:
        await _one_leader(op, topo, buf, ufunc)
    else:
        await _every_leader(op, topo, buf, ufunc)
    if average:
        await op.finish()  # (settle rewrites buf: nothing sent from it may wait to leave)
    settle(buf, buf, op.size if average else 1)


async def _one_leader(op: Op, topo: Topology, buf: Array, ufunc: np.ufunc) -> None:
    local = topo.local
    if len(local) > 1:
        await tree.reduce(Phase(op, local, _REDUCE), buf, 0, ufunc, False)
    if topo.local_rank == 0 and len(topo.hosts) > 1:
        await doubling.recursive_doubling(Phase(op, topo.leaders, _LEADERS), buf, ufunc, False)
        await op.finish()
    if len(local) > 1:
        await tree.broadcast(Phase(op, local, _BROADCAST), buf, 0)


def pieces(topo: Topology, count: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """The inter-host pieces of a ``count``-element message: ``(start, stop, ranks)``,
    cut at every host's block bounds (``flat_blocks`` of R_h blocks), ``ranks`` the group
    ranks that hold the piece's block on each host, in host order. Empty pieces are left
    out."""
    bounds = {0, count}
    for ranks in topo.hosts:
        bounds.update(count * i // len(ranks) for i in range(len(ranks)))
    cuts = sorted(bounds)
    out = []
    for start, stop in itertools.pairwise(cuts):
        holders = tuple(
            ranks[max(i for i in range(len(ranks)) if count * i // len(ranks) <= start)]
            for ranks in topo.hosts
        )
        out.append((start, stop, holders))
    return out


async def _every_leader(op: Op, topo: Topology, buf: Array, ufunc: np.ufunc) -> None:
    local = topo.local
    blocks = flat_blocks(buf, len(local))
    if len(local) > 1:
        await ring.reduce_scatter_blocks(Phase(op, local, _SCATTER), blocks, ufunc)
        await op.finish()
    if len(topo.hosts) > 1:
        mine = [
            ring.allreduce(Phase(op, ranks, _PIECES + (p << PHASE_SHIFT)), buf[a:b], ufunc, False)
            for p, (a, b, ranks) in enumerate(pieces(topo, buf.size))
            if op.rank in ranks
        ]
        if len(mine) == 1:
            await mine[0]
        else:  # (uneven hosts: this rank holds pieces of several rings)
            tasks = [asyncio.ensure_future(ring_of_piece) for ring_of_piece in mine]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
        await op.finish()
    if len(local) > 1:
        await ring.allgather_blocks(Phase(op, local, _GATHER), blocks)


async def reduce(op: Op, buf: Array, root: int, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` into ``root``'s in two levels (divided by the world size
    there when ``average``); the other ranks' ``buf`` stays unchanged."""
    topo = topology(op)
    root_host = topo.host_of[root]
    reps = [root if h == root_host else ranks[0] for h, ranks in enumerate(topo.hosts)]
    rep = op.rank in reps
    # a phase's root reduces in place: only the root's own buf may take partial sums
    work = buf if op.rank == root or not rep else buf.copy()
    local = topo.local
    if len(local) > 1:
        await tree.reduce(
            Phase(op, local, _REDUCE), work, local.index(reps[topo.host]), ufunc, False
        )
    if rep and len(reps) > 1:
        await tree.reduce(Phase(op, reps, _LEADERS), work, root_host, ufunc, False)
    if op.rank == root and average:
        await op.finish()
        settle(buf, buf, op.size)


async def allgather(op: Op, send: Array, blocks: Sequence[Array]) -> None:
    """Gather every rank's flat ``send`` into ``blocks`` (block i from rank i) in two
    levels."""
    await _allgather(op, send, blocks, 0)


async def _allgather(op: Op, send: Array, blocks: Sequence[Array], base: int) -> None:
    """:func:`allgather` in the slots from ``base`` up (one operation may run it twice);
    the blocks may differ in size (every rank knows every block's)."""
    topo = topology(op)
    local = Phase(op, topo.local, base + _REDUCE) if len(topo.local) > 1 else None
    if topo.local_rank != 0:
        assert local is not None
        await local.send_chunks(0, 0, send)  # to the leader
    else:
        for p, r in enumerate(topo.local[1:], 1):
            assert local is not None
            local.recv_chunks(p, 0, blocks[r])
        if blocks[op.rank] is not send:
            await copy_into(blocks[op.rank], send)
        await op.finish()
        if len(topo.hosts) > 1:
            await _leaders_allgather(op, topo, blocks, base)
    if local is not None:
        out = Phase(op, topo.local, base + _BROADCAST)
        for b, block in enumerate(blocks):
            await tree.broadcast(out, block, 0, slot=b)


async def _leaders_allgather(op: Op, topo: Topology, blocks: Sequence[Array], base: int) -> None:
    """Among the leaders, a ring allgather of every host's blocks, packed host by host
    (a host's ranks need not be contiguous)."""
    spans = [_spans(ranks, blocks) for ranks in topo.hosts]
    packed = np.empty(sum(b.size for b in blocks), dtype=blocks[0].dtype)
    hosts: list[Array] = []
    at = 0
    for host_spans in spans:  # (every host has a rank: its last span ends its block)
        size = host_spans[-1][1]
        hosts.append(packed[at : at + size])
        at += size
    for r, (a, b) in zip(topo.local, spans[topo.host], strict=True):
        hosts[topo.host][a:b] = blocks[r]
    await ring.allgather_blocks(Phase(op, topo.leaders, base + _LEADERS), hosts)
    await op.finish()
    for h, ranks in enumerate(topo.hosts):
        if h != topo.host:
            for r, (a, b) in zip(ranks, spans[h], strict=True):
                blocks[r][...] = hosts[h][a:b]


def _spans(ranks: Sequence[int], blocks: Sequence[Array]) -> list[tuple[int, int]]:
    """Where the blocks of ``ranks`` lie in their host's packed block: (start, stop) each."""
    out = []
    at = 0
    for r in ranks:
        out.append((at, at + blocks[r].size))
        at += blocks[r].size
    return out


async def allgatherv(op: Op, arr: Array) -> list[Array]:
    """Every rank's ``arr`` (at least one axis; the first may differ per rank), in rank
    order, in two levels: the row counts, then the rows, each gathered as
    :func:`allgather` does.

    Raises:
        ProtocolError: a rank declared a negative size or more than this host's memory.
        MismatchError: a rank's rows have another size than this rank's.
    """
    blocks = await vector.gather_v(op, arr, "allgatherv", gather=_gather_step)
    return [b.reshape(rows, *arr.shape[1:]) for rows, b in blocks]


async def _gather_step(op: Op, blocks: Sequence[Array], step: int) -> None:
    """One exchange of :func:`vector.gather_v` (``step`` 0: the sizes, 1: the rows):
    :func:`allgather` of ``blocks`` (this rank's filled), in slots of its own."""
    await _allgather(op, blocks[op.rank], blocks, step * _ROWS)
    await op.finish()


async def reduce_scatter(op: Op, send: Array, dest: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``send`` across ranks in two levels; the flat ``dest`` gets this
    rank's block (block ``op.rank`` of ``op.size``), divided by the world size when
    ``average``."""
    topo = topology(op)
    local = Phase(op, topo.local, _REDUCE) if len(topo.local) > 1 else None
    if topo.local_rank != 0:
        assert local is not None
        await tree.reduce(local, send, 0, ufunc, False)  # (reduces a copy off the root)
        local.recv_chunks(0, 1, dest)
        await op.finish()
    else:
        work = send.copy()
        if local is not None:
            await tree.reduce(local, work, 0, ufunc, False)
        blocks = split_even(work, op.size)
        size = blocks[0].size
        packed = np.empty_like(work)
        hosts: list[Array] = []
        at = 0
        for ranks in topo.hosts:
            hosts.append(packed[at : at + size * len(ranks)])
            for i, r in enumerate(ranks):
                hosts[-1][i * size : (i + 1) * size] = blocks[r]
            at += size * len(ranks)
        if len(topo.hosts) > 1:
            await ring.reduce_scatter_blocks(Phase(op, topo.leaders, _LEADERS), hosts, ufunc)
            await op.finish()
        mine = hosts[topo.host]
        dest[...] = mine[:size]
        if local is not None:
            for p in range(1, local.size):
                await local.send_chunks(p, 1, mine[p * size : (p + 1) * size])
        await op.finish()
    settle(dest, dest, op.size if average else 1)


async def broadcast(op: Op, buf: Array, root: int) -> None:
    """Copy ``root``'s flat ``buf`` into every rank's in two levels."""
    topo = topology(op)
    root_host = topo.host_of[root]
    reps = [root if h == root_host else ranks[0] for h, ranks in enumerate(topo.hosts)]
    if op.rank in reps and len(reps) > 1:
        await _broadcast(Phase(op, reps, _LEADERS), buf, root_host)
        await op.finish()
    local = topo.local
    if len(local) > 1:
        await _broadcast(Phase(op, local, _BROADCAST), buf, local.index(reps[topo.host]))


async def _broadcast(op: Op, buf: Array, root: int) -> None:
    """The flat broadcast the automatic choice takes for ``op.size`` ranks (neither
    level is known to read the peers' memory: no ``pull``)."""
    if select.broadcast(buf.nbytes, op.size) == "pipeline":
        await pipeline.broadcast(op, buf, root)
    else:
        await tree.broadcast(op, buf, root)


_EMPTY = np.empty(0, dtype=np.uint8)


async def barrier(op: Op) -> None:
    """Return once every rank entered, in two levels."""
    topo = topology(op)
    local = Phase(op, topo.local, _REDUCE) if len(topo.local) > 1 else None
    if topo.local_rank != 0:
        assert local is not None
        released = local.recv(0, 1, 0, _EMPTY)
        await local.send(0, 0, 0, _EMPTY)
        await released
        return
    if local is not None:
        for fut in [local.recv(p, 0, 0, _EMPTY) for p in range(1, local.size)]:
            await fut
    if len(topo.hosts) > 1:
        await flat_barrier.barrier(Phase(op, topo.leaders, _LEADERS))
    if local is not None:
        for p in range(1, local.size):
            await local.send(p, 1, 0, _EMPTY)
