"""Elastic membership at scale (rendezvous/membership.py): the owner records of many
members are read in two store requests, and a process hosting many members is checked
for death once, however many of them (and of this process's ranks) ask."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import uuid
from collections.abc import Sequence

import pytest

from aiocollect.rendezvous import membership
from aiocollect.rendezvous.owner import Owner
from aiocollect.store import MemoryStore

pytestmark = pytest.mark.timeout(30)


class _Counting(MemoryStore):
    """A memory store that counts its check and multi_get requests."""

    requests = 0

    async def check(self, keys: Sequence[str]) -> list[bool]:
        self.requests += 1
        return await super().check(keys)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        self.requests += 1
        return await super().multi_get(keys, timeout=timeout)


async def test_owners_of_many_members_in_two_requests() -> None:
    store = _Counting(f"owners-{uuid.uuid4().hex[:8]}")
    me = Owner.me(b"job")
    keys = {f"m{i}": f"E/g1/a0/member/m{i}" for i in range(300)}
    for i, key in enumerate(keys.values()):
        if i % 3:  # a third have not registered
            await store.set(key, me.pack())
    owners = await membership.owners_at(store, keys)
    assert store.requests == 2
    assert sorted(owners) == sorted(m for i, m in enumerate(keys) if i % 3)
    assert set(owners.values()) == {me}
    assert await membership.owners_at(store, {}) == {}
    await store.close()


def test_dead_among_looks_at_each_process_once() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    mine = Owner.me(b"job")
    dead = dataclasses.replace(mine, pid=gone.pid, start="")
    members = {f"m{i}": (dead if i % 2 else mine) for i in range(200)}
    assert membership.dead_among(members) == [f"m{i}" for i in range(200) if i % 2]
