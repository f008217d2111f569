"""Fixtures of the multi-host tests: hosts are network namespaces with their own hostnames
(aiocollect.testing.hosts); the tests skip, naming the reason, where they cannot be built
(not root, no ``ip`` or ``unshare``)."""

from __future__ import annotations

import pytest

from aiocollect.testing import hosts

_why_not = hosts.unavailable()


@pytest.fixture(scope="module", autouse=True)
def _hosts_available() -> None:
    if _why_not is not None:
        pytest.skip(f"needs root, ip netns and unshare --uts: {_why_not}")
    hosts.remove_leftovers()
