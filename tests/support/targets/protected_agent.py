"""Helpers of the protected-mode tests, run as ``ip netns exec NS python -m
tests.support.targets.protected_agent MODE ...``; each prints JSON lines on stdout.

- ``store PORT``: a :class:`TCPStoreServer` with no secret on every interface; prints
  ``{"event": "ready"}``, then, for each line ``keys`` on stdin, ``{"event": "keys",
  "keys": [...]}`` (what is stored); exits at the end of stdin.
- ``client HOST PORT``: what an ordinary client gets: ``{"event": "client", "ok": bool,
  "type": ..., "message": ...}`` after trying set/get.
- ``raw HOST PORT``: a stranger that ignores the protocol: reads the first frame, sends a
  no-secret handshake and a ``set`` anyway, then reads until the server closes; prints
  ``{"event": "raw", "first": <decoded first frame>, "rest": <bytes after it, hex>}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiocollect.errors import AiocollectError
from aiocollect.store import TCPStore, TCPStoreServer, _wire


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def serve(port: int) -> None:
    async with TCPStoreServer(None, port) as server:
        emit("ready", port=server.port)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "keys":
                emit("keys", keys=sorted(server._table._values))


async def client(host: str, port: int) -> None:
    store = TCPStore(host, port, timeout=10)
    try:
        await store.set("aiocollect/netns/rank/1", b"from the client")
        value = await store.get("aiocollect/netns/rank/1")
        emit("client", ok=value == b"from the client", type=None, message="")
    except AiocollectError as exc:
        emit("client", ok=False, type=type(exc).__name__, message=str(exc))
    finally:
        await store.close()


async def raw(host: str, port: int) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    first = await _wire.read_frame(reader, _wire.MAX_HANDSHAKE_FRAME)
    try:
        writer.writelines(_wire.encode(_wire.NO_PROOF))
        writer.writelines(_wire.encode([1, "set", "aiocollect/netns/rank/1", b"evil"]))
        writer.writelines(_wire.encode([2, "get", "aiocollect/netns/rank/0", 0.0]))
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)  # until the server closes
    except ConnectionError:
        rest = b""
    writer.close()
    emit("raw", first=[x.hex() if isinstance(x, bytes) else x for x in first], rest=rest.hex())


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "store":
        asyncio.run(serve(int(args[0])))
    elif mode == "client":
        asyncio.run(client(args[0], int(args[1])))
    elif mode == "raw":
        asyncio.run(raw(args[0], int(args[1])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
