"""Fixtures of the network-namespace tests: ``launch`` starts rank processes in the
namespaces of the module's ``topology`` and stops them at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support import netns
from tests.support.netns_ranks import Launch, Rank, launcher


@pytest.fixture
async def launch(topology: netns.Topology) -> AsyncIterator[Launch]:
    started: list[Rank] = []
    yield launcher(topology, started)
    for r in started:
        await r.stop()
