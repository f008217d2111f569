"""The background event-loop thread that drives every aiocollect group of this process.

torch calls a process group's methods from ordinary threads (the training loop, autograd's
engine threads); aiocollect groups live on an event loop. One daemon thread per process
runs that loop. Callers hand it work with :meth:`LoopThread.call` (fire and return) or
:meth:`LoopThread.run` (block for a coroutine's result). Callbacks are run in the order they
were handed over, which is what keeps collective sequence numbers in program order.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiocollect.group import Group

log = logging.getLogger("aiocollect.torch")

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    if os.environ.get("AIOCOLLECT_TORCH_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
        except ImportError:
            pass
    return asyncio.new_event_loop()


class LoopThread:
    """A daemon thread running one event loop forever.

    The thread is started by the constructor and stops with the process (or with
    :meth:`stop`, for tests).
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups: weakref.WeakSet[Group] = weakref.WeakSet()
        self._thread = threading.Thread(
            target=self._main, name="aiocollect-torch-loop", daemon=True
        )
        self._thread.start()
        self._ready.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the thread runs."""
        assert self._loop is not None
        return self._loop

    def _main(self) -> None:
        loop = _new_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def in_thread(self) -> bool:
        """Whether the caller runs on the loop thread itself."""
        return threading.get_ident() == self._thread.ident

    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the loop thread soon; calls run in the order they were made."""
        self.loop.call_soon_threadsafe(fn)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block the calling thread for its result.

        Raises:
            RuntimeError: called from the loop thread (it would wait for itself forever).
            TimeoutError: no result within ``timeout`` seconds (the coroutine is cancelled).
            Whatever ``coro`` raises.
        """
        if self.in_thread():
            coro.close()
            raise RuntimeError(
                "aiocollect.torch: a blocking call was made from the event-loop "
                "thread (e.g. a Future callback); it would wait for itself"
            )
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def track(self, group: Group) -> None:
        """Close ``group`` (if still open) when the thread is stopped."""
        self._groups.add(group)

    async def _close_groups(self, timeout: float) -> None:
        groups = [g for g in list(self._groups) if not g.closed]
        if groups:
            await asyncio.wait(
                [asyncio.ensure_future(g.aclose(timeout)) for g in groups], timeout=timeout + 1.0
            )

    def stop(self, timeout: float = 2.0) -> None:
        """Close the tracked groups (waiting up to ``timeout`` s for their pending work), then
        stop the loop and join the thread."""
        if not self._thread.is_alive() or self.in_thread():
            return
        try:
            self.run(self._close_groups(timeout), timeout + 2.0)
        except Exception as exc:
            log.debug("aiocollect.torch: closing groups at exit: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout + 2.0)


_lock = threading.Lock()
_current: LoopThread | None = None
_pid = 0


def loop_thread() -> LoopThread:
    """This process's loop thread, started on first use (and again in a forked child,
    where the parent's thread does not exist)."""
    global _current, _pid
    with _lock:
        if _current is None or _pid != os.getpid() or not _current.alive():
            _current = LoopThread()
            _pid = os.getpid()
        return _current


@atexit.register
def _stop_at_exit() -> None:
    # A daemon thread still inside the event loop while the interpreter finalizes can
    # crash the process (seen as SIGSEGV at exit); close the groups and stop it first.
    thread = _current
    if thread is not None and _pid == os.getpid():
        thread.stop()
