"""Rank bodies of the stress suite (module level, so spawned processes import them)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiocollect as ac
from tests.support.stress_plan import boundary_sizes, plan, start


async def stress(g: ac.Group, seed: int, rounds: int, count: int) -> dict[str, Any]:
    """``rounds`` rounds of ``count`` planned operations in flight at once, on the world
    group and two sub-groups; every result checked exactly. Returns counts per kind.
    Sizes straddle the group's chunk size (which a group on shared memory chooses larger
    than the 1 MiB of the others)."""
    half = await g.split(g.rank % 2) if g.world_size >= 3 else None
    rest = await g.split(None if g.rank == 0 else 0) if g.world_size >= 3 else None
    handles = {"world": g, "half": half, "rest": rest}
    sizes = boundary_sizes(g.chunk_bytes)
    done: dict[str, int] = {}
    for rnd in range(rounds):
        specs = plan(seed * 1000 + rnd, g.world_size, count, sizes)
        started = []
        for spec in specs:
            sub = handles[spec.group]
            if sub is None:
                continue
            started.append((spec, *start(sub, seed * 1000 + rnd, spec)))
        results = await asyncio.gather(*(h for _, h, _ in started))
        for (spec, _, check), res in zip(started, results, strict=True):
            try:
                check(res)
            except AssertionError as exc:
                raise AssertionError(f"round {rnd}, {spec}: {exc}") from None
            done[spec.kind] = done.get(spec.kind, 0) + 1
    return done
