"""What hostile input costs the TCP store server's event loop: run a server in this process,
attack it over a real socket from the same loop, and report the longest stall of the loop
(a 1 ms ticker) and the growth of this process's resident memory.

    .venv/bin/python scripts/store_limits_probe.py [--attack NAME] [--json]

Attacks: ``bomb`` (one 8 MiB msgpack frame holding 8 Mi empty arrays), ``nested`` (the
same bytes as 128 arrays of 65535 empty arrays), ``keys`` (a legitimate wait naming
16384 keys, for comparison), ``bigset`` (a legitimate ``set`` of a value of almost 64
MiB), ``large-set`` (a legitimate ``set`` of a 64 MiB value, then a ``get`` of it: the
store's two costs of a large value, receiving it and sending it back), ``slow`` (1,000
connections that send 2 bytes of a header, then nothing: how many are still open after
the idle timeout), ``halfsent`` (8 connections that each announce a 64 MiB frame and
send half of it: memory held, and how many are open after the idle timeout).
A report line holds the longest wall-clock stall of the loop and the most CPU
its thread spent without returning to the loop.
The attacker runs in a thread with blocking sockets (``large-set``: in a process of its
own, as its 64 MiB of work would hold the GIL), so the loop bears only the server's
work. Works against older versions of the server too (to measure "before").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

from aiocollect.store import TCPStore, TCPStoreServer, _wire


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def ticker(stop: asyncio.Event, worst: list[float]) -> None:
    """worst[0]: longest wall-clock gap between ticks; worst[1]: most CPU the loop's
    thread spent between two ticks (the part of a gap that is work, not preemption by
    other processes on a busy machine)."""
    last, last_cpu = time.perf_counter(), time.thread_time()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now, cpu = time.perf_counter(), time.thread_time()
        worst[0] = max(worst[0], now - last)
        worst[1] = max(worst[1], cpu - last_cpu)
        last, last_cpu = now, cpu


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _wire.read_frame(reader, _wire.MAX_HANDSHAKE_FRAME)
    if getattr(_wire, "NO_PROOF", None) is not None:  # protocol 2: the client speaks first
        writer.writelines(_wire.encode(_wire.NO_PROOF))
    return reader, writer


def frame(body: bytes) -> bytes:
    return _wire.HEADER.pack(len(body)) + body


def bomb() -> bytes:
    n = 8 * 1024 * 1024
    return frame(b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)


def nested() -> bytes:
    inner = b"\xdc" + (65535).to_bytes(2, "big") + b"\x90" * 65535
    return frame(b"\xdc" + (128).to_bytes(2, "big") + inner * 128)


def bigset() -> bytes:
    import msgpack

    return frame(msgpack.packb([1, "set", "big", b"\x01" * ((64 << 20) - 64)], use_bin_type=True))


def keys() -> bytes:
    import msgpack

    names = [f"aiocollect/default/rank/{i}" for i in range(16384)]
    return frame(msgpack.packb([1, "wait", names, 0.0], use_bin_type=True))


def _blocking_connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    (size,) = _wire.HEADER.unpack(_recv_exactly(sock, _wire.HEADER.size))
    _recv_exactly(sock, size)  # the hello
    if getattr(_wire, "NO_PROOF", None) is not None:  # protocol 2: the client speaks first
        sock.sendall(b"".join(_wire.encode(_wire.NO_PROOF)))
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _attack(port: int, data: bytes) -> str:
    sock = _blocking_connect(port)
    sock.settimeout(30)
    try:
        sock.sendall(data)
        head = sock.recv(64)
        return "answered" if head else "closed by the server"
    except OSError as exc:
        return type(exc).__name__
    finally:
        sock.close()


def _large_set(port: int, size: int = (64 << 20) - 256) -> dict[str, Any]:
    """Set a value of ``size`` bytes, get it back, compare (a legitimate client)."""
    import msgpack

    value = bytes(range(256)) * (size // 256)  # as large as a frame may carry
    frames = [
        frame(msgpack.packb(r, use_bin_type=True))
        for r in ([1, "set", "large", value], [2, "get", "large", 10.0])
    ]
    sock = _blocking_connect(port)
    sock.settimeout(60)
    started = time.perf_counter()
    try:
        for data in frames:
            sock.sendall(data)
            (n,) = _wire.HEADER.unpack(_recv_exactly(sock, _wire.HEADER.size))
            body = bytearray(n)
            view, got = memoryview(body), 0
            while got < n:
                k = sock.recv_into(view[got:])
                if not k:
                    return {"outcome": "closed by the server"}
                got += k
        took = time.perf_counter() - started
        answer = msgpack.unpackb(body)
        return {
            "outcome": "same value back" if answer == [2, 0, value] else "WRONG VALUE",
            "set_get_seconds": round(took, 3),
        }
    finally:
        sock.close()


async def send_one(port: int, data: bytes) -> str:
    return await asyncio.to_thread(_attack, port, data)


async def slow(port: int, server: TCPStoreServer) -> dict[str, Any]:
    conns = []
    for _ in range(1000):
        reader, writer = await connect(port)
        writer.write(b"\x00\x00")
        conns.append((reader, writer))
    await asyncio.sleep(12)  # past the default 10 s idle timeout, if there is one
    still = sum(1 for r, _ in conns if not r.at_eof())
    for _, w in conns:
        w.close()
    return {"open_after_12s": still}


def _half_send(port: int, socks: list[socket.socket]) -> None:
    sock = _blocking_connect(port)
    socks.append(sock)
    sock.settimeout(3)  # a server that stops reading leaves the rest in the socket buffers
    with contextlib.suppress(OSError):
        sock.sendall(
            _wire.HEADER.pack(64 << 20)
            + b"\x94\x01\xa3set\xa1k\xc6"
            + (64 << 20).to_bytes(4, "big")
            + b"\x00" * (32 << 20)
        )


async def halfsent(port: int) -> dict[str, Any]:
    socks: list[socket.socket] = []
    before = rss_mib()
    await asyncio.gather(*(asyncio.to_thread(_half_send, port, socks) for _ in range(8)))
    await asyncio.sleep(1)
    held = rss_mib() - before
    await asyncio.sleep(11)
    still = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            still += sock.recv(1) != b""  # b"": closed by the server
        except BlockingIOError:
            still += 1
        except OSError:
            pass
        sock.close()
    return {"held_mib_after_1s": round(held, 1), "open_after_12s": still}


async def main(attack: str) -> dict[str, Any]:
    server = TCPStoreServer("127.0.0.1", 0)
    await server.start()
    good = TCPStore("127.0.0.1", server.port, timeout=30)
    await good.set("k", b"v")
    stop, worst = asyncio.Event(), [0.0, 0.0]
    data = {"bomb": bomb, "nested": nested, "keys": keys, "bigset": bigset}.get(
        attack, lambda: b""
    )()
    before = rss_mib()
    tick = asyncio.create_task(ticker(stop, worst))
    await asyncio.sleep(0.05)
    worst[0] = worst[1] = 0.0
    started = time.perf_counter()
    result: dict[str, Any] = {"attack": attack}
    if attack == "slow":
        result.update(await slow(server.port, server))
    elif attack == "halfsent":
        result.update(await halfsent(server.port))
    elif attack == "large-set":  # a client process of its own: its work holds no GIL here
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--large-set-client",
            str(server.port),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await child.communicate()
        result.update(json.loads(out))
    else:
        result["outcome"] = await send_one(server.port, data)
    result["seconds"] = round(time.perf_counter() - started, 3)
    result["rss_growth_mib"] = round(rss_mib() - before, 1)
    stop.set()
    await tick
    result["worst_loop_stall_ms"] = round(worst[0] * 1000, 1)
    result["worst_loop_cpu_ms"] = round(worst[1] * 1000, 1)
    result["store_still_serves"] = await good.get("k", timeout=5) == b"v"
    await good.close()
    await server.close()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--attack",
        choices=("bomb", "nested", "keys", "bigset", "large-set", "slow", "halfsent"),
        default=None,
        help="one attack (default: all but slow)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--large-set-client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.large_set_client:
        print(json.dumps(_large_set(args.large_set_client)))
        sys.exit(0)
    for name in [args.attack] if args.attack else ["bomb", "nested", "keys"]:
        out = asyncio.run(main(name))
        print(
            json.dumps(out) if args.json else "  ".join(f"{k}={v}" for k, v in out.items()),
            flush=True,
        )
