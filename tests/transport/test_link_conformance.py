"""Every registered transport's links pass the Link conformance suite
(aiocollect.testing.link_suite), made through the transport's own listeners as rendezvous
makes them, over real connections and real segments: each name of the registry (shared
memory without single-copy pulls, and once more with them as ``shm-pull``; ``shm`` and
``auto`` over their default Unix socket and once more over TCP loopback as
``shm-tcpsocket`` and ``auto-tcpsocket``), and the example transports of
tests/transport/example_transport.py and example_onesided.py, registered here only. Every
one whose links declare one-sided reads (``shm-pull`` and the one-sided example) passes
the one-sided checks too (aiocollect.testing.onesided_suite); the others skip them. A
transport added to the registry is checked without a line here."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import pytest

from aiocollect.testing.certs import Certs
from aiocollect.testing.link_suite import LINK_CHECKS, PairFactory, transport_pair
from aiocollect.testing.onesided_suite import ONE_SIDED_CHECKS, one_sided_support
from aiocollect.tls import TLSConfig
from aiocollect.transport import cma, registry, unix
from aiocollect.transport.base import Link, LinkEvents
from aiocollect.transport.interface import Transport
from aiocollect.transport.tcp import StreamLink
from tests.support.certs import make_certs
from tests.support.transports import AXIS_ENV, selected
from tests.transport.example_onesided import ONE_SIDED
from tests.transport.example_transport import UNIX

# asyncio and uvloop transports differ (tests/conftest.py); the transports of this run:
# the axis's (tests/support/transports.py), the examples in every run
pytestmark = [pytest.mark.both_loops, pytest.mark.axis]

#: Variants beyond the registry's names (with single-copy pulls on): the transport each is.
PULL_VARIANTS = {"shm-pull": "shm"}
#: ... and with Unix sockets off (AIOCOLLECT_UNIX_SOCKET=0): the socket is TCP loopback.
SOCKET_VARIANTS = {"shm-tcpsocket": "shm", "auto-tcpsocket": "auto"}
#: The example transports, registered for their tests only.
EXAMPLES = {t.name: t for t in (UNIX, ONE_SIDED)}
#: Every link kind; ``make test`` runs the core modes and the examples, ``make test-axis``
#: the rest (``AIOCOLLECT_AXIS``).
ALL_TRANSPORTS = [*registry.names(), *PULL_VARIANTS, *SOCKET_VARIANTS, *EXAMPLES]
TRANSPORTS = [
    t
    for t in ALL_TRANSPORTS
    if selected(t) or (t in EXAMPLES and os.environ.get(AXIS_ENV) != "extended")
]
#: The socket family each shared-memory name's pair must connect over.
FAMILIES = {
    "shm": socket.AF_UNIX,
    "auto": socket.AF_UNIX,
    "shm-pull": socket.AF_UNIX,
    "shm-tcpsocket": socket.AF_INET,
    "auto-tcpsocket": socket.AF_INET,
}


def _family(link: Link) -> socket.AddressFamily | None:
    transport = link.transport if isinstance(link, StreamLink) else None
    sock = None if transport is None else transport.get_extra_info("socket")
    return None if sock is None else socket.AddressFamily(sock.family)


def _over(family: socket.AddressFamily, make_pair: PairFactory) -> PairFactory:
    """``make_pair``, checking that both links of every pair use a ``family`` socket."""

    @asynccontextmanager
    async def pair(
        ea: LinkEvents, eb: LinkEvents, max_frame: int
    ) -> AsyncIterator[tuple[Link, Link]]:
        async with make_pair(ea, eb, max_frame) as (a, b):
            assert (_family(a), _family(b)) == (family, family)
            yield a, b

    return pair


@pytest.fixture(scope="module")
def link_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("link-certs"), 2)


@pytest.fixture
def examples_registered() -> Iterator[None]:
    with registry.registered(UNIX), registry.registered(ONE_SIDED):
        yield


def _factory(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> PairFactory:
    family = FAMILIES.get(name)
    if name in SOCKET_VARIANTS:
        monkeypatch.setenv(unix.UNIX_ENV, "0")
        name = SOCKET_VARIANTS[name]
    else:
        monkeypatch.delenv(unix.UNIX_ENV, raising=False)
        if family is not None and not unix.enabled():  # (not Linux)
            family = socket.AF_INET
    make_pair = _pair(name, request, monkeypatch)
    return make_pair if family is None else _over(family, make_pair)


def _pair(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> PairFactory:
    pulls = name in PULL_VARIANTS
    if name in EXAMPLES:
        request.getfixturevalue("examples_registered")
    transport = registry.get(PULL_VARIANTS.get(name, name))
    assert isinstance(transport, Transport), name
    reason = transport.unavailable()
    if reason is not None:
        pytest.skip(f"{name} is unavailable here: {reason}")
    tls: tuple[TLSConfig, TLSConfig] | None = None
    if transport.needs_tls:
        certs: Certs = request.getfixturevalue("link_certs")
        tls = (certs.config(0), certs.config(1))
    if not pulls:  # pulls off: shared-memory frames go through the ring
        monkeypatch.setenv(cma.ENV, "0")
        return transport_pair(transport, tls, expect_pulls=False if name == "shm" else None)
    monkeypatch.delenv(cma.ENV, raising=False)
    if cma.threshold() == 0:
        pytest.skip("process_vm_readv is not available here")
    return transport_pair(transport, tls, expect_pulls=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", LINK_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_link_conformance(
    transport: str,
    check: Callable[[PairFactory], Awaitable[None]],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await check(_factory(transport, request, monkeypatch))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", ONE_SIDED_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_one_sided_conformance(
    transport: str,
    check: Callable[[PairFactory], Awaitable[None]],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_pair = _factory(transport, request, monkeypatch)
    why = await one_sided_support(make_pair, check)
    if why is not None:
        pytest.skip(f"{transport}: {why}")
    await check(make_pair)
