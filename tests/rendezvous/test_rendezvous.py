"""Forming groups: missing ranks are named, inconsistent settings are refused, groups on one
store stay apart by name, and every environment source of rank/size/store works."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.rendezvous.handshake import AcceptorHandshake, ConnectorHandshake
from aiocollect.transport.base import Rejection

pytestmark = pytest.mark.timeout(60)
_ids = itertools.count()


def _store() -> str:
    return f"memory://rdv-{next(_ids)}"


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_missing_ranks_are_named(transport: str) -> None:
    store = _store()
    opens = [ac.open_group(r, 4, store=store, transport=transport, timeout=1.0) for r in (0, 2)]
    results = await asyncio.gather(*opens, return_exceptions=True)
    for res in results:
        assert isinstance(res, ac.RendezvousTimeout), res
        assert isinstance(res, TimeoutError)
        assert res.missing == [1, 3]
        assert "[1, 3]" in str(res)


async def test_world_size_disagreement_is_refused() -> None:
    store = _store()
    res = await asyncio.gather(
        ac.open_group(0, 2, store=store, timeout=2.0),
        ac.open_group(1, 3, store=store, timeout=2.0),
        return_exceptions=True,
    )
    assert any(isinstance(r, ac.RendezvousError) and "world_size" in str(r) for r in res), res
    for r in res:
        if isinstance(r, ac.Group):
            r.abort()


async def test_chunk_size_disagreement_is_refused() -> None:
    store = _store()
    res = await asyncio.gather(
        ac.open_group(0, 2, store=store, timeout=2.0, chunk_bytes=64),
        ac.open_group(1, 2, store=store, timeout=2.0, chunk_bytes=128),
        return_exceptions=True,
    )
    assert all(isinstance(r, ac.RendezvousError) and "chunk_bytes" in str(r) for r in res), res


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_two_groups_on_one_store_by_name(transport: str) -> None:
    store = _store()

    async def rank(r: int, name: str, value: float) -> float:
        async with ac.open_group(r, 2, store=store, name=name, transport=transport) as g:
            buf = np.array([value + r])
            await g.allreduce(buf)
            return float(buf[0])

    res = await asyncio.gather(
        rank(0, "a", 10), rank(1, "a", 10), rank(0, "b", 100), rank(1, "b", 100)
    )
    assert res == [21.0, 21.0, 201.0, 201.0]


def test_handshake_rejects_wrong_group_and_rank() -> None:
    acc = AcceptorHandshake("g", 0, 3, None, lambda peer: None)
    challenge = acc.start()[0]
    wrong = ConnectorHandshake("other", 1, 0, 3, None)
    hello = wrong.on_message(challenge)[0][0]
    with pytest.raises(Rejection, match="group 'other' does not match this group 'g'"):
        acc.on_message(hello)
    acc2 = AcceptorHandshake("g", 0, 3, None, lambda peer: None)
    right = ConnectorHandshake("g", 2, 0, 3, None)
    hello = right.on_message(acc2.start()[0])[0][0]
    replies, peer = acc2.on_message(hello)
    assert peer == 2
    assert right.on_message(replies[0]) == ([], 0)


def test_handshake_secret_mismatch() -> None:
    acc = AcceptorHandshake("g", 0, 2, b"right", lambda peer: None)
    con = ConnectorHandshake("g", 1, 0, 2, b"wrong")
    hello = con.on_message(acc.start()[0])[0][0]
    with pytest.raises(Rejection, match="failed to prove the shared secret") as info:
        acc.on_message(hello)
    reply = info.value.reply
    with pytest.raises(ac.AuthenticationError):
        con.on_message(reply)


async def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    monkeypatch.setenv("AIOCOLLECT_STORE", store)
    monkeypatch.setenv("AIOCOLLECT_WORLD_SIZE", "1")
    monkeypatch.setenv("AIOCOLLECT_RANK", "0")
    async with ac.open_group() as g:
        assert (g.rank, g.world_size) == (0, 1)
        assert (await g.allreduce(np.ones(2))).tolist() == [1.0, 1.0]
