"""Rank claims and the job nonce on every store backend (memory, file, tcp, redis, torch's):
a second claimant is refused naming the holder, a released claim is taken by the next job,
a killed job's claim and records are taken over and never read, a live group keeps a second
job out, job ids keep two jobs' ranks apart, and a peer of another job is refused at the
handshake without disturbing the group."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import pytest

import aiocollect as ac
from aiocollect._deadline import Deadline
from aiocollect.rendezvous import claims
from aiocollect.rendezvous.handshake import AcceptorHandshake, ConnectorHandshake
from aiocollect.store import FileStore, MemoryStore, RedisStore, Store, TCPStore, TCPStoreServer
from aiocollect.store.tcp import connect_tcp_store
from aiocollect.transport.base import Rejection
from aiocollect.transport.wire import LENGTH_PREFIX

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
HERE = f"pid {os.getpid()} on host {socket.gethostname()}"


@dataclass
class Backend:
    """Store objects sharing one backing store; ``spec`` reaches it from another process."""

    kind: str
    factory: Callable[[], Awaitable[Store]]
    spec: str | None
    made: list[Store] = field(default_factory=list)

    async def make(self) -> Store:
        store = await self.factory()
        self.made.append(store)
        return store


@pytest.fixture(params=["memory", "file", "tcp", "redis", "torch"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    kind = request.param
    server: TCPStoreServer | None = None
    factory: Callable[[], Awaitable[Store]]
    spec: str | None = None
    if kind == "memory":
        tag = uuid.uuid4().hex

        async def factory() -> Store:
            return MemoryStore(f"claims-{tag}")
    elif kind == "file":
        spec = f"file://{tmp_path / 'store'}"

        async def factory() -> Store:
            return FileStore(tmp_path / "store", timeout=30)
    elif kind == "tcp":
        server = TCPStoreServer("127.0.0.1", 0)
        await server.start()
        port = server.port
        spec = f"tcp://127.0.0.1:{port}"

        async def factory() -> Store:
            store = TCPStore("127.0.0.1", port, timeout=30)
            await store.connect()
            return store
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
        db = f"{url.rsplit('/', 1)[0]}/{request.node.nodeid.__hash__() % 15 + 1}"
        spec = db

        async def factory() -> Store:
            return RedisStore(db)
    else:
        dist = pytest.importorskip("torch.distributed")
        from aiocollect.torch.store import TorchStore

        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        spec = f"torch:{master.port}"

        async def factory() -> Store:
            client = dist.TCPStore(
                "127.0.0.1", master.port, is_master=False, wait_for_workers=False
            )
            return TorchStore(client, timeout=30)

    b = Backend(kind, factory, spec)
    try:
        yield b
    finally:
        for store in b.made:
            await store.close()
        if server is not None:
            await server.close()


def _name() -> str:
    return f"claims-{uuid.uuid4().hex[:8]}"


def _deadline() -> Deadline:
    return Deadline.after(20)


async def _form(stores: list[Store], name: str, base: int) -> list[int]:
    """Open a 2-rank group ``name`` on ``stores`` (one per rank), allreduce, close. Rank 1
    starts first (so it would find a stale record of rank 0, if there is one, before the
    new rank 0 overwrites it)."""

    async def rank(r: int) -> int:
        if r == 0:
            await asyncio.sleep(0.2)  # an order to provoke, not a wait for a peer
        async with ac.open_group(
            r, 2, store=stores[r], name=name, transport="tcp", timeout=20
        ) as g:
            buf = np.array([base + r])
            await g.allreduce(buf)
            return int(buf[0])

    return list(await asyncio.gather(rank(0), rank(1)))


async def _claim_in_child_and_kill_it(spec: str, name: str, rank: int) -> str:
    """A child process claims ``rank`` of ``name`` and publishes its record; then it is
    SIGKILLed. Returns its job nonce (hex)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    env.pop(claims.JOB_ID_ENV, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.targets.claim_child",
        spec,
        name,
        str(rank),
        "2",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 40)).decode()
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = await proc.communicate()
    if not line.startswith("claimed"):
        pytest.fail(f"the claiming child failed: {line}{err.decode()}")
    return line.split()[1]


# -- every backend ---------------------------------------------------------------------------


async def test_second_claimant_is_refused_naming_the_holder(backend: Backend) -> None:
    name = _name()
    s1, s2 = await backend.make(), await backend.make()
    first = await claims.claim(s1, name, 0, 2, _deadline())
    with pytest.raises(ac.RendezvousError) as info:
        await claims.claim(s2, name, 0, 2, _deadline())
    assert f"rank 0 of group {name!r} is already claimed by {HERE}" in str(info.value)
    assert "another job on the same store?" in str(info.value)
    second = await claims.claim(s2, name, 1, 2, _deadline())
    assert second.job == first.job
    assert second.epoch == first.epoch
    with pytest.raises(
        ac.RendezvousError, match=f"rank 1 of group '{name}' is already claimed by {HERE}"
    ):
        await claims.claim(s1, name, 1, 2, _deadline())
    await first.release()


async def test_a_released_group_name_is_claimed_by_the_next_job(backend: Backend) -> None:
    name = _name()
    s1, s2 = await backend.make(), await backend.make()
    first = await claims.claim(s1, name, 0, 2, _deadline())
    other = await claims.claim(s2, name, 1, 2, _deadline())
    await first.publish({"rank": 0})
    await other.publish({"rank": 1})
    await first.wait_records(_deadline())
    await first.release()
    k = first.keys
    job_keys = [k.job(first.job, what, r) for r in (0, 1) for what in ("claim", "owner", "here")]
    assert await s1.check(job_keys) == [False] * 6  # the job's keys are cleaned at close
    # A rank 1 that comes first waits for the next rank 0, not the finished job.
    waiting = asyncio.ensure_future(claims.claim(s2, name, 1, 2, _deadline()))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    again = await claims.claim(s1, name, 0, 2, _deadline())
    joined = await waiting
    assert again.job != first.job
    assert again.epoch == first.epoch + 1
    assert joined.job == again.job
    with pytest.raises(ac.RendezvousError, match="belongs to another job"):
        await again.read_record(1)  # rank 1's record of the earlier job is never read
    await again.release()


async def test_a_killed_jobs_claim_is_taken_over_and_its_records_ignored(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    if backend.spec is None:
        pytest.skip("a memory store is not shared with another process")
    name = _name()
    job = await _claim_in_child_and_kill_it(backend.spec, name, 0)
    caplog.set_level(logging.WARNING, "aiocollect")
    stores = [await backend.make(), await backend.make()]
    assert await _form(stores, name, 10) == [21, 21]
    assert any(
        "taking over rank 0" in r.getMessage() and "has exited" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    # ...and the next job on the store after that one closed.
    assert await _form(stores, name, 20) == [41, 41]
    assert job


async def test_a_rank_whose_holder_died_waits_for_the_next_job(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    if backend.spec is None:
        pytest.skip("a memory store is not shared with another process")
    name = _name()
    s1, s2 = await backend.make(), await backend.make()
    first = await claims.claim(s1, name, 0, 2, _deadline())
    await _claim_in_child_and_kill_it(backend.spec, name, 1)  # joins `first`, then dies
    caplog.set_level(logging.WARNING, "aiocollect")
    waiting = asyncio.ensure_future(claims.claim(s2, name, 1, 2, _deadline()))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # not an error: that job is broken, the next one will come
    await first.release()
    nxt = await claims.claim(s1, name, 0, 2, _deadline())
    assert (await waiting).job == nxt.job != first.job
    assert "which has exited; waiting for rank 0 of its job" in caplog.text
    await nxt.release()


async def test_a_live_group_keeps_a_second_job_out(backend: Backend) -> None:
    name = _name()
    stores = [await backend.make() for _ in range(3)]
    g0, g1 = await asyncio.gather(
        *(
            ac.open_group(r, 2, store=stores[r], name=name, transport="tcp", timeout=20)
            for r in (0, 1)
        )
    )
    try:
        for rank in (0, 1):
            with pytest.raises(
                ac.RendezvousError,
                match=f"rank {rank} of group '{name}' is already claimed by {HERE}",
            ):
                await ac.open_group(rank, 2, store=stores[2], name=name, transport="tcp", timeout=5)
        bufs = [np.ones(3), np.ones(3)]
        await asyncio.gather(g0.allreduce(bufs[0]), g1.allreduce(bufs[1]))
        assert bufs[0].tolist() == [2.0] * 3
    finally:
        await asyncio.gather(g0.aclose(), g1.aclose())
    assert await _form(stores[1:], name, 5) == [11, 11]  # the name is free again


async def test_a_claim_without_its_holder_record_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(claims, "OWNER_GRACE", 0.2)
    name, store = _name(), MemoryStore(_name())
    await store.add(f"aiocollect/{name}/claim/0", 1)  # a claimant that died right after
    with pytest.raises(ac.RendezvousError, match="never said who it is"):
        await claims.claim(store, name, 0, 2, _deadline())
    await store.set(f"aiocollect/{name}/owner/0", b"\xc1garbage")
    with pytest.raises(ac.RendezvousError, match="malformed claim record"):
        await claims.claim(store, name, 0, 2, _deadline())


# -- job ids ----------------------------------------------------------------------------------


async def test_a_rank_of_another_job_id_refuses_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    name, store = _name(), MemoryStore(_name())
    monkeypatch.setenv(claims.JOB_ID_ENV, "job-a")
    first = await claims.claim(store, name, 0, 2, _deadline())
    monkeypatch.setenv(claims.JOB_ID_ENV, "job-b")
    with pytest.raises(
        ac.RendezvousError,
        match=r"held by pid \d+ on host .* \(job id "
        r"'job-a'\), not by this rank's job \(job "
        r"id 'job-b'\): another job",
    ):
        await claims.claim(store, name, 1, 2, _deadline())
    monkeypatch.setenv(claims.JOB_ID_ENV, "job-a")
    assert (await claims.claim(store, name, 1, 2, _deadline())).job == first.job
    await first.release()


def test_torchrun_run_id_is_a_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(claims.JOB_ID_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: no id
    assert claims.job_id() == ""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    assert claims.job_id() == "3f2a"
    monkeypatch.setenv(claims.JOB_ID_ENV, "mine")
    assert claims.job_id() == "mine"


async def test_the_embedded_store_belongs_to_its_hosts_job(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _name()
    monkeypatch.setenv(claims.JOB_ID_ENV, "job-b")
    host = await connect_tcp_store("127.0.0.1", 0, is_host=True, timeout=20)
    guest = await connect_tcp_store("127.0.0.1", host.port, is_host=False, timeout=20)
    try:
        # A rank of job B claims rank 0 in job A's store before job A's rank 0 could...
        early = await claims.claim(guest, name, 0, 2, _deadline())
        monkeypatch.setenv(claims.JOB_ID_ENV, "job-a")
        mine = await claims.claim(host, name, 0, 2, _deadline())  # ...the host takes over
        assert mine.epoch == early.epoch + 1
        monkeypatch.setenv(claims.JOB_ID_ENV, "job-b")
        with pytest.raises(ac.RendezvousError, match="another job on the same store"):
            await early.wait_records(_deadline())
        with pytest.raises(
            ac.RendezvousError,
            match=r"is hosted by rank 0 of another job "
            r"\(pid \d+ on host .* \(job id 'job-a'\)",
        ):
            await claims.claim(guest, _name(), 0, 2, _deadline())  # any group name
        monkeypatch.setenv(claims.JOB_ID_ENV, "job-a")
        assert (await claims.claim(guest, name, 1, 2, _deadline())).job == mine.job
    finally:
        await guest.close()
        await host.close()


# -- the peer handshake ----------------------------------------------------------------------


def test_handshake_refuses_a_peer_of_another_job() -> None:
    for secret in (None, b"s3cret"):
        acc = AcceptorHandshake("g", 0, 2, secret, lambda peer: None, job=b"A" * 16)
        con = ConnectorHandshake("g", 1, 0, 2, secret, job=b"B" * 16)
        hello = con.on_message(acc.start()[0])[0][0]
        with pytest.raises(Rejection) as info:
            acc.on_message(hello)
        assert info.value.reply["kind"] == "job"
        assert "belongs to another job" in str(info.value.error)
        with pytest.raises(ac.RendezvousError, match="another job on the same store"):
            con.on_message(info.value.reply)
        same = AcceptorHandshake("g", 0, 2, secret, lambda peer: None, job=b"B" * 16)
        con = ConnectorHandshake("g", 1, 0, 2, secret, job=b"B" * 16)
        replies, peer = same.on_message(con.on_message(same.start()[0])[0][0])
        assert peer == 1
        assert con.on_message(replies[0]) == ([], 0)


async def test_a_peer_of_another_job_is_refused_and_the_group_forms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "aiocollect")
    name, store = _name(), MemoryStore(_name())

    async def rank(r: int) -> float:
        async with ac.open_group(r, 2, store=store, name=name, transport="tcp", timeout=20) as g:
            buf = np.array([1.0 + r])
            await g.allreduce(buf)
            return float(buf[0])

    rank0 = asyncio.ensure_future(rank(0))
    try:
        rec = msgpack.unpackb(await store.get(f"aiocollect/{name}/rank/0", timeout=20))
        reader, writer = await asyncio.open_connection(rec["address"], rec["port"])
        try:
            con = ConnectorHandshake(name, 1, 0, 2, None, job=os.urandom(16))
            (hello,), _ = con.on_message(await _read_message(reader))
            writer.write(_framed(hello))
            reply = await _read_message(reader)
            assert await reader.read() == b""  # then EOF
        finally:
            writer.close()
        assert reply["t"] == "reject", reply
        assert reply["kind"] == "job", reply
        assert list(await asyncio.gather(rank0, rank(1))) == [3.0, 3.0]
        assert "belongs to another job" in caplog.text
    finally:
        rank0.cancel()


async def _read_message(reader: asyncio.StreamReader) -> dict[str, object]:
    (n,) = LENGTH_PREFIX.unpack(await reader.readexactly(LENGTH_PREFIX.size))
    msg: dict[str, object] = msgpack.unpackb(await reader.readexactly(n), raw=False)
    return msg


def _framed(msg: dict[str, object]) -> bytes:
    data = bytes(msgpack.packb(msg, use_bin_type=True))
    return LENGTH_PREFIX.pack(len(data)) + data


async def test_a_refusing_rank_0_waits_for_ranks_of_a_larger_world_size() -> None:
    """Rank 0 started with world size 3 refuses ranks started with 4: before its job ends
    it waits for rank 3 too (which then reads why), not only for the ranks of its own size."""
    name = _name()
    store = MemoryStore(f"claims-{uuid.uuid4().hex}")
    first = await claims.claim(store, name, 0, 3, _deadline())
    await first.publish({})
    for rank in (1, 2):
        await (await claims.claim(store, name, rank, 4, _deadline())).publish({})
    await asyncio.wait_for(first.linger(_deadline()), 1.0)  # its own world: all here
    waiting = asyncio.create_task(first.linger(_deadline(), world_size=4))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()
    await (await claims.claim(store, name, 3, 4, _deadline())).publish({})
    await asyncio.wait_for(waiting, 1.0)  # well within the grace (claims.REFUSAL_GRACE)
    await first.release()


async def test_ranks_of_a_smaller_world_size_do_not_mark_rank_0s_job_ready() -> None:
    """Rank 0 started with world size 5 publishes first, then three ranks started with 4:
    their count reaches 4, but the job is not marked ready (rank 0 would read a record of
    a rank 4 that never comes); they refuse it instead (``_check_first``), naming the
    disagreement."""
    name = _name()
    store = MemoryStore(f"claims-{uuid.uuid4().hex}")
    first = await claims.claim(store, name, 0, 5, _deadline())
    await first.publish({"world_size": 5})
    for rank in (1, 2, 3):
        await (await claims.claim(store, name, rank, 4, _deadline())).publish({"world_size": 4})
    assert await store.check([first.keys.job_wide(first.job, "ready")]) == [False]
    await first.release()
