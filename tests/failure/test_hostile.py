"""Hostile input: nothing from the network is trusted.

(a) the frame-header and handshake parsers, fuzzed, raise only aiocollect's protocol errors;
(b) strangers sending garbage to a rank's listener during rendezvous are closed and logged,
    and the real group still forms;
(c) a peer on an established link sending malformed, oversized, unexpected or truncated
    frames makes the real rank's pending collective fail promptly with a clear error naming
    it, breaks the group cleanly, never crashes the process and never grows memory without
    bound.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import aiocollect as ac
from aiocollect import errors
from aiocollect.engine import liveness
from aiocollect.fingerprint import pack
from aiocollect.rendezvous.handshake import (
    PROTOCOL_VERSION,
    AcceptorHandshake,
    ConnectorHandshake,
)
from aiocollect.store import MemoryStore
from aiocollect.testing import run_ranks
from aiocollect.transport import mailbox
from aiocollect.transport.base import Rejection
from aiocollect.transport.tcp_link import TcpLink
from aiocollect.transport.wire import (
    ABORT,
    CONTROL,
    DATA,
    GOODBYE,
    HEADER,
    HEADER_SIZE,
    KINDS,
    LENGTH_PREFIX,
    MAGIC,
    MAX_CONTROL,
    MAX_HANDSHAKE,
    P2P,
    PING,
    Header,
    pack_header,
    parse_header,
)
from aiocollect.types import Collective
from tests.support.fakepeer import (
    CHUNK,
    GROUP_TIMEOUT,
    PROMPT,
    FakePeer,
    echo_header,
    expect_failure,
    group_is_broken_by,
    header,
    linked,
    u32,
)

pytestmark = pytest.mark.timeout(60)

PROTOCOL_ERRORS = (errors.ProtocolError, errors.AuthenticationError, errors.RendezvousError)

# == (a) fuzzing the parsers ===============================================================

header_fields = st.tuples(
    st.sampled_from([MAGIC, 0, 0xFFFF, MAGIC ^ 1]),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 2**64 - 1),
    st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 4096)),
)


@settings(max_examples=500, deadline=None)
@given(
    raw=st.one_of(
        st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE),
        header_fields.map(lambda f: HEADER.pack(*f)),
    ),
    max_length=st.integers(0, 2**40),
)
def test_parse_header_fuzz(raw: bytes, max_length: int) -> None:
    try:
        h = parse_header(raw, max_length)
    except errors.ProtocolError:
        return
    assert h.kind in KINDS
    assert h.length <= (MAX_CONTROL if h.kind in CONTROL else max_length)
    assert pack_header(h) == raw  # nothing is silently reinterpreted


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
KNOWN_KEYS = ["t", "v", "nonce", "mac", "rank", "peer", "world", "group", "error", "kind"]
random_messages = st.dictionaries(
    st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=8)),
    st.one_of(
        st.sampled_from(
            [
                "hello",
                "challenge",
                "welcome",
                "reject",
                "auth",
                "g",
                PROTOCOL_VERSION,
                0,
                1,
                2,
                b"x" * 32,
            ]
        ),
        values,
    ),
    max_size=10,
)


def _valid_hello(secret: bytes | None, acceptor_nonce: bytes) -> dict[str, Any]:
    hs = ConnectorHandshake("g", 1, 0, 2, secret)
    (hello,), _ = hs.on_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": acceptor_nonce})
    return hello


@st.composite
def mutated_hellos(draw: st.DrawFn) -> dict[str, Any]:
    """A valid hello with some fields replaced by anything, or deleted."""
    hello = _valid_hello(draw(st.sampled_from([None, b"s3cret"])), b"n" * 32)
    for key in draw(st.lists(st.sampled_from(KNOWN_KEYS), max_size=3)):
        if draw(st.booleans()):
            hello.pop(key, None)
        else:
            hello[key] = draw(values)
    return hello


def _check_outcome(call: Callable[[], Any]) -> None:
    """``call`` returns, or raises one of the protocol errors (a Rejection carries one and
    a reply that must itself be sendable)."""
    try:
        replies, peer = call()
    except Rejection as rej:
        rejection = rej
    except PROTOCOL_ERRORS:
        return
    else:
        rejection = None  # type: ignore[assignment]
    if rejection is not None:
        assert isinstance(rejection.error, PROTOCOL_ERRORS), repr(rejection.error)
        msgpack.packb(rejection.reply, use_bin_type=True)
        return
    for reply in replies:
        msgpack.packb(reply, use_bin_type=True)
    assert peer is None or isinstance(peer, int)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=st.one_of(random_messages, mutated_hellos()), secret=st.sampled_from([None, b"s3cret"]))
@example(msg={"t": "hello", "nonce": b"", "mac": b"", "rank": 1, "world": "two"}, secret=None)
@example(msg={"t": "hello", "nonce": b"", "mac": b"", "rank": 1, "world": [2]}, secret=None)
@example(
    msg={"t": "hello", "nonce": b"", "mac": b"", "rank": 1, "world": float("inf")}, secret=None
)
def test_acceptor_handshake_fuzz(msg: dict[str, Any], secret: bytes | None) -> None:
    hs = AcceptorHandshake("g", 0, 2, secret, lambda peer: None)
    _check_outcome(lambda: hs.on_message(msg))


@settings(max_examples=400, deadline=None)
@given(
    msgs=st.lists(
        st.one_of(
            random_messages, st.just({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": b"n" * 32})
        ),
        min_size=1,
        max_size=3,
    ),
    secret=st.sampled_from([None, b"s3cret"]),
)
def test_connector_handshake_fuzz(msgs: list[dict[str, Any]], secret: bytes | None) -> None:
    hs = ConnectorHandshake("g", 1, 0, 2, secret)
    for msg in msgs:
        _check_outcome(lambda m=msg: hs.on_message(m))  # type: ignore[misc]


class _FakeTransport:
    """Just enough of an asyncio transport for feeding bytes to a TcpLink by hand."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("203.0.113.9", 4242) if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.written.extend(bytes(p) for p in parts)

    def close(self) -> None:
        self.closing = True

    abort = close

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closing = True


class _Events:
    """LinkEvents that record everything (a stranger must never reach any of them)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_header(self, link: Any, h: Header) -> None:
        self.seen.append(f"header {h}")

    def on_control(self, link: Any, kind: int, payload: bytes) -> None:
        self.seen.append(f"control {kind}")

    def on_error(self, link: Any, exc: BaseException) -> None:
        self.seen.append(f"error {exc!r}")

    def on_lost(self, link: Any, exc: BaseException | None) -> None:
        self.seen.append("lost")


def _feed_stranger(data: bytes, secret: bytes | None, pieces: int) -> None:
    """Feed ``data`` to a listening TcpLink in ``pieces`` reads, the way the event loop
    does, and keep feeding after the link closed its transport (a TLS transport still
    delivers data it had already decrypted)."""
    events = _Events()
    link = TcpLink(events, CHUNK, AcceptorHandshake("g", 0, 2, secret, lambda peer: None))
    transport = _FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    cuts = (
        sorted(random.Random(len(data)).sample(range(1, len(data)), min(pieces, len(data) - 1)))
        if len(data) > 1
        else []
    )
    for part in np.split(np.frombuffer(data, np.uint8), cuts) if data else []:
        chunk = part.tobytes()
        while chunk:
            buf = link.get_buffer(len(chunk))
            assert len(buf) > 0
            n = min(len(buf), len(chunk))
            buf[:n] = chunk[:n]
            link.buffer_updated(n)  # must never raise
            chunk = chunk[n:]
    if link.ready.done() and link.ready.exception() is None:
        assert secret is None  # only a valid hello (no secret to prove) gets a link
        return
    if link.ready.done():
        exc = link.ready.exception()
        assert isinstance(exc, PROTOCOL_ERRORS), repr(exc)
        assert transport.closing
    assert not events.seen, f"an unauthenticated connection reached the fabric: {events.seen}"


def _framed(msg: Any) -> bytes:
    data = msgpack.packb(msg, use_bin_type=True)
    return u32(len(data)) + data  # type: ignore[no-any-return]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.lists(st.one_of(random_messages, mutated_hellos()), min_size=1, max_size=3).map(
            lambda msgs: b"".join(_framed(m) for m in msgs)
        ),
        st.tuples(mutated_hellos(), st.binary(max_size=200)).map(
            lambda t: _framed(t[0]) + header(ABORT, length=len(t[1])) + t[1]
        ),
    ),
    secret=st.sampled_from([None, b"s3cret"]),
    pieces=st.integers(1, 6),
)
@example(data=u32(0xFFFFFFFF) + b"x" * 8, secret=None, pieces=1)
@example(data=u32(MAX_HANDSHAKE + 1), secret=None, pieces=1)
@example(data=u32(0), secret=None, pieces=1)
@example(data=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", secret=None, pieces=2)
def test_listener_bytes_fuzz(data: bytes, secret: bytes | None, pieces: int) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.sleep(0))  # TcpLink needs a running loop
        loop.run_until_complete(_async_feed(data, secret, pieces))
    finally:
        loop.close()


async def _async_feed(data: bytes, secret: bytes | None, pieces: int) -> None:
    _feed_stranger(data, secret, pieces)


def test_rejected_hello_followed_by_frames_never_reaches_the_fabric() -> None:
    """A stranger that fails authentication and immediately sends an ABORT frame in the
    same packet: after the rejection nothing it sent may be parsed as a frame (asyncio's TLS
    transport delivers already-decrypted bytes even after close())."""
    bad = ConnectorHandshake("g", 1, 0, 2, b"wrong secret")
    (hello,), _ = bad.on_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": b"n" * 32})
    abort = msgpack.packb({"rank": 1, "type": "PeerTimeout", "message": "spoofed"})
    data = _framed(hello) + header(ABORT, length=len(abort)) + abort
    asyncio.run(_async_feed(data, b"s3cret", 1))


# == (b) strangers at a listener during rendezvous ==========================================


async def _listener_address(store: MemoryStore, name: str) -> tuple[str, int]:
    rec = msgpack.unpackb(await store.get(f"aiocollect/{name}/rank/0", timeout=20))
    return rec["address"], rec["port"]


def _hello(
    name: str, rank: int = 1, peer: int = 0, world: int = 2, secret: bytes | None = None
) -> Callable[[dict[str, Any]], bytes]:
    def reply(challenge: dict[str, Any]) -> bytes:
        (msg,), _ = ConnectorHandshake(name, rank, peer, world, secret).on_message(challenge)
        return _framed(msg)

    return reply


STRANGERS: dict[str, bytes | Callable[[str], Callable[[dict[str, Any]], bytes]]] = {
    "bytes that are not msgpack": u32(5) + b"\xc1" * 5,
    "msgpack that is not a map": _framed([1, 2, 3]),
    "a map that is not a hello": _framed({"t": "welcome", "rank": 0}),
    "huge length prefix": u32(0xFFFFFFFF) + b"x" * 64,
    "length just over the limit": u32(MAX_HANDSHAKE + 1),
    "an HTTP request": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "a frame header instead of a hello": header(DATA, length=8) + b"\0" * 8,
    "truncated hello, then EOF": u32(100) + b"\x8a" + b"\0" * 9,
    "hello for another group": lambda name: _hello(name + "-other"),
    "hello with another world size": lambda name: _hello(name, world=3),
    "hello meant for another rank": lambda name: _hello(name, rank=1, peer=2, world=3),
    "hello from a lower rank": lambda name: _hello(name, rank=0, peer=0),
    "hello with an out-of-range rank": lambda name: _hello(name, rank=7),
}


async def _stranger(
    host: str,
    port: int,
    name: str,
    what: bytes | Callable[[str], Callable[[dict[str, Any]], bytes]],
) -> bytes:
    """Connect, send the stranger's bytes and half-close; return everything received
    until the rank closed the connection."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if callable(what):
            (n,) = LENGTH_PREFIX.unpack(await reader.readexactly(4))
            challenge = msgpack.unpackb(await reader.readexactly(n))
            writer.write(what(name)(challenge))
        else:
            writer.write(what)
        writer.write_eof()
        async with asyncio.timeout(PROMPT):
            return await reader.read()  # to EOF: the rank closed it
    except ConnectionResetError:  # closed with our excess bytes unread: also closed
        return b""
    finally:
        writer.close()


async def _two_ranks(
    store: MemoryStore, name: str, before_rank1: Callable[[str, int], Any], **options: Any
) -> list[float]:
    """Start rank 0, run ``before_rank1(host, port)`` against its listener, then start
    rank 1; both ranks allreduce."""

    async def rank(r: int) -> float:
        async with ac.open_group(
            r, 2, store=store, transport="tcp", timeout=GROUP_TIMEOUT, name=name, **options
        ) as g:
            buf = np.full(1000, r + 1.0)
            await g.allreduce(buf)
            return float(buf[0])

    rank0 = asyncio.ensure_future(rank(0))
    try:
        host, port = await _listener_address(store, name)
        await before_rank1(host, port)
        rank1 = asyncio.ensure_future(rank(1))
        return list(await asyncio.gather(rank0, rank1))
    finally:
        rank0.cancel()


@pytest.mark.parametrize("kind", sorted(STRANGERS))
async def test_stranger_at_listener_is_closed_and_logged_group_still_forms(
    kind: str,
    memory_store: MemoryStore,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
    loop_errors: list[Any],
) -> None:
    caplog.set_level(logging.WARNING, "aiocollect")

    async def stranger(host: str, port: int) -> None:
        await _stranger(host, port, unique_name, STRANGERS[kind])  # ends with EOF

    assert await _two_ranks(memory_store, unique_name, stranger) == [3.0, 3.0]
    rejected = [r for r in caplog.records if "rejected an incoming connection" in r.message]
    assert len(rejected) == 1, [r.message for r in caplog.records]


async def test_many_random_strangers_during_rendezvous(
    memory_store: MemoryStore,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
    loop_errors: list[Any],
) -> None:
    caplog.set_level(logging.WARNING, "aiocollect")
    rng = random.Random(1234)
    blobs = [rng.randbytes(rng.randrange(0, 2000)) for _ in range(30)]
    blobs += [u32(rng.randrange(0, 200)) + rng.randbytes(rng.randrange(0, 300)) for _ in range(30)]

    async def strangers(host: str, port: int) -> None:
        await asyncio.gather(*(_stranger(host, port, unique_name, b) for b in blobs))

    assert await _two_ranks(memory_store, unique_name, strangers) == [3.0, 3.0]
    rejected = [r for r in caplog.records if "rejected an incoming connection" in r.message]
    assert len(rejected) == len(blobs)


async def test_silent_stranger_is_closed_once_the_group_formed(
    memory_store: MemoryStore, unique_name: str, loop_errors: list[Any]
) -> None:
    """A connection that starts a handshake and then says nothing must not be kept open
    (holding a file descriptor) after rendezvous: the listener's job is over."""
    held: list[asyncio.StreamReader] = []
    writers: list[asyncio.StreamWriter] = []

    async def silent(host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(u32(100) + b"\x8a")  # a truncated hello, and then nothing
        await writer.drain()
        held.append(reader)
        writers.append(writer)

    try:
        assert await _two_ranks(memory_store, unique_name, silent) == [3.0, 3.0]
        async with asyncio.timeout(PROMPT):
            await held[0].read()  # EOF: the rank closed it
    finally:
        for w in writers:
            w.close()


# == (c) hostile frames on an established link ==============================================


async def _process_still_healthy() -> None:
    """The loop and the library still work after the hostile peer was dealt with."""
    res = await run_ranks(2, _sum_ranks, transport="tcp", timeout=GROUP_TIMEOUT)
    assert res == [1.0, 1.0]


async def _sum_ranks(g: ac.Group) -> float:
    buf = np.array([float(g.rank)])
    await g.allreduce(buf)
    return float(buf[0])


def _garbage_after(h: Header, payload: bytes) -> dict[str, tuple[bytes, type[BaseException], str]]:
    """Hostile bytes, each sent after the real rank's first frame ``h`` was seen, with the
    error the real rank's pending allreduce must raise and a phrase its message contains."""
    abort_junk = b"\xc1not msgpack"
    return {
        "bad magic": (header(magic=0xDEAD), errors.ProtocolError, "magic"),
        "unknown kind": (header(kind=99), errors.ProtocolError, "kind 99"),
        "kind zero": (header(kind=0), errors.ProtocolError, "kind 0"),
        "data frame over chunk_bytes": (
            echo_header(h, length=CHUNK + 1),
            errors.ProtocolError,
            "exceeds",
        ),
        "huge data frame": (echo_header(h, length=2**64 - 1), errors.ProtocolError, "exceeds"),
        "huge p2p frame": (header(P2P, length=2**63), errors.ProtocolError, "exceeds"),
        "huge control frame": (
            header(ABORT, length=MAX_CONTROL + 1),
            errors.ProtocolError,
            "exceeds",
        ),
        "malformed ABORT": (
            header(ABORT, length=len(abort_junk)) + abort_junk,
            errors.ProtocolError,
            "malformed ABORT",
        ),
        "wrong fingerprint": (
            echo_header(h, elems=h.elems + 1) + payload,
            errors.MismatchError,
            "called",
        ),
        "short payload for a posted receive": (
            echo_header(h, length=len(payload) // 2) + payload[: len(payload) // 2],
            errors.MismatchError,
            "bytes",
        ),
    }


GARBAGE = sorted(_garbage_after(Header(DATA, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0), b"").keys())


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", GARBAGE)
async def test_garbage_on_a_live_link(
    kind: str,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allreduce(np.ones(64, np.float32))  # 4 chunks each way; fake sends none
    h, payload = await fake.read_frame()
    data, exc_type, phrase = _garbage_after(h, payload)[kind]
    started = time.monotonic()
    fake.write(data)
    exc = await expect_failure(handle, exc_type, started)
    assert phrase in str(exc), str(exc)
    assert "rank 1" in str(exc), str(exc)  # names the peer
    # The real rank tells the peer why and closes the link (the fake sees EOF).
    async with asyncio.timeout(PROMPT):
        aborts = await fake.aborts()
    assert [a["rank"] for a in aborts] == [0]
    await group_is_broken_by(g, exc)
    await _process_still_healthy()


@pytest.mark.both_loops
@pytest.mark.parametrize(
    "cut", ["inside a header", "inside a payload", "after a header announcing a payload"]
)
async def test_truncated_frame_then_close(
    cut: str,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allreduce(np.ones(64, np.float32))
    h, payload = await fake.read_frame()
    data = {
        "inside a header": echo_header(h)[: HEADER_SIZE // 2],
        "inside a payload": echo_header(h) + payload[: len(payload) // 2],
        "after a header announcing a payload": echo_header(h),
    }[cut]
    fake.write(data)
    await fake.drain()
    started = time.monotonic()
    fake.close()
    exc = await expect_failure(handle, ac.PeerDisconnected, started)
    assert exc.rank == 1  # type: ignore[attr-defined]
    assert "rank 1" in str(exc)
    await group_is_broken_by(g, exc)
    await _process_still_healthy()


async def test_frame_for_a_finished_operation(
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    await g.broadcast(np.ones(64, np.float32), root=0)  # op #0: rank 0 only sends
    old = [await fake.read_frame() for _ in range(4)]
    handle = g.allreduce(np.ones(64, np.float32))  # op #1, pending
    h, payload = old[0]
    started = time.monotonic()
    fake.write(echo_header(h) + payload)  # a replay of op #0
    exc = await expect_failure(handle, errors.ProtocolError, started)
    assert "finished operation #0" in str(exc)
    assert "rank 1" in str(exc)
    await group_is_broken_by(g, exc)


async def test_duplicate_frame_is_rejected(
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    """A legitimate peer never sends the same frame key twice; a repeated early frame must
    not silently replace the first one."""
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allreduce(np.ones(64, np.float32))
    h, payload = await fake.read_frame()
    future = echo_header(h, seq=5) + payload  # an operation rank 0 has not called yet
    started = time.monotonic()
    fake.write(future + future)
    exc = await expect_failure(handle, errors.ProtocolError, started)
    assert "rank 1" in str(exc), str(exc)
    assert "twice" in str(exc), str(exc)
    await group_is_broken_by(g, exc)


def _unmatched_frames(kind: int, payload_len: int, count: int, start: int = 0) -> bytes:
    """Frames with keys nobody will ever post (an unknown sub-group, or unused P2P tags)."""
    body = b"\xab" * payload_len
    return b"".join(
        header(kind, gid=0xBAD, seq=start + i, slot=i, root=-1, length=payload_len) + body
        for i in range(count)
    )


@pytest.mark.both_loops
@pytest.mark.parametrize(
    ("kind", "payload_len"),
    [(DATA, CHUNK), (P2P, CHUNK), (P2P, 0)],
    ids=["data", "p2p", "empty-p2p"],
)
async def test_unmatched_frames_are_staged_up_to_a_bound(
    kind: int,
    payload_len: int,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    monkeypatch: pytest.MonkeyPatch,
    loop_errors: list[Any],
) -> None:
    """Frames that arrive before (or without) a matching receive are staged; a peer that
    keeps sending frames nobody receives hits the staging limit (ProtocolError naming it)
    instead of exhausting memory."""
    limit = 256 * 1024
    monkeypatch.setattr(mailbox, "MAX_EARLY_BYTES", limit)
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allreduce(np.ones(64, np.float32))
    await fake.read_frame()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        started = time.monotonic()
        sent = 0
        batch = 512
        while sent < 64 * limit and not handle.done():  # far beyond the limit
            fake.write(_unmatched_frames(kind, payload_len, batch, start=sent))
            try:
                await fake.drain()
            except ConnectionError:
                break  # the rank closed the link
            sent += batch * (HEADER_SIZE + payload_len)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    exc = await expect_failure(handle, errors.ProtocolError, started)
    assert "rank 1" in str(exc), str(exc)
    assert "staged" in str(exc), str(exc)
    assert peak < 4 * limit + (2 << 20), f"staging grew to {peak} bytes (limit {limit})"
    await group_is_broken_by(g, exc)


async def test_staging_within_the_bound_is_fine(
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    """Early frames below the limit stay receivable: a P2P message sent before its receive
    is posted is delivered when the receive comes."""
    g, fake = await linked(memory_store, unique_name, fake_peer)
    msg = np.arange(40, dtype=np.int32)  # 160 bytes: three chunks of at most 64
    coll, dtype, elems, op, root = pack(Collective.SEND, msg)
    raw = msg.tobytes()
    for c in range(3):
        part = raw[c * CHUNK : (c + 1) * CHUNK]
        fake.write(
            header(
                P2P,
                coll=coll,
                op=op,
                dtype=dtype,
                seq=0,
                slot=7,
                chunk=c,
                root=root,
                elems=elems,
                length=len(part),
            )
            + part
        )
    await fake.drain()
    out = np.zeros(40, np.int32)
    assert await asyncio.wait_for(g.recv(out, 1, tag=7), PROMPT) == 1
    assert (out == msg).all()
    await g.aclose()


@pytest.mark.both_loops
async def test_ping_flood_without_reading_keeps_memory_bounded(
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    monkeypatch: pytest.MonkeyPatch,
    loop_errors: list[Any],
) -> None:
    """A peer that sends PINGs and never reads the PONGs must not make the rank queue
    PONGs without bound; the group keeps working."""
    backlog = 64 * 1024
    monkeypatch.setattr(liveness, "PONG_BACKLOG", backlog)
    fake = fake_peer(memory_store, unique_name, chunk_bytes=CHUNK)
    opening = asyncio.ensure_future(
        ac.open_group(
            0,
            2,
            store=memory_store,
            transport="tcp",
            timeout=GROUP_TIMEOUT,
            name=unique_name,
            chunk_bytes=CHUNK,
        )
    )
    await fake.join(rcvbuf=4096)
    g = await opening
    link = g._fabric.links[1]
    # Small kernel queues, so unread PONGs pile up in user space after a few kilobytes.
    link.transport.get_extra_info("socket").setsockopt(  # type: ignore[attr-defined]
        socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
    )
    ping = header(PING, length=8) + b"12345678"
    msg = np.arange(4, dtype=np.int64)
    coll, dtype, elems, op, root = pack(Collective.SEND, msg)
    worst = 0
    for tag in range(2):  # each round: 1.2 MB of PINGs, then a message that follows them
        fake.write(
            ping * 20_000
            + header(
                P2P,
                coll=coll,
                op=op,
                dtype=dtype,
                slot=tag,
                root=root,
                elems=elems,
                length=msg.nbytes,
            )
            + msg.tobytes()
        )
        out = np.zeros(4, np.int64)
        # The message arrives after every PING before it was handled: still a working link.
        assert await asyncio.wait_for(g.recv(out, 1, tag=tag), GROUP_TIMEOUT) == 1
        assert (out == msg).all()
        worst = max(worst, link.write_buffer_size())
    assert worst <= backlog + 2 * (HEADER_SIZE + 8), f"{worst} bytes of PONGs queued"
    g.abort()
    # The link still flushes its ABORT behind the PONGs the peer never read (a close
    # lingers up to tcp.LINGER): the peer going resets it. Wait for that, or the socket
    # outlives the test's loop (a ResourceWarning when collected).
    await fake.aclose()
    await asyncio.wait_for(link.wait_closed(), GROUP_TIMEOUT)


async def test_goodbye_then_close_fails_only_what_needs_the_peer(
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    """A peer that says GOODBYE and leaves while an operation still needs it: that
    operation fails with GroupBrokenError naming it (not a timeout)."""
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allreduce(np.ones(64, np.float32))
    await fake.read_frame()
    fake.write(header(GOODBYE))
    await fake.drain()
    started = time.monotonic()
    fake.close()
    exc = await expect_failure(handle, ac.GroupBrokenError, started)
    assert "rank 1" in str(exc)
    g.abort()
