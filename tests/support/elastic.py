"""Elastic-group member processes: :class:`Procs` starts them and reads the reports they
send (tests/support/targets/elastic.py), and the secret of the standalone store they share."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.support.targets.elastic import Reporter

#: The secret of the tests' standalone store (``AIOCOLLECT_SECRET`` of `aiocollect store`).
SECRET = "elastic-test-secret"


@dataclass
class Procs:
    """Spawned processes and the queue they report to."""

    ctx: Any = field(default_factory=lambda: mp.get_context("spawn"))
    procs: dict[Any, Any] = field(default_factory=dict)
    #: One pipe per process: a process killed while writing to a shared queue would
    #: hold its lock forever.
    conns: list[Any] = field(default_factory=list)
    seen: list[tuple[Any, ...]] = field(default_factory=list)

    def start(self, key: Any, target: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        recv, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(
            target=target, args=(*args, Reporter(send)), kwargs=kwargs, daemon=True
        )
        p.start()
        send.close()
        self.procs[key] = p
        self.conns.append(recv)

    def _next(self, timeout: float) -> tuple[Any, ...]:
        while self.conns:
            ready = mp_connection.wait(self.conns, timeout=timeout)
            if not ready:
                break
            for conn in ready:
                try:
                    return tuple(conn.recv())  # type: ignore[call-arg, union-attr]
                except (EOFError, OSError):
                    self.conns.remove(conn)
                    conn.close()  # type: ignore[union-attr]
        raise queue.Empty

    def kill(self, key: Any) -> float:
        os.kill(self.procs[key].pid, signal.SIGKILL)
        self.procs[key].join(10)
        return time.time()

    def wait(
        self,
        kind: str,
        n: int,
        timeout: float = 30.0,
        where: Callable[[tuple[Any, ...]], bool] = lambda m: True,
    ) -> list[tuple[Any, ...]]:
        """The next ``n`` reports of ``kind`` (earlier ones kept in ``seen``)."""
        got = [m for m in self.seen if m[0] == kind and where(m)]
        end = time.monotonic() + timeout
        while len(got) < n:
            try:
                msg = self._next(max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"waited for {n} {kind!r}, got {got}; all reports: {self.seen}"
                ) from None
            self.seen.append(msg)
            assert msg[0] != "wrong", f"a wrong sum: {msg}"
            if msg[0] == kind and where(msg):
                got.append(msg)
        for m in got:
            self.seen.remove(m)
        return got

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)
        for conn in self.conns:
            conn.close()
