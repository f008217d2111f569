"""The library's no-progress warnings, collected for tests (the ``stall_warnings`` fixture
of tests/conftest.py sets the first warning to 0.4 s and installs the handler)."""

from __future__ import annotations

import asyncio
import logging
import time


class StallWarnings(logging.Handler):
    """Collects the no-progress warnings logged under ``aiocollect``, with when they came."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "no progress for" in message:
            self.records.append((time.monotonic(), message))
            self._changed.set()

    @property
    def messages(self) -> list[str]:
        """Every warning's text, in order."""
        return [m for _, m in self.records]

    async def wait(self, n: int, rank: int) -> None:
        """Until ``n`` warnings of ``rank`` arrived."""
        while len(self.of(rank)) < n:
            self._changed.clear()
            await self._changed.wait()

    async def wait_for(self, text: str) -> None:
        """Until a warning containing ``text`` arrived."""
        while not any(text in m for m in self.messages):
            self._changed.clear()
            await self._changed.wait()

    def of(self, rank: int) -> list[tuple[float, str]]:
        """The warnings of ``rank``, with when they came."""
        return [(t, m) for t, m in self.records if f"on rank {rank}:" in m]
