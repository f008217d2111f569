"""The Store contract (aiocollect.testing.store_suite), checked for every backend of
``conftest.BACKENDS``: memory, file, tcp (with and without a secret), prefix, redis and
TorchStore over a real c10d TCPStore. Each check uses two or more store objects on one
backing store, so a value written through one must be visible through the others."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from aiocollect.testing.store_suite import STORE_CHECKS, StoreFactory
from tests.support.store import Backend

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("check", STORE_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_store_conformance(
    backend: Backend, check: Callable[[StoreFactory], Awaitable[None]]
) -> None:
    await check(backend.make)
