"""Every registered transport's links pass the Link conformance suite
(aiocollect.testing.link_suite), made through the transport's own listeners as rendezvous
makes them, over real connections and real segments: each name of the registry (shared
memory without single-copy pulls, and once more with them as ``shm-pull``), and the
example transport of tests/transport/example_transport.py, registered here only. A
transport added to the registry is checked without a line here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest

from aiocollect.testing.link_suite import LINK_CHECKS, PairFactory, transport_pair
from aiocollect.tls import TLSConfig
from aiocollect.transport import cma, registry
from aiocollect.transport.interface import Transport
from tests.failure.conftest import Certs, make_certs
from tests.transport.example_transport import UNIX

pytestmark = pytest.mark.both_loops  # asyncio and uvloop transports differ (tests/conftest.py)

#: Variants beyond the registry's names (with single-copy pulls on): the transport each is.
PULL_VARIANTS = {"shm-pull": "shm"}
TRANSPORTS = [*registry.names(), *PULL_VARIANTS, UNIX.name]


@pytest.fixture(scope="module")
def link_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("link-certs"), 2)


@pytest.fixture
def example_registered() -> Iterator[None]:
    with registry.registered(UNIX):
        yield


def _factory(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> PairFactory:
    pulls = name in PULL_VARIANTS
    if name == UNIX.name:
        request.getfixturevalue("example_registered")
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
