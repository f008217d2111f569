"""Authentication (shared secret, HMAC challenge-response) and TLS (mutual certificates).

Ranks that share the secret (or certificates from the group's CA) form a group and run
collectives; a rank that cannot prove the secret is refused with AuthenticationError on the
connecting side and named by the others' RendezvousTimeout; strangers are rejected, logged,
and never disturb the group; the TCP store refuses wrong secrets; a certificate from another
CA cannot join.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import aiocollect as ac
from aiocollect import tls
from aiocollect.rendezvous.handshake import PROTOCOL_VERSION, ConnectorHandshake
from aiocollect.store import MemoryStore, TCPStoreServer, connect_tcp_store
from aiocollect.testing import free_port, run_ranks, spawn_ranks
from aiocollect.testing.certs import Certs
from aiocollect.transport.wire import ABORT, LENGTH_PREFIX
from tests.support.fakepeer import header, u32

pytestmark = pytest.mark.timeout(90)

PROMPT = 5.0  # a refusal is immediate; generous for a noisy machine
RDV_TIMEOUT = 3.0  # the rendezvous deadline of ranks that wait for a refused rank
SECRET = "correct horse battery staple"


async def _allreduce(g: ac.Group) -> float:
    buf = np.full(10_000, g.rank + 1.0)
    await g.allreduce(buf)
    return float(buf[0])


Outcome = tuple[str, Any, float]  # ("ok", value, seconds) or ("error", exception, seconds)


async def _each_rank(
    n: int, options: Callable[[int], dict[str, Any]], *, store: Any, name: str, timeout: float
) -> list[Outcome]:
    """Open the group on every rank with per-rank ``options`` and allreduce; what each
    rank got, and how long it took."""

    async def one(rank: int) -> Outcome:
        t0 = time.monotonic()
        try:
            async with ac.open_group(
                rank, n, store=store, name=name, timeout=timeout, **options(rank)
            ) as g:
                return "ok", await _allreduce(g), time.monotonic() - t0
        except ac.AiocollectError as exc:
            return "error", exc, time.monotonic() - t0

    return list(await asyncio.gather(*(one(r) for r in range(n))))


def _expect_refused(
    out: list[Outcome], refused: list[int], error: type[BaseException], phrase: str
) -> None:
    """Ranks in ``refused`` failed at once with ``error``; the others timed out naming
    them."""
    for rank, (status, value, seconds) in enumerate(out):
        assert status == "error", (rank, status, value)
        if rank in refused:
            assert isinstance(value, error), (rank, repr(value))
            assert phrase in str(value), (rank, str(value))
            assert seconds < PROMPT, (rank, seconds)
        else:
            assert isinstance(value, ac.RendezvousTimeout), (rank, repr(value))
            assert value.missing == refused, (rank, value.missing)
            assert f"{refused}" in str(value), str(value)


# == shared secret ===========================================================================


@pytest.mark.parametrize("secret", [SECRET, SECRET.encode()], ids=["str", "bytes"])
async def test_same_secret_forms_a_group_over_tcp(secret: str | bytes) -> None:
    """Every store connection and every peer link proves the secret; the group works."""
    store = f"tcp://127.0.0.1:{free_port()}"
    res = await run_ranks(3, _allreduce, transport="tcp", store=store, secret=secret, timeout=30)
    assert res == [6.0, 6.0, 6.0]


@pytest.mark.parametrize(
    ("bad", "secret"),
    [(2, "wrong"), (2, None), (0, "wrong")],
    ids=["last-rank-wrong", "last-rank-none", "first-rank-wrong"],
)
async def test_rank_with_wrong_secret_is_refused(
    bad: int,
    secret: str | None,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer links alone (a memory store does no authentication): whoever connects to
    a rank it does not share the secret with gets AuthenticationError at once; the others
    wait and name the ranks they never linked with."""
    monkeypatch.delenv("AIOCOLLECT_SECRET", raising=False)
    caplog.set_level(logging.WARNING, "aiocollect")
    store = MemoryStore(unique_name)
    out = await _each_rank(
        3,
        lambda r: {"transport": "tcp", "secret": secret if r == bad else SECRET},
        store=store,
        name=unique_name,
        timeout=RDV_TIMEOUT,
    )
    # Ranks connect to every lower rank: the refused connections are those that involve
    # the odd rank, and it is always the connecting side that gets AuthenticationError.
    refused = [2] if bad == 2 else [1, 2]
    _expect_refused(out, refused, ac.AuthenticationError, "refused the link")
    # Logged where refused (a refused rank may give up its other connects at once).
    rejected = [r.message for r in caplog.records if "rejected an incoming connection" in r.message]
    assert rejected, rejected
    assert all("secret" in m for m in rejected), rejected


async def _challenge(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = LENGTH_PREFIX.unpack(await reader.readexactly(LENGTH_PREFIX.size))
    msg: dict[str, Any] = msgpack.unpackb(await reader.readexactly(n))
    return msg


def _framed(msg: dict[str, Any]) -> bytes:
    data = msgpack.packb(msg, use_bin_type=True)
    return u32(len(data)) + data  # type: ignore[no-any-return]


HelloFactory = Callable[[str, dict[str, Any]], dict[str, Any]]


def _wrong_secret_hello(name: str, challenge: dict[str, Any]) -> dict[str, Any]:
    (hello,), _ = ConnectorHandshake(name, 1, 0, 2, b"guessed").on_message(challenge)
    return hello


def _replayed_hello(name: str, challenge: dict[str, Any]) -> dict[str, Any]:
    """A hello with the right secret, but proved for another connection's nonce (what a
    stranger replaying a captured hello sends)."""
    other = dict(challenge, nonce=b"\x01" * 32)
    (hello,), _ = ConnectorHandshake(name, 1, 0, 2, SECRET.encode()).on_message(other)
    return hello


def _no_proof_hello(name: str, challenge: dict[str, Any]) -> dict[str, Any]:
    (hello,), _ = ConnectorHandshake(name, 1, 0, 2, None).on_message(challenge)
    return hello


@pytest.mark.parametrize(
    "make_hello",
    [_wrong_secret_hello, _replayed_hello, _no_proof_hello],
    ids=["wrong-secret", "replayed", "no-proof"],
)
async def test_stranger_with_a_bad_hmac_is_rejected_and_the_group_forms(
    make_hello: HelloFactory,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
    loop_errors: list[Any],
) -> None:
    """A stranger claiming to be rank 1 reaches rank 0's listener before the real rank 1:
    it gets an authentication reject and EOF, rank 0 logs it, and the real rank 1 joins."""
    caplog.set_level(logging.WARNING, "aiocollect")
    store = MemoryStore(unique_name)

    async def rank(r: int) -> float:
        async with ac.open_group(
            r, 2, store=store, transport="tcp", timeout=30, name=unique_name, secret=SECRET
        ) as g:
            return await _allreduce(g)

    rank0 = asyncio.ensure_future(rank(0))
    try:
        rec = msgpack.unpackb(await store.get(f"aiocollect/{unique_name}/rank/0", timeout=30))
        reader, writer = await asyncio.open_connection(rec["address"], rec["port"])
        try:
            writer.write(_framed(make_hello(unique_name, await _challenge(reader))))
            async with asyncio.timeout(PROMPT):
                reply = await _challenge(reader)
                assert await reader.read() == b""  # then EOF
        finally:
            writer.close()
        assert reply["t"] == "reject", reply
        assert reply["kind"] == "auth", reply
        assert await asyncio.gather(rank0, rank(1)) == [3.0, 3.0]
    finally:
        rank0.cancel()
    rejected = [r for r in caplog.records if "rejected an incoming connection" in r.message]
    assert len(rejected) == 1
    assert "secret" in rejected[0].message


# == the TCP store ===========================================================================


@pytest.mark.parametrize("client_secret", ["wrong", None], ids=["wrong", "none"])
async def test_tcp_store_rejects_wrong_secrets(client_secret: str | None) -> None:
    async with TCPStoreServer("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(ac.AuthenticationError):
            await connect_tcp_store(
                "127.0.0.1", server.port, is_host=False, secret=client_secret, timeout=10
            )
        good = await connect_tcp_store(
            "127.0.0.1", server.port, is_host=False, secret=SECRET, timeout=10
        )
        await good.set("k", b"v")
        assert await good.get("k") == b"v"
        await good.close()


@pytest.mark.one_loop  # waits out a timeout; nothing loop-specific
async def test_rank_with_wrong_secret_cannot_reach_the_group_store(unique_name: str) -> None:
    """Through open_group: the store hosted by rank 0 refuses rank 1's wrong secret before
    any rendezvous record is read; rank 0 then names rank 1 as missing."""
    store = f"tcp://127.0.0.1:{free_port()}"
    out = await _each_rank(
        2,
        lambda r: {"transport": "tcp", "secret": SECRET if r == 0 else "wrong"},
        store=store,
        name=unique_name,
        timeout=RDV_TIMEOUT,
    )
    _expect_refused(out, [1], ac.AuthenticationError, "store")


# == TLS =====================================================================================


async def _tls_details(g: ac.Group) -> list[tuple[str, bool]]:
    """(TLS version, peer certificate present) of every link: proof the links are TLS."""
    out = []
    for link in g._fabric.links.values():
        ssl_object = link.transport.get_extra_info("ssl_object")  # type: ignore[attr-defined]
        assert ssl_object is not None, "a link of a TLS group is not encrypted"
        out.append((ssl_object.version(), bool(ssl_object.getpeercert())))
    return out


async def _tls_collectives(g: ac.Group) -> dict[str, Any]:
    buf = np.arange(300_000, dtype=np.float32)  # several chunks, the ring path
    await g.allreduce(buf)
    words = await g.allgather_object(f"rank {g.rank}")
    return {
        "sum_ok": bool((buf == np.arange(300_000) * g.world_size).all()),
        "words": words,
        "links": await _tls_details(g),
    }


def _check_tls_results(res: list[dict[str, Any]], n: int) -> None:
    for r in res:
        assert r["sum_ok"]
        assert r["words"] == [f"rank {i}" for i in range(n)]
        assert len(r["links"]) == n - 1
        assert all(version.startswith("TLS") and peer_cert for version, peer_cert in r["links"])


@pytest.mark.parametrize("secret", [None, SECRET], ids=["certificates", "certificates+secret"])
async def test_tls_in_process(certs: Certs, secret: str | None, unique_name: str) -> None:
    n = 3
    store = MemoryStore(unique_name)

    async def one(rank: int) -> dict[str, Any]:
        async with ac.open_group(
            rank,
            n,
            store=store,
            transport="tls",
            name=unique_name,
            ssl=certs.config(rank),
            secret=secret,
            timeout=30,
        ) as g:
            return await _tls_collectives(g)

    _check_tls_results(list(await asyncio.gather(*(one(r) for r in range(n)))), n)


async def tls_target(g: ac.Group, certs: Certs) -> dict[str, Any]:
    """Spawned rank body: open a TLS group (contexts cannot be pickled, so each process
    builds its own from the certificate files) on the job's store and run collectives."""
    async with ac.open_group(
        g.rank,
        g.world_size,
        store=g.store,
        transport="tls",
        ssl=certs.config(g.rank),
        name="tls",
        timeout=60,
    ) as t:
        return await _tls_collectives(t)


async def test_tls_in_separate_processes(certs: Certs) -> None:
    n = 3
    res = await spawn_ranks(n, tls_target, certs, timeout=80)
    _check_tls_results(res, n)


@pytest.fixture
def both_cas(certs: Certs, tmp_path: Path) -> str:
    """A CA bundle that trusts the main CA and the other one."""
    bundle = tmp_path / "both.pem"
    bundle.write_text(Path(certs.ca).read_text() + Path(certs.other_ca).read_text())
    return str(bundle)


@pytest.mark.parametrize("trust", ["other CA only", "both CAs"])
async def test_certificate_from_another_ca_cannot_join(
    certs: Certs, trust: str, unique_name: str, both_cas: str
) -> None:
    """Rank 2 holds a certificate from another CA. Trusting only that CA, it rejects the
    others' certificates; trusting both, the others reject its certificate. Either way its
    rendezvous fails at once with a clear error and the others time out naming it."""
    cafile = certs.other_ca if trust == "other CA only" else both_cas
    store = MemoryStore(unique_name)

    def options(rank: int) -> dict[str, Any]:
        ssl = tls.contexts(*certs.stranger, cafile) if rank == 2 else certs.config(rank)
        return {"transport": "tls", "ssl": ssl}

    out = await _each_rank(3, options, store=store, name=unique_name, timeout=RDV_TIMEOUT)
    phrase = "certificate" if trust == "other CA only" else "rejected this rank's TLS"
    _expect_refused(out, [2], ac.RendezvousError, phrase)
    assert "rank 2 could not" in str(out[2][1])


async def test_rejected_tls_stranger_cannot_inject_frames(
    certs: Certs, unique_name: str, loop_errors: list[Any]
) -> None:
    """A stranger holding a valid certificate but not the secret sends its hello and an
    ABORT frame in one write. The hello is rejected; the ABORT, which the TLS transport
    still delivers after the rejection, must not be read as a frame of the group."""
    store = MemoryStore(unique_name)

    async def rank(r: int) -> float:
        async with ac.open_group(
            r,
            2,
            store=store,
            transport="tls",
            timeout=30,
            name=unique_name,
            secret=SECRET,
            ssl=certs.config(r),
        ) as g:
            return await _allreduce(g)

    rank0 = asyncio.ensure_future(rank(0))
    try:
        rec = msgpack.unpackb(await store.get(f"aiocollect/{unique_name}/rank/0", timeout=30))
        reader, writer = await asyncio.open_connection(
            rec["address"],
            rec["port"],
            ssl=certs.config(1).client,
            server_hostname=rec["address"],
        )
        try:
            challenge = await _challenge(reader)
            assert challenge["v"] == PROTOCOL_VERSION
            # (An empty ABORT: asyncio hands over one more read after close(), so a frame
            # that fits in it is complete; as a frame of the group it would break it.)
            writer.write(
                _framed(_wrong_secret_hello(unique_name, challenge)) + header(ABORT, length=0)
            )
            async with asyncio.timeout(PROMPT):
                assert (await _challenge(reader))["t"] == "reject"
        finally:
            writer.close()
        assert await asyncio.gather(rank0, rank(1)) == [3.0, 3.0]
    finally:
        rank0.cancel()
