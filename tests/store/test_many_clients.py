"""A standalone store (``aiocollect store``, its own process) under thousands of clients:
4,096 connect at once over real sockets and each does a set and a get, none refused; and a
store out of file descriptors says so once, then serves again as descriptors free up.

The time the 4,096 take is printed (docs/multinode.md, "Forming large groups")::

    PYTHONPATH=. python -m pytest -q -s -n 0 tests/store/test_many_clients.py
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import resource
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable

import pytest

from aiocollect import _fdlimit
from aiocollect.store import TCPStore
from tests.support.store import child_env

CLIENTS = 4096
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


class StoreProcess:
    """A running store process whose stderr is read as it comes (so that its log never
    fills the pipe and stops it)."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        #: stderr lines read so far.
        self.lines: list[str] = []
        self._new = asyncio.Event()
        self._reader = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        assert self.proc.stderr is not None
        while raw := await self.proc.stderr.readline():
            self.lines.append(raw.decode(errors="replace"))
            self._new.set()
        self._new.set()

    async def line_matching(self, pattern: str, timeout: float) -> str:
        """The first stderr line containing ``pattern``, waiting for it.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
        """
        seen = 0
        async with asyncio.timeout(timeout):
            while True:
                for line in self.lines[seen:]:
                    if pattern in line:
                        return line
                seen = len(self.lines)
                if self._reader.done():
                    raise AssertionError(f"the store exited; stderr: {self.lines}")
                self._new.clear()
                await self._new.wait()

    async def stop(self) -> str:
        """SIGTERM the store; return its stderr."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), 30)
        await asyncio.wait_for(self._reader, 30)
        return "".join(self.lines)


@contextlib.asynccontextmanager
async def store_process(
    preexec_fn: Callable[[], object] | None = None,
) -> AsyncIterator[StoreProcess]:
    """``python -m aiocollect.store`` on a free loopback port, stopped on exit."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiocollect.store",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--insecure",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env(),
        preexec_fn=preexec_fn,
    )
    try:
        assert proc.stdout is not None
        first = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        found = LISTENING.search(first)
        assert found, first
        yield StoreProcess(proc, int(found.group(1)))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _one_client(port: int, i: int, done: collections.Counter[str]) -> TCPStore:
    store = TCPStore("127.0.0.1", port, timeout=120)
    try:
        await store.connect()
        done["connected"] += 1
        await store.set(f"client/{i}", str(i).encode())
        assert await store.get(f"client/{i}") == str(i).encode()
        done["set and got"] += 1
    except BaseException:
        await store.close()
        raise
    return store


@pytest.mark.timeout(300)
async def test_4096_clients_connect_at_once_and_none_is_refused() -> None:
    soft = _fdlimit.raise_soft_limit()
    if soft is not None and soft != resource.RLIM_INFINITY and soft < 2 * CLIENTS + 256:
        pytest.skip(f"this process may open {soft} files, too few for {CLIENTS} clients")
    async with store_process() as store:
        done: collections.Counter[str] = collections.Counter()
        start = time.monotonic()
        results = await asyncio.gather(
            *(_one_client(store.port, i, done) for i in range(CLIENTS)), return_exceptions=True
        )
        elapsed = time.monotonic() - start
        clients = [r for r in results if isinstance(r, TCPStore)]
        failures = [r for r in results if not isinstance(r, TCPStore)]
        try:
            assert not failures, (
                f"{len(failures)} of {CLIENTS} clients failed ({dict(done)} in {elapsed:.1f} s):"
                f" {failures[:3]}; the store said: {store.lines[-5:]}"
            )
            check = clients[0]
            keys = [f"client/{i}" for i in range(CLIENTS)]
            assert await check.multi_get(keys) == [str(i).encode() for i in range(CLIENTS)]
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        print(f"{CLIENTS} clients connected and did a set and a get in {elapsed:.2f} s")
        log = await store.stop()
    assert store.proc.returncode == 0, log
    assert "refused" not in log, log
    assert "ran out of file descriptors" not in log, log


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


@pytest.mark.timeout(120)
async def test_a_store_out_of_descriptors_says_so_once_and_recovers() -> None:
    async with store_process(_few_descriptors) as store:
        loop = asyncio.get_running_loop()
        socks = []
        try:
            for _ in range(100):  # beyond 64 descriptors; the rest wait in the backlog
                sock = socket.socket()
                sock.setblocking(False)
                socks.append(sock)
                await loop.sock_connect(sock, ("127.0.0.1", store.port))
            line = await store.line_matching("ran out of file descriptors", 30)
            assert "RLIMIT_NOFILE: soft 64, hard 64" in line, line
            assert "ulimit" in line, line
            # The loop retries accepting every second: two retries with descriptors still
            # exhausted must not log again.
            await asyncio.sleep(2.5)
        finally:
            for sock in socks:
                sock.close()
        client = TCPStore("127.0.0.1", store.port, timeout=30)
        try:
            await client.set("after", b"descriptors came back")
            assert await client.get("after") == b"descriptors came back"
        finally:
            await client.close()
        log = await store.stop()
    assert log.count("ran out of file descriptors") == 1, log
