"""gloo's monitored barrier for the aiocollect process group: the ranks meet through the
group's c10d store (nothing is sent on the group's links), and rank 0 names those that did
not arrive in time."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from aiocollect.torch._tensors import timeout_seconds
from aiocollect.torch.errors import MonitoredBarrierError

if TYPE_CHECKING:
    from aiocollect.torch.process_group import AiocollectProcessGroup


def monitored_barrier(
    pg: AiocollectProcessGroup, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier on ``pg`` that names the ranks that did not arrive (gloo's
    ``monitored_barrier``).

    Waits for this rank's earlier operations on the group, then meets the other ranks
    through the group's store: rank 0 waits for every rank, then releases them.

    Args:
        pg: the process group.
        timeout: how long rank 0 waits for the others and they for its release; a zero
            ``timedelta`` means no time at all; None: the group's default timeout (30 min
            when it has none).
        wait_all_ranks: rank 0 names every rank that did not arrive, not only the first.

    Raises:
        MonitoredBarrierError: on rank 0, the first rank that did not arrive within
            ``timeout`` (every such rank with ``wait_all_ranks``), or ``Rank 0 timed out``
            when the time was up before it could look (a zero ``timeout``); on the
            others, rank 0 did not release them in time.
        GroupBrokenError: an earlier collective of the group failed.
    """
    if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
        seconds = 0.0  # gloo's meaning: no time at all
    else:
        given = timeout_seconds(timeout)
        seconds = given or pg._default_timeout or pg.aiocollect_group.timeout or 1800.0
    deadline = time.monotonic() + seconds
    pg.barrier_local(seconds or None)
    n = pg._monitored
    pg._monitored += 1
    store = pg._store
    rank = pg.getRank()
    prefix = f"aiocollect/monitored/{n}"
    store.set(f"{prefix}/{rank}", "1")
    ms = f"{seconds * 1000:.0f} ms"
    if rank != 0:
        try:
            store.wait(
                [f"{prefix}/released"],
                timedelta(seconds=max(0.001, deadline - time.monotonic())),
            )
        except Exception as exc:
            raise MonitoredBarrierError(
                f"Rank {rank} successfully reached monitoredBarrier, but received "
                f"errors while waiting for rank 0 to release it within {ms} ({exc}). "
                "Please check rank 0 logs for faulty rank.",
                [0],
            ) from exc
        return
    missing: list[int] = []
    for peer in range(1, pg.getSize()):
        key = f"{prefix}/{peer}"
        left = deadline - time.monotonic()
        if left <= 0 and not missing and not store.check([key]):
            raise MonitoredBarrierError(f"Rank 0 timed out in monitoredBarrier after {ms}", [peer])
        try:
            if left <= 0 or missing:
                if not store.check([key]):
                    raise TimeoutError(key)
            else:
                store.wait([key], timedelta(seconds=left))
        except Exception:
            missing.append(peer)
            if not wait_all_ranks:
                break
    if missing:
        who = (
            f"Rank {missing[0]}"
            if len(missing) == 1 and not wait_all_ranks
            else "Ranks " + ", ".join(map(str, missing))
        )
        raise MonitoredBarrierError(f"{who} failed to pass monitoredBarrier in {ms}", missing)
    store.set(f"{prefix}/released", "1")


__all__ = ["monitored_barrier"]
