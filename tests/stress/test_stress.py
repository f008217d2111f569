"""The stress suite: 32+ seeded random operations in flight at once, on every transport and
mode, on asyncio and uvloop, at world sizes 2-4, with sizes straddling every threshold, and
every result compared exactly with numpy (tests/support/stress_plan.py).

Modes (tests/support/transports.py): ``memory`` (ranks in one process, on both loops), and
in real processes ``tcp``, ``tls``, ``shm`` with single-copy pulls, ``shm-nopull`` without
them (``AIOCOLLECT_SHM_PULL=0``), ``auto`` (the default a same-host user gets: shared memory
with pulls where the kernel allows it, the link's socket a Unix socket) and
``shm-tcpsocket`` (shared memory with the link's socket on TCP loopback,
``AIOCOLLECT_UNIX_SOCKET=0``: where Unix sockets fail); and any transport registered later.

A stall shows as a PeerTimeout after ``op_timeout()`` seconds (30 s on a machine with a
core per runnable process, up to 4 times that when it is oversubscribed), inside the
test's bound.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from aiocollect.transport import cma
from tests.support.targets import stress as targets
from tests.support.transports import Axis, modes

ROUNDS = 2
OPS = 32
#: Seconds an operation may take on a machine that is not oversubscribed. An operation's
#: deadline runs from its call, and a round calls all of its operations at once, so the
#: last one's covers the whole round: about 1.4 s of CPU per rank at world 4, which took
#: 20 s of wall time at load average 18 on 2 cores (tcp and tls alike, measured).
OP_TIMEOUT = 30.0
#: The most ``op_timeout`` stretches OP_TIMEOUT on a loaded machine.
MAX_STRETCH = 4.0
WORLDS = [2, 3, 4]


def op_timeout() -> float:
    """OP_TIMEOUT times the machine's oversubscription now (1-minute load average per
    core, between 1 and MAX_STRETCH): a round that only waits for CPU time is not a stall,
    and a stall (no progress at all) still fails as a PeerTimeout, at most 120 s on."""
    cores = os.cpu_count() or 1
    return OP_TIMEOUT * min(MAX_STRETCH, max(1.0, os.getloadavg()[0] / cores))


def _check(res: list[dict[str, int]], world: int) -> None:
    assert len(res) == world
    total = sum(sum(r.values()) for r in res)
    assert total >= ROUNDS * OPS * world // 2, res
    # every collective kind was exercised somewhere
    kinds = set().union(*res)
    assert len(kinds) >= 10, kinds


#: ``make test`` runs every mode on both loops, the default path (``auto``) at two world
#: sizes and the others at fewer; ``make stress`` (AIOCOLLECT_STRESS=full) runs every
#: combination with more rounds.
FULL = os.environ.get("AIOCOLLECT_STRESS") == "full"
if FULL:
    ROUNDS = 8
#: Beyond a whole run's operation deadlines (spawn_ranks' bound) at the largest stretch.
pytestmark = pytest.mark.timeout(ROUNDS * OP_TIMEOUT * MAX_STRETCH + 180)
#: World sizes per mode in ``make test`` (every other mode, a transport registered later
#: included: 3).
QUICK_WORLDS = {
    "auto": [2, 4],
    "shm": [2, 4],
    "shm-nopull": [3],
    "tcp": [3],
    "tls": [4],
    "shm-tcpsocket": [4],
}


def _cases(worlds: dict[str, list[int]]) -> dict[str, list[tuple[str, int]]]:
    return {m: [(lp, w) for lp in ("asyncio", "uvloop") for w in ws] for m, ws in worlds.items()}


@pytest.mark.transports(
    argnames="loop, world",
    values=_cases({m.name: WORLDS for m in modes()} if FULL else QUICK_WORLDS),
    default=_cases({"": [3]})[""],
    where="processes",
)
async def test_stress_in_processes(axis: Axis, loop: str, world: int) -> None:
    uvloop = loop == "uvloop"
    names = [m.name for m in modes("processes")]
    seed = 100 * world + names.index(axis.name) * 10 + uvloop
    timeout = op_timeout()
    bound = max(200.0, ROUNDS * timeout + 60)  # a stall in the last round fails inside it
    res = await axis.spawn(
        world,
        targets.stress,
        seed,
        ROUNDS,
        OPS,
        timeout=bound,
        uvloop=uvloop,
        group_timeout=timeout,
    )
    _check(res, world)


#: The in-process worlds on each loop. Over memory links every rank is on the one loop,
#: which only runs their callbacks in the order they were scheduled (asyncio and uvloop
#: alike): ``make test`` runs world 4 on asyncio and world 2 on uvloop, each loop and each
#: world once; ``make stress`` every world on both.
IN_PROCESS = {
    "asyncio": WORLDS if FULL else [4],
    "uvloop": WORLDS if FULL else [2],
}


async def _in_one_process(axis: Axis, world: int) -> None:
    res = await axis.run(world, targets.stress, 7 * world, ROUNDS, OPS, timeout=op_timeout())
    _check(res, world)


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.transports(argnames="world", default=IN_PROCESS["asyncio"], where="in_process")
async def test_stress_in_one_process(axis: Axis, world: int) -> None:
    """Ranks in one process (memory links), on asyncio."""
    await _in_one_process(axis, world)


@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.transports(argnames="world", default=IN_PROCESS["uvloop"], where="in_process")
async def test_stress_in_one_process_on_uvloop(axis: Axis, world: int) -> None:
    """Ranks in one process (memory links), on uvloop."""
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    await _in_one_process(axis, world)


def test_plan_straddles_every_threshold() -> None:
    """The sizes drawn cross the small-op path, the chunk size, the pull threshold and the
    automatic allreduce's switch points (the star's or recursive doubling's last size)."""
    from aiocollect.collectives import select
    from aiocollect.engine.op import SEND_WINDOW
    from tests.support.stress_plan import CHUNK, boundary_sizes, plan

    sizes = boundary_sizes()
    thresholds = (CHUNK, cma.PULL_MIN, select.ALLREDUCE_DOUBLING_MAX, select.ALLREDUCE_HALVING_MAX)
    for threshold in thresholds:
        assert any(s < threshold for s in sizes)
        assert any(s > threshold for s in sizes)
    assert 0 in sizes
    specs = plan(1, 4, OPS, sizes)
    assert specs[-1].nbytes > SEND_WINDOW  # and one operation overflows the send window
