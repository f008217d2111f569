"""``Work``: the handle torch gets back from every collective of the aiocollect backend.

A Work is completed on the loop thread when its aiocollect operation ends. A failure is
raised by :meth:`Work.wait` and completes its torch future with the same exception, except
for the Works of DistributedDataParallel (``fail_future=False``): torch 2.13's reducer
crashes the process (SIGSEGV) when a gradient future completes with an exception, so those
futures complete with a value and the failure surfaces through :meth:`Work.wait`,
:meth:`Work.exception` and, through the process group, the next collective call.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aiocollect.torch._loop import LoopThread

log = logging.getLogger("aiocollect.torch")

_FOREVER = timedelta(0)


class Work(dist.Work):
    """The result of one collective call (possibly several aiocollect operations).

    Args:
        result: the tensors the collective writes (the torch future's value; nested lists
            for an allgather of several inputs).
        thread: the loop thread that completes this work.
        kind: the collective's name, for messages.
        fail_future: complete the torch future with the error when the collective fails
            (False: with the output tensors, for DistributedDataParallel).
    """

    def __init__(
        self, result: list[Any], thread: LoopThread, kind: str, *, fail_future: bool = True
    ) -> None:
        super().__init__()
        self._fail_future = fail_future
        self._result = result
        self._thread = thread
        self._kind = kind
        self._done = threading.Event()
        self._finished = False
        self._exc: BaseException | None = None
        self._source = -1
        self._future: torch.futures.Future[list[Any]] = torch.futures.Future()

    def __repr__(self) -> str:
        state = (
            "pending"
            if not self._finished
            else ("ok" if self._exc is None else f"failed: {self._exc!r}")
        )
        return f"<aiocollect Work {self._kind} {state}>"

    # -- completion (loop thread) ----------------------------------------------------------

    def _complete(self, exc: BaseException | None, source: int | None = None) -> None:
        """Record the outcome, complete the torch future normally, then wake waiters (so a
        waiter that wakes up finds the future done)."""
        self._exc = exc
        if source is not None:
            self._source = source
        self._finished = True
        try:
            if exc is not None and self._fail_future:
                self._future.set_exception(exc)  # type: ignore[arg-type]
            else:
                self._future.set_result(self._result)
        except Exception as err:  # a then() callback of the user failed; keep the loop alive
            log.warning("aiocollect.torch: completing the future of %s raised %r", self, err)
        self._done.set()

    # -- the torch Work interface ----------------------------------------------------------

    def wait(self, timeout: timedelta = _FOREVER) -> bool:
        """Block until the collective has finished.

        Args:
            timeout: how long to wait; 0 waits as long as it takes (the collective's own
                deadline still applies).

        Returns:
            True.

        Raises:
            MismatchError: ranks called different collectives (other aiocollect errors:
                PeerError, GroupBrokenError, CollectiveTimeout...; the collective's error is
                raised as it is).
            UsageError: a bad argument found while running.
            TimeoutError: not finished within a non-zero ``timeout`` (the collective keeps
                running).
            RuntimeError: called on the event-loop thread before completion (a deadlock).
        """
        if self._thread.in_thread():
            if not self._finished:
                raise RuntimeError(
                    f"aiocollect.torch: {self._kind} waited on from the event-loop thread (a "
                    "Future callback) before it finished; this would deadlock"
                )
        elif not self._done.is_set():
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if not self._done.wait(seconds if seconds and seconds > 0 else None):
                raise TimeoutError(
                    f"aiocollect.torch: {self._kind} did not finish within {seconds:g} s"
                )
        if self._exc is not None:
            raise self._exc
        return True

    def synchronize(self) -> None:
        """Same as ``wait()`` on CPU."""
        self.wait()

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not).

        Returns:
            True once it has finished.
        """
        return self._finished

    def is_success(self) -> bool:
        """Whether the collective has finished without error.

        Returns:
            True once it has finished without error.
        """
        return self._finished and self._exc is None

    def exception(self) -> BaseException | None:
        """The collective's error.

        Returns:
            The error, or None (not finished, or finished without error).
        """
        return self._exc

    def get_future(self) -> torch.futures.Future[list[Any]]:
        """The collective's torch future.

        Returns:
            A future completed with the output tensors when the collective finishes, or with its
            error when it fails (for DistributedDataParallel's calls: always with the tensors;
            see the module docstring).
        """
        return self._future

    def result(self) -> list[Any]:
        """The collective's outputs.

        Returns:
            The output tensors (for an allgather of several inputs per rank, one list per
            input, as gloo gives them).
        """
        return self._result

    def source_rank(self) -> int:
        """For a receive from any source: the sender.

        Returns:
            The sender's group rank (-1 before completion).
        """
        return self._source

    def _source_rank(self) -> int:
        return self._source


def completed_work(result: list[torch.Tensor], thread: LoopThread, kind: str) -> Work:
    """A Work that is already finished (for calls with nothing to communicate).

    Args:
        result: its output tensors.
        thread: the loop thread.
        kind: the call's name.

    Returns:
        The finished Work.
    """
    work = Work(result, thread, kind)
    work._complete(None)
    return work
