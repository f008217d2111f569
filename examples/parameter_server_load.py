"""A parameter server that answers pulls while every rank runs bulk allreduces.

Rank 0 fronts a plain asyncio TCP server on loopback. Clients (a separate process, started
by rank 0, holding ``--clients`` connections) send pull requests: an 8-byte key. Rank 0
forwards each to a worker rank by ``send``, the worker answers with ``--reply`` bytes of
its shard by ``send``, and rank 0 writes them back to the client. Meanwhile, with
``--bulk SIZE``, all ranks run back-to-back allreduces of SIZE bytes on the same group
(the same links, the same event loops): the training step a parameter server's requests
must not wait behind.

The clients pull for ``--seconds`` with the group otherwise idle, then (with ``--bulk`` not
0) for ``--seconds`` again while the allreduces run, and rank 0 reports both, measured by
the clients end to end (TCP in, send/recv to a worker and back, TCP out)::

    alone: 11034 pulls/s, p50 0.57 ms, p99 1.71 ms
    bulk 64M: 301 pulls/s, p50 12.1 ms, p99 420.3 ms
    report: {"alone": {...}, "bulk": {...}, ...}

Run: ``aiocollect run -n 4 examples/parameter_server_load.py --bulk 64M`` (``--bulk 0``:
alone only). The ranks run on plain :func:`asyncio.run` (``--uvloop``: on uvloop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time
from typing import Any

import numpy as np

import aiocollect as ac

#: Tag of requests (rank 0 to a worker); a key of -1 stops the worker.
REQUEST = 1
#: Tag of the reply to client connection c is REPLY + c.
REPLY = 1000
KEY = struct.Struct("<q")
#: This file, which the client process runs with ``--client``.
HERE = os.path.abspath(__file__)


def parse_size(text: str) -> int:
    """``64M``, ``512K``, ``1G`` or plain bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


async def bulk_allreduces(group: ac.Group, nbytes: int, stop: asyncio.Event) -> int:
    """Back-to-back allreduces of ``nbytes`` until rank 0's ``stop`` is set (rank 0
    broadcasts it after each allreduce, so every rank runs the same number); returns how
    many ran."""
    data = np.zeros(max(1, nbytes // 4), np.float32)  # stays finite, costs the same
    flag = np.zeros(1, np.int32)
    count = 0
    while True:
        await group.allreduce(data)
        count += 1
        flag[0] = int(stop.is_set())
        await group.broadcast(flag, root=0)
        if flag[0]:
            return count


async def worker(group: ac.Group, reply: int) -> None:
    """Answer rank 0's requests with a slice of this rank's shard until a key of -1."""
    shard = np.full(max(1, reply // 4), group.rank, np.float32)
    req = np.empty(2, np.int64)  # (client connection, key)
    while True:
        await group.recv(req, 0, tag=REQUEST)
        if req[1] == -1:
            return
        await group.send(shard, 0, tag=REPLY + int(req[0]))


async def front(group: ac.Group, reply: int) -> asyncio.Server:
    """Rank 0's TCP server: forward each pull to a worker (by key), write back its reply."""
    conns = iter(range(1 << 30))
    workers = group.world_size - 1

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(conns)
        req = np.array([conn, 0], np.int64)
        back = np.empty(max(1, reply // 4), np.float32)
        try:
            while True:
                (key,) = KEY.unpack(await reader.readexactly(KEY.size))
                req[1] = key
                peer = 1 + key % workers
                await group.send(req, peer, tag=REQUEST)
                await group.recv(back, peer, tag=REPLY + conn)
                writer.write(back.tobytes())
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def run_clients(port: int, clients: int, seconds: float, reply: int) -> dict[str, Any]:
    """The client process's job: ``clients`` connections pulling for ``seconds``; their
    rate and latency (ms)."""
    latencies: list[float] = []
    nbytes = max(1, reply // 4) * 4

    async def client(c: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        end = time.perf_counter() + seconds
        key = c
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            writer.write(KEY.pack(key))
            await reader.readexactly(nbytes)
            latencies.append((time.perf_counter() - t0) * 1e3)
            key += clients
        writer.close()
        await writer.wait_closed()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - t0
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))]

    return {
        "pulls": len(latencies),
        "pulls_per_s": len(latencies) / elapsed,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": latencies[-1],
    }


async def pull_phase(port: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run the clients in their own process (so that they take no time from rank 0's
    loop); their report."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, HERE, "--client", str(port)),
        *("--clients", str(args.clients), "--seconds", str(args.seconds)),
        *("--reply", str(args.reply)),
        stdout=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the clients failed (exit status {proc.returncode})")
    report: dict[str, Any] = json.loads(out)
    return report


def line(name: str, phase: dict[str, Any]) -> str:
    return (
        f"{name}: {phase['pulls_per_s']:.0f} pulls/s, p50 {phase['p50_ms']:.2f} ms, "
        f"p99 {phase['p99_ms']:.2f} ms"
    )


async def server(group: ac.Group, args: argparse.Namespace) -> None:
    """Rank 0: the TCP front, the pull phases, the report."""
    srv = await front(group, args.reply)
    port = srv.sockets[0].getsockname()[1]
    report: dict[str, Any] = {"ranks": group.world_size, "bulk": args.bulk}
    report["alone"] = await pull_phase(port, args)
    print(line("alone", report["alone"]), flush=True)
    if args.bulk:
        stop = asyncio.Event()
        bulk = asyncio.create_task(bulk_allreduces(group, args.bulk, stop))
        report["loaded"] = await pull_phase(port, args)
        stop.set()
        report["allreduces"] = await bulk
        print(line(f"bulk {args.bulk_text}", report["loaded"]), flush=True)
    srv.close()
    await srv.wait_closed()
    for peer in range(1, group.world_size):
        await group.send(np.array([0, -1], np.int64), peer, tag=REQUEST)
    print("report:", json.dumps(report), flush=True)


async def rank_main(args: argparse.Namespace) -> None:
    async with ac.open_group() as group:
        if group.world_size < 2:
            raise SystemExit("run with at least 2 ranks")
        if group.rank == 0:
            await server(group, args)
            return
        serving = asyncio.create_task(worker(group, args.reply))
        if args.bulk:
            await bulk_allreduces(group, args.bulk, asyncio.Event())
        await serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bulk", default="64M", help="allreduce size; 0 for none")
    parser.add_argument("--seconds", type=float, default=5.0, help="of each pull phase")
    parser.add_argument("--clients", type=int, default=8, help="client connections")
    parser.add_argument("--reply", type=int, default=1024, help="bytes per pull reply")
    parser.add_argument("--uvloop", action="store_true", help="run the ranks on uvloop")
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:  # the client process (started by rank 0)
        got = asyncio.run(run_clients(args.client, args.clients, args.seconds, args.reply))
        print(json.dumps(got))
        return
    args.bulk_text, args.bulk = args.bulk, parse_size(args.bulk)
    if args.uvloop:
        import uvloop

        uvloop.run(rank_main(args))
    else:
        asyncio.run(rank_main(args))


if __name__ == "__main__":
    main()
