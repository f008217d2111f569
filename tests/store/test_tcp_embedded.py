"""The embedded-server election of ``connect_tcp_store`` and the standalone command."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time

import pytest

from aiocollect.errors import AuthenticationError, StoreError, StoreTimeout, UsageError
from aiocollect.store import TCPStore, TCPStoreServer, connect_tcp_store, tcp
from tests.support.store import child_env, free_port, settle

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("secret", [None, b"election"], ids=["open", "secret"])
async def test_host_starting_last_still_connects(
    monkeypatch: pytest.MonkeyPatch, secret: bytes | None
) -> None:
    world_size = 4
    port = free_port()
    refused: set[str] = set()
    all_refused = asyncio.Event()
    real_dial = tcp._dial

    async def counting_dial(store: TCPStore, timeout: float) -> None:
        try:
            await real_dial(store, timeout)
        except OSError:
            task = asyncio.current_task()
            assert task is not None
            refused.add(task.get_name())
            if len(refused) == world_size - 1:
                all_refused.set()
            raise

    monkeypatch.setattr(tcp, "_dial", counting_dial)

    async def rank(r: int) -> TCPStore:
        if r == 0:
            await all_refused.wait()  # every other rank has already been refused once
        return await connect_tcp_store("127.0.0.1", port, is_host=r == 0, secret=secret, timeout=20)

    tasks = [asyncio.create_task(rank(r), name=f"rank{r}") for r in range(1, world_size)]
    tasks.append(asyncio.create_task(rank(0), name="rank0"))
    stores = await asyncio.gather(*tasks)
    host = stores[-1]
    assert host.server is not None
    assert host.server.port == port
    assert all(s.server is None for s in stores[:-1])
    assert sorted(await asyncio.gather(*(s.add("arrived", 1) for s in stores))) == [1, 2, 3, 4]
    for s in stores[:-1]:
        await s.close()
    await host.close()
    with pytest.raises(StoreError):  # the host's close stopped the embedded server
        await TCPStore("127.0.0.1", port).connect()


async def test_host_connects_to_existing_server() -> None:
    async with TCPStoreServer("127.0.0.1", 0) as server:
        store = await connect_tcp_store("127.0.0.1", server.port, is_host=True, timeout=10)
        assert store.server is None
        await store.set("k", b"v")
        other = await connect_tcp_store("127.0.0.1", server.port, is_host=False, timeout=10)
        assert await other.get("k") == b"v"
        await store.close()
        await other.close()
        third = TCPStore("127.0.0.1", server.port)
        assert await third.check(["k"]) == [True]
        await third.close()


async def test_host_with_port_zero_starts_server() -> None:
    store = await connect_tcp_store("127.0.0.1", 0, is_host=True, timeout=10)
    assert store.server is not None
    assert store.port == store.server.port > 0
    peer = await connect_tcp_store("127.0.0.1", store.port, is_host=False, timeout=10)
    await peer.set("k", b"v")
    assert await store.get("k") == b"v"
    await peer.close()
    await store.close()
    with pytest.raises(UsageError):
        await connect_tcp_store("127.0.0.1", 0, is_host=False, timeout=1)


async def test_non_host_timeout_names_address() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        await connect_tcp_store("127.0.0.1", port, is_host=False, timeout=0.3)
    assert time.monotonic() - start < 5
    assert f"127.0.0.1:{port}" in str(info.value)


async def _start_command(*args: str) -> tuple[asyncio.subprocess.Process, int, str | None]:
    """Start `aiocollect store`; its port and the secret it generated (None if given one)."""
    env = child_env()
    env.pop("AIOCOLLECT_SECRET", None)
    env.pop("AIOCOLLECT_INSECURE", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiocollect.store",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
    match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    assert match, f"unexpected first line from `aiocollect store`: {line!r}"
    secret = None
    if "secret required" in line and "--secret" not in args:
        export = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        found = re.fullmatch(r"export AIOCOLLECT_SECRET=(\S+)\n", export)
        assert found, f"expected the line to export, got {export!r}"
        secret = found.group(1)
    return proc, int(match.group(1)), secret


async def test_standalone_command_serves_and_stops_on_sigterm() -> None:
    proc, port, _ = await _start_command("--secret", "cli-secret")
    try:
        a = await connect_tcp_store("127.0.0.1", port, is_host=False, secret="cli-secret")
        b = await connect_tcp_store("127.0.0.1", port, is_host=True, secret="cli-secret")
        assert b.server is None  # something already listens: just connect
        waiter = asyncio.create_task(a.get("from-b", timeout=20))
        await settle(a)
        await b.set("from-b", b"hello")
        assert await waiter == b"hello"
        await a.close()
        await b.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_killed_server_fails_pending_requests_promptly() -> None:
    proc, port, _ = await _start_command("--insecure")
    try:
        store = await connect_tcp_store("127.0.0.1", port, is_host=False, timeout=10)
        pending = asyncio.create_task(store.get("never", timeout=25))
        await settle(store)
        start = time.monotonic()
        proc.kill()
        await proc.wait()
        with pytest.raises(StoreError, match="lost") as info:
            await asyncio.wait_for(pending, 10)
        assert not isinstance(info.value, StoreTimeout)
        assert time.monotonic() - start < 5
        await store.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_standalone_command_without_a_secret_generates_one() -> None:
    """Neither --secret nor --insecure: the command prints a secret to export, and only a
    client that has it gets in."""
    proc, port, secret = await _start_command()
    try:
        assert secret is not None
        assert len(secret) >= 32
        with pytest.raises(AuthenticationError, match="requires a secret"):
            await connect_tcp_store("127.0.0.1", port, is_host=False, timeout=10)
        store = await connect_tcp_store("127.0.0.1", port, is_host=False, secret=secret, timeout=10)
        await store.set("k", b"v")
        assert await store.get("k") == b"v"
        await store.close()
    finally:
        proc.kill()
        await proc.wait()


def test_store_main_reports_bind_failure(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert tcp.store_main(["--host", "127.0.0.1", "--port", str(port)]) == 1
    assert f"port {port}" in capsys.readouterr().err


async def test_host_port_held_by_a_connection_is_a_clear_error() -> None:
    """The host rank's port is the local port of an established connection (what a
    launcher's own client connections do to MASTER_PORT + 1 now and then): the host gets
    StoreError naming the port within the grace period, not a StoreTimeout after the full
    timeout."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = free_port()
    client = socket.socket()  # no SO_REUSEADDR: the port stays unavailable to listeners
    try:
        client.bind(("127.0.0.1", port))
        client.connect(listener.getsockname())
        started = time.monotonic()
        with pytest.raises(StoreError, match=f"{port}.*in use, but no store answers"):
            await connect_tcp_store("127.0.0.1", port, is_host=True, timeout=25)
        assert time.monotonic() - started < tcp.TAKEN_GRACE + 3
    finally:
        client.close()
        listener.close()
