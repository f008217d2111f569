"""Deadlines on the monotonic clock, computed once and passed down."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """An absolute point on ``time.monotonic()``; ``None`` timeout means never."""

    at: float | None

    @classmethod
    def after(cls, timeout: float | None) -> Deadline:
        """A deadline ``timeout`` seconds from now (``None``: no deadline)."""
        return cls(None if timeout is None else time.monotonic() + timeout)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def loop_time(self, loop_now: float) -> float | None:
        """The deadline expressed on an event loop's clock, for ``asyncio.timeout_at``."""
        rem = self.remaining()
        return None if rem is None else loop_now + rem
