"""The handle of a one-frame operation: an ``asyncio.Future`` that tells its operation
when it is cancelled.

It stays a Python class wherever the one-frame path is compiled (docs/design.md, *The
compiled core*): a compiled subclass of asyncio's C ``Future`` crashes the default event
loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiocollect.engine.small import Quick


class Handle(asyncio.Future[Any]):
    """A one-frame operation's handle: a Future that tells its operation when it is
    cancelled (no done callback, and no loop pass for one, per operation)."""

    __slots__ = ("_quick",)

    _quick: Quick | None

    def cancel(self, msg: Any = None) -> bool:
        """Cancel the future (``asyncio.Future.cancel``), then tell its operation (which
        breaks the group if data moved).

        Returns:
            Whether the future was cancelled (False when it was already done)."""
        if not super().cancel(msg):
            return False
        quick, self._quick = self._quick, None
        if quick is not None:
            quick.cancelled()
        return True
