"""The pull allreduce (collectives/pull.py): the default for allreduces past
``select.SEGMENT_MAX`` where the rendezvous records say every rank reads the others'
memory (the default transport on one host). Real processes over the default transport on
both loops, several operations in flight, sizes on both sides of the switch; links whose
pull check failed get pushes instead; a forced other algorithm is a mismatch; a token
frame that lies breaks the group, not the process. (SIGKILL and SIGSTOP in the middle of
it: tests/shm/test_failure_shm.py and tests/failure/test_kill_stop.py.)"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.collectives import registry, select
from aiocollect.rendezvous import chunking
from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.transport import cma, host, onesided
from tests.support.targets import pull as pull_targets

pytestmark = pytest.mark.timeout(120)


def test_the_automatic_choice() -> None:
    choose = registry.ALLREDUCE.choose
    for n in (2, 3, 4, 8):
        assert choose(None, select.SEGMENT_MAX + 4, n, pulls=True).name == "pull"
        assert choose(None, 64 << 20, n, pulls=True).name == "pull"
        assert choose(None, select.SEGMENT_MIN - 4, n, pulls=True).name == "ring"
        assert choose(None, 64 << 20, n).name == "ring"  # no pulls predicted: the ring
    assert choose(None, 16, 4, pulls=True).name == "star"
    gather, scatter = registry.ALLGATHER.choose, registry.REDUCE_SCATTER.choose
    for n in (3, 4, 8):
        assert gather(None, select.PULL_MIN, n, pulls=True).name == "pull"
        assert scatter(None, select.PULL_MIN, n, pulls=True).name == "pull"
        assert gather(None, select.PULL_MIN - 8 * n, n, pulls=True).name == "ring"
        assert gather(None, 64 << 20, n).name == "ring"
    assert gather(None, select.PULL_MIN, 2, pulls=True).name == "ring"  # two ranks: later
    assert gather(None, select.TWO_RANK_PULL_MIN, 2, pulls=True).name == "pull"
    assert scatter(None, select.PULL_MIN, 2, pulls=True).name == "pull"
    assert gather(None, 16 * select.DIRECT_BLOCK_MAX, 16, pulls=True).name == "direct"
    assert gather(None, 256 * select.DIRECT_BLOCK_MAX, 256, pulls=True).name == "bruck"
    cast = registry.BROADCAST.choose
    assert cast(None, select.PULL_BROADCAST_MIN, 4, pulls=True).name == "pull"
    assert cast(None, select.PULL_BROADCAST_MIN - 1, 4, pulls=True).name == "pipeline"
    assert cast(None, select.PULL_BROADCAST_MIN, 2, pulls=True).name == "binomial"
    assert cast(None, select.TWO_RANK_PULL_MIN, 2, pulls=True).name == "pull"
    assert cast(None, 64 << 20, 4).name == "pipeline"


def test_the_records_predict_pulls() -> None:
    rec = {**host.identity(), **onesided.fields(onesided.HOST)}
    assert chunking.all_pull({0: rec, 1: rec, 2: rec})
    assert not chunking.all_pull({0: rec})
    assert not chunking.all_pull({0: rec, 1: {**rec, **onesided.fields(None)}})
    assert not chunking.all_pull({0: rec, 1: {**rec, "pull": True}})
    assert not chunking.all_pull({0: rec, 1: {**rec, "hostname": "elsewhere"}})
    assert not chunking.all_pull({0: rec, 1: {**rec, "boot_id": "another-boot"}})
    anywhere = {**rec, **onesided.fields(onesided.ANY), "hostname": "elsewhere"}
    assert not chunking.all_pull({0: rec, 1: anywhere})  # rank 0 reads its host only
    assert chunking.all_pull({0: anywhere, 1: {**anywhere, "hostname": "another"}})


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("n", [2, 4])
async def test_in_processes_over_the_default_transport(n: int, uvloop: bool) -> None:
    """auto is shared memory with pulls here: the records predict pulls, the automatic
    choice takes the segment allreduce up to SEGMENT_MAX and the pull past it; 2 SUM and 2
    AVG allreduces in flight at each size, checked, identical on every rank."""
    res = await spawn_ranks(n, pull_targets.pull_mix, 2, timeout=100, uvloop=uvloop)
    assert [r["pulls"] for r in res] == [True] * n
    assert res[0]["chosen"] == ["segment", "pull"]
    assert len({r["digest"] for r in res}) == 1


@pytest.mark.parametrize("n", [2, 4])
async def test_allgather_and_reduce_scatter_in_processes(n: int) -> None:
    """The same for allgather, reduce_scatter and broadcast (uvloop), 2 of each in
    flight."""
    res = await spawn_ranks(n, pull_targets.gather_scatter_mix, 2, timeout=100, uvloop=True)
    small, at = select.PULL_MIN - 4 * n, select.PULL_MIN
    big = 16 << 20
    want = {
        f"allgather {small}": "ring",
        f"reduce_scatter {small}": "ring",
        f"allgather {at}": "pull" if n > 2 else "ring",
        f"reduce_scatter {at}": "pull",
        f"allgather {big}": "pull",
        f"reduce_scatter {big}": "pull",
        f"allgather {big + 4 * n}": "pull",
        f"reduce_scatter {big + 4 * n}": "pull",
        f"broadcast {small}": "binomial" if n == 2 else "pipeline",
        f"broadcast {at}": "binomial" if n == 2 else "pipeline",
        f"broadcast {big}": "pull",
        f"broadcast {big + 4 * n}": "pull",
    }
    assert res == [want] * n


async def test_over_tcp_no_pulls_are_predicted() -> None:
    res = await spawn_ranks(3, pull_targets.pull_mix, 2, timeout=100, transport="tcp")
    assert [r["pulls"] for r in res] == [False] * 3
    assert res[0]["chosen"] == ["ring"] * 2
    assert len({r["digest"] for r in res}) == 1


async def _reads_and_sums(g: ac.Group) -> tuple[list[bool], int]:
    """Which peers this rank reads (its links' pull check), then pull allreduces and
    default allgathers and reduce_scatters at and above PULL_MIN (the records still
    predict pulls: the pull algorithms) and pull broadcasts from every root, exact."""
    reads = [bool(g._fabric.links[p].caps.pull_min) for p in range(g.world_size) if p != g.rank]
    count = select.PULL_MIN // 4
    done = 0
    for c in (count, 2 * count + 3):
        bufs = [np.full(c, g.rank + i, np.float32) for i in range(3)]
        await asyncio.gather(*[g.allreduce(b, algorithm="pull") for b in bufs])
        for i, b in enumerate(bufs):
            want = sum(r + i for r in range(g.world_size))
            assert (b == want).all(), (c, i, b[:4])
            done += 1
    n = g.world_size
    for c in (count, 2 * count + 3):  # allgather, reduce_scatter, broadcast (blocks of c)
        assert g.chosen_algorithm("allgather", 4 * c * n) == "pull"
        assert g.chosen_algorithm("reduce_scatter", 4 * c * n) == "pull"
        out = await g.allgather(np.full(c, g.rank, np.float32))
        assert all((out[q] == q).all() for q in range(n))
        dest = await g.reduce_scatter(np.repeat(np.arange(n, dtype=np.float32) + g.rank, c))
        assert (dest == sum(g.rank + q for q in range(n))).all(), dest[:4]
        for root in range(n):
            cast = np.full(c * n, g.rank, np.float32)
            await g.broadcast(cast, root=root, algorithm="pull")
            assert (cast == root).all(), (root, cast[:4])
        done += 2
    return reads, done


@pytest.mark.parametrize("failing", ["every", "alternate"])
async def test_links_whose_pull_check_failed_get_pushes(
    failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull check that fails (a ptrace policy, injected here) on every link or on every
    other one: the records still predict pulls, so the pull allreduce runs, and a rank
    that cannot be read pushes its data to that peer instead. Same results."""
    calls = itertools.count()

    def probe(*_: Any) -> str | None:
        if failing == "every" or next(calls) % 2:
            return "denied by policy (injected)"
        return None

    monkeypatch.setattr(cma, "probe", probe)
    res = await run_ranks(3, _reads_and_sums, transport="shm")
    reads = [r for rank_reads, _ in res for r in rank_reads]
    if failing == "every":
        assert not any(reads)
    else:
        assert any(reads), reads  # both kinds of link in one group
        assert not all(reads), reads
    assert [done for _, done in res] == [10] * 3


async def test_the_default_against_a_forced_ring_is_a_mismatch() -> None:
    async def body(g: ac.Group) -> str:
        alg = "ring" if g.rank == 1 else None
        try:
            await g.allreduce(np.ones(select.SEGMENT_MAX // 4 + 1, np.float32), algorithm=alg)
        except ac.MismatchError as exc:
            return str(exc)
        except ac.GroupBrokenError as exc:
            cause = exc.__cause__
            return str(cause) if isinstance(cause, ac.MismatchError) else repr(exc)
        return "no error"

    for message in await run_ranks(3, body, transport="shm", timeout=10):
        assert "allreduce[pull]" in message, message
        assert "allreduce[ring]" in message, message


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("address", "does not back"),
        ("range", "outside the exposed"),
        ("token", "bad one-sided token"),
        ("length", "malformed token frame"),
    ],
)
async def test_a_lying_token_frame_breaks_the_group_not_the_process(fault: str, why: str) -> None:
    """Rank 1 sends a token naming memory it does not have, one shorter than its buffer,
    a malformed token, or the wrong buffer length: the ranks that read it fail with
    ProtocolError naming it, every other rank gets the group's failure, and every process
    returns normally."""
    res = await spawn_ranks(3, pull_targets.bad_record, fault, timeout=60)
    assert all(r != "no error" for r in res), res
    assert any("ProtocolError" in r and why in r and "rank 1" in r for r in res), res


async def test_chosen_algorithm_names_what_runs() -> None:
    async def body(g: ac.Group) -> list[str]:
        with pytest.raises(ac.UsageError, match="no collective 'sendrecv'"):
            g.chosen_algorithm("sendrecv", 4)
        return [
            g.chosen_algorithm("allreduce", select.SEGMENT_MAX + 4),
            g.chosen_algorithm("allreduce", select.SEGMENT_MIN - 4),
            g.chosen_algorithm("barrier", 0),
        ]

    assert await run_ranks(3, body, transport="shm") == [["pull", "ring", "star"]] * 3
    assert await run_ranks(3, body, transport="tcp") == [["ring", "ring", "star"]] * 3


async def test_subgroups_read_too() -> None:
    """A split of a group on one host reads as well (its ranks' records predicted it), with
    the whole group's operation in flight beside the halves'."""
    res = await spawn_ranks(4, pull_targets.subgroups, timeout=60)
    assert res == [[0, 2], [1, 3], [0, 2], [1, 3]]


async def test_links_that_cannot_read_say_so() -> None:
    """``Link.read_exposed`` and ``Link.expose`` on a link without one-sided reads
    (in-process memory, TCP) are InternalErrors, never silent no-ops; the pull algorithms
    never call them there."""

    async def body(g: ac.Group) -> str:
        link = g._fabric.links[1 - g.rank]
        assert not link.caps.reads
        assert not link.caps.exposes
        with pytest.raises(ac.InternalError, match="cannot read its peer's memory"):
            link.read_exposed(bytes(16), 0, memoryview(bytearray(8)))
        with pytest.raises(ac.InternalError, match="cannot expose memory"):
            link.expose(memoryview(bytearray(8)))
        link.unexpose(bytes(16))  # (nothing exposed: ignored)
        return g.chosen_algorithm("allreduce", 64 << 20)

    assert await run_ranks(2, body) == ["ring", "ring"]
    assert await run_ranks(2, body, transport="tcp") == ["ring", "ring"]


async def test_a_peer_killed_after_its_token_is_a_disconnect_not_a_protocol_error() -> None:
    """Rank 2 dies right after sending its token frames, and the survivors look at its
    token only after its link closed (before the group has blamed the loss): each survivor
    reports PeerDisconnected naming rank 2 (its link's loss), and later calls fail from
    it, never a ProtocolError about a token it "cannot read"."""
    outcomes = await spawn_ranks(3, pull_targets.dies_after_its_tokens, timeout=60).outcomes()
    assert outcomes[2][0] == "died", outcomes
    for rank in (0, 1):
        assert outcomes[rank][0] == "ok", outcomes
        res = outcomes[rank][1]
        assert res["error"] == "PeerDisconnected", res
        assert "rank 2" in res["message"], res
        assert res["later"] == "GroupBrokenError", res
