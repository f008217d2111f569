"""The stress suite: 32+ seeded random operations in flight at once, on every transport and
mode, on asyncio and uvloop, at world sizes 2-4, with sizes straddling every threshold, and
every result compared exactly with numpy (tests/stress/plan.py).

Modes: ``memory`` (ranks in one process, on both loops), and in real processes ``tcp``,
``tls``, ``shm`` with single-copy pulls, ``shm`` without them (``AIOCOLLECT_SHM_PULL=0``)
and ``auto`` (the default a same-host user gets: shared memory with pulls where the kernel
allows it).

A stall shows as a PeerTimeout after ``OP_TIMEOUT`` seconds, well inside the test's bound.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.transport import cma
from tests.stress import targets

ROUNDS = 2
OPS = 32
OP_TIMEOUT = 30.0
PROCESS_MODES = ["tcp", "tls", "shm", "shm-nopull", "auto"]
WORLDS = [2, 3, 4]

pytestmark = pytest.mark.timeout(240)


def _check(res: list[dict[str, int]], world: int) -> None:
    assert len(res) == world
    total = sum(sum(r.values()) for r in res)
    assert total >= ROUNDS * OPS * world // 2, res
    # every collective kind was exercised somewhere
    kinds = set().union(*res)
    assert len(kinds) >= 10, kinds


async def tls_stress(g: Any, certs: Any, seed: int) -> dict[str, int]:
    """Open a TLS group beside the spawned one (certificates cannot be pickled as
    contexts) and stress it."""
    import aiocollect as ac
    from aiocollect import tls

    cert, key = certs.ranks[g.rank]
    async with ac.open_group(
        g.rank,
        g.world_size,
        store=g.store,
        transport="tls",
        ssl=tls.contexts(cert, key, certs.ca),
        name="stress-tls",
        timeout=OP_TIMEOUT,
    ) as t:
        return await targets.stress(t, seed, ROUNDS, OPS)


#: ``make test`` runs every mode on both loops, the default path (``auto``) at every world
#: size and the others at fewer; ``make stress`` (AIOCOLLECT_STRESS=full) runs every
#: combination with more rounds.
FULL = os.environ.get("AIOCOLLECT_STRESS") == "full"
if FULL:
    ROUNDS = 8
QUICK_WORLDS = {"auto": WORLDS, "shm": [2, 4], "shm-nopull": [3], "tcp": [3], "tls": [4]}
CASES = [
    (mode, uv, world)
    for mode in PROCESS_MODES
    for uv in (False, True)
    for world in (WORLDS if FULL else QUICK_WORLDS[mode])
]


@pytest.mark.parametrize(
    ("mode", "uvloop", "world"),
    CASES,
    ids=[f"{m}-{'uvloop' if u else 'asyncio'}-{w}" for m, u, w in CASES],
)
async def test_stress_in_processes(
    mode: str, uvloop: bool, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = 100 * world + PROCESS_MODES.index(mode) * 10 + uvloop
    options: dict[str, Any] = {"uvloop": uvloop, "group_timeout": OP_TIMEOUT}
    if mode == "shm-nopull":
        monkeypatch.setenv(cma.ENV, "0")
    if mode in ("shm", "shm-nopull", "auto"):
        options["transport"] = "shm" if mode.startswith("shm") else "auto"
    if mode == "tls":
        from tests.failure.conftest import make_certs

        certs = make_certs(tmp_path, world)
        res = await spawn_ranks(world, tls_stress, certs, seed, timeout=200, **options)
    else:
        res = await spawn_ranks(world, targets.stress, seed, ROUNDS, OPS, timeout=200, **options)
    _check(res, world)


@pytest.mark.parametrize("world", WORLDS)
async def test_stress_memory(world: int) -> None:
    """Ranks in one process (memory links); run on asyncio and uvloop (tests/conftest.py)."""
    res = await run_ranks(world, targets.stress, 7 * world, ROUNDS, OPS, timeout=OP_TIMEOUT)
    _check(res, world)


def test_plan_straddles_every_threshold() -> None:
    """The sizes drawn cross the small-op path, the chunk size and the pull threshold."""
    from aiocollect.engine.op import SEND_WINDOW
    from tests.stress.plan import CHUNK, boundary_sizes, plan

    sizes = boundary_sizes()
    for threshold in (CHUNK, cma.PULL_MIN):
        assert any(s < threshold for s in sizes)
        assert any(s > threshold for s in sizes)
    assert 0 in sizes
    specs = plan(1, 4, OPS, sizes)
    assert specs[-1].nbytes > SEND_WINDOW  # and one operation overflows the send window
