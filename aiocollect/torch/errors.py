"""The errors of the torch backend that aiocollect's own do not cover: a collective that ran
past its deadline, worded as torch's backends word it, and a monitored barrier that some
ranks did not reach."""

from __future__ import annotations

import re

from aiocollect.errors import PeerTimeout

_TIMEOUT_WORDING = re.compile(r" (Timed out|closed|timeout) ")


class CollectiveTimeout(PeerTimeout, RuntimeError):
    """A collective of the torch backend ran past its deadline.

    A :class:`~aiocollect.PeerTimeout` that is also the RuntimeError torch code expects,
    worded as torch's backends word it (``... Timed out waiting 1000ms for ranks [1]: ...``).
    ``__cause__`` is aiocollect's own error; ``ranks`` lists the ranks waited for.
    """


class MonitoredBarrierError(PeerTimeout, RuntimeError):
    """Some ranks did not reach a monitored barrier in time; ``ranks`` lists them.

    Worded as gloo's (``Rank 2 failed to pass monitoredBarrier in 5000 ms``).
    """


def timeout_error(exc: PeerTimeout, kind: str, seconds: float | None) -> PeerTimeout:
    """``exc`` as torch words a collective's timeout.

    Args:
        exc: aiocollect's timeout of the collective.
        kind: the collective's name (``allreduce``...), for the message.
        seconds: the deadline the collective had, or None (the group's).

    Returns:
        ``exc`` itself when its message already reads as torch's, else a
        :class:`CollectiveTimeout` caused by it.
    """
    if _TIMEOUT_WORDING.search(str(exc)):
        return exc
    waited = f"{seconds * 1000:.0f}ms" if seconds is not None else "past the group deadline"
    err = CollectiveTimeout(
        f"aiocollect {kind}: Timed out waiting {waited} for ranks {exc.ranks}: {exc}", exc.ranks
    )
    err.__cause__ = exc
    return err


__all__ = ["CollectiveTimeout", "MonitoredBarrierError", "timeout_error"]
