"""Every transport's links pass the Link conformance suite (aiocollect.testing.link_suite):
memory, TCP, TLS and shared memory with and without single-copy pulls, over real loopback
connections and real segments. A new transport is checked by adding its pair factory."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from aiocollect.testing.link_suite import (
    LINK_CHECKS,
    PairFactory,
    memory_pair,
    shm_pair,
    tcp_pair,
)
from aiocollect.tls import contexts
from aiocollect.transport import cma, shm_ring
from tests.failure.conftest import Certs, make_certs

pytestmark = pytest.mark.both_loops  # asyncio and uvloop transports differ (tests/conftest.py)

TRANSPORTS = ["memory", "tcp", "tls", "shm", "shm-pull"]


@pytest.fixture(scope="module")
def link_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("link-certs"), 2)


def _factory(name: str, request: pytest.FixtureRequest,
             monkeypatch: pytest.MonkeyPatch) -> PairFactory:
    if name == "memory":
        return memory_pair
    if name == "tcp":
        return tcp_pair()
    if name == "tls":
        certs: Certs = request.getfixturevalue("link_certs")
        server = contexts(*certs.ranks[1], certs.ca)
        client = contexts(*certs.ranks[0], certs.ca)
        return tcp_pair(server.server, client.client)
    reason = shm_ring.unavailable()
    if reason is not None:
        pytest.skip(f"shared memory is unavailable here: {reason}")
    if name == "shm":
        monkeypatch.setenv(cma.ENV, "0")
        return shm_pair(expect_pulls=False)
    monkeypatch.delenv(cma.ENV, raising=False)
    if cma.threshold() == 0:
        pytest.skip("process_vm_readv is not available here")
    return shm_pair(expect_pulls=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", LINK_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_link_conformance(transport: str,
                                check: Callable[[PairFactory], Awaitable[None]],
                                request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    await check(_factory(transport, request, monkeypatch))
