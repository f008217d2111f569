"""Fixtures of the elastic tests: a standalone store process (`aiocollect store`) that
outlives every member, and a helper that starts member processes and reads their reports."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.elastic.targets import Reporter

SECRET = "elastic-test-secret"


@pytest.fixture
def store_url() -> Iterator[str]:
    """``tcp://127.0.0.1:PORT`` of a fresh `aiocollect store` (secret SECRET)."""
    env = dict(os.environ, AIOCOLLECT_SECRET=SECRET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocollect", "store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by pytest-timeout
    assert "listening on" in line, line
    address = line.split("listening on ", 1)[1].split()[0]
    try:
        yield f"tcp://{address}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


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
                    return tuple(conn.recv())
                except (EOFError, OSError):
                    self.conns.remove(conn)
                    conn.close()
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


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()
