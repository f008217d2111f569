"""The smallest pure-Python 4-byte allreduce over TCP: what Python and uvloop cost alone.

    python scripts/minimal_exchange.py              # 2 ranks, 5000 exchanges, no busy-wait
    SPIN_US=50 python scripts/minimal_exchange.py   # poll the loop up to 50 µs first
    python scripts/minimal_exchange.py 4            # 4 ranks (recursive doubling)
    python scripts/minimal_exchange.py 4 --star     # 4 ranks, any count: the star
    python scripts/minimal_exchange.py 4 --star --exec  # each rank a fresh interpreter
    python scripts/minimal_exchange.py 4 --star --unix  # Unix socket pairs, not TCP
    python scripts/minimal_exchange.py 4 --unix --json F  # and both statistics into F
    python scripts/minimal_exchange.py 4 --count 1024 # 4 KiB (float32 elements)
    python scripts/minimal_exchange.py 4 --star --count 0  # empty frames: a barrier
    python scripts/minimal_exchange.py 4 --star --checked  # fingerprints, a registry

N processes (forks of one parent, or with ``--exec`` each rank started as its own
interpreter, as ``aiocollect run --start-method exec`` does; N a power of two unless
``--star``), one TCP connection on loopback with TCP_NODELAY per pair of partners (with
``--unix``: a Unix socket pair, made before the fork, as aiocollect's same-host links use
Unix sockets), one ``asyncio.BufferedProtocol`` per connection on uvloop. Per operation
each rank runs recursive doubling: in step k it writes a 16-byte header and 4 bytes to rank
``r ^ 2**k``, waits for that partner's 20 bytes, checks the sequence number and adds the
partner's value with numpy: no library, no checks, no deadlines, no failure handling.
``--star`` (aiocollect's small allreduce at three and four ranks): every rank sends its
value to rank 0, which adds them in rank order and sends the sum back. Each rank prints the
mean, p50 and p99 of its per-operation time and its user and system CPU per operation.
docs/benchmarks.md (*Twelfth session*, *Thirteenth session*, *Twentieth session*,
*Twenty-second session*) compares it with ``scripts/op_latency.py`` in the same hour; it
is a yardstick, not part of aiocollect.

With ``--json F`` (forked ranks) the parent also writes the two statistics of the whole run
that ``aiocollect bench --floor`` compares (docs/benchmarks.md, *Eighteenth session*): the
median over iterations of each iteration's slowest rank (``each_us``: the bench's p50) and
the slowest rank's median (``rank_us``: the floor's), as ``scripts/yardsticks.py`` reads
them.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import cast

import numpy as np
import uvloop

ITERS = 5000
WARMUP = 300
HEADER = struct.Struct("<QII")  # sequence number, kind, length
#: float32 elements per allreduce (--count C; 1: 4 bytes)
COUNT = 1


#: Unix socket pairs by (lower rank, higher rank), made before the ranks fork (--unix).
PAIRS: dict[tuple[int, int], tuple[socket.socket, socket.socket]] = {}


class Peer(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.filled = 0
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        sock = transport.get_extra_info("socket")
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        waiter = self.waiter
        if waiter is not None and not waiter.done():  # the waiter checks what it needs
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        pass


def partners_of(rank: int, n: int, star: bool) -> list[int]:
    """Whom ``rank`` exchanges with: its recursive-doubling partners in step order, or in
    the star rank 0 with everyone and everyone with rank 0."""
    if star:
        return list(range(1, n)) if rank == 0 else [0]
    return [rank ^ (1 << k) for k in range(n.bit_length() - 1)]


async def connect(rank: int, n: int, ports: list[int], star: bool) -> dict[int, Peer]:
    """This rank's connections, by partner: it accepts from lower partners on its own
    port and connects to the higher ones' ports."""
    loop = asyncio.get_running_loop()
    partners = partners_of(rank, n, star)
    if PAIRS:  # --unix: the pairs exist already
        unix_peers = {}
        for p in partners:
            ends = PAIRS[(min(rank, p), max(rank, p))]
            _, made = await loop.connect_accepted_socket(Peer, ends[0 if rank < p else 1])
            await made.connected
            unix_peers[p] = made
        return unix_peers
    lower = [p for p in partners if p < rank]
    accepted: asyncio.Queue[Peer] = asyncio.Queue()
    server = await loop.create_server(lambda: _accepted(accepted), "127.0.0.1", ports[rank])
    peers: dict[int, Peer] = {}
    for p in partners:
        if p < rank:
            continue
        for _ in range(500):
            try:
                _, peer = await loop.create_connection(Peer, "127.0.0.1", ports[p])
                break
            except OSError:
                await asyncio.sleep(0.01)
        else:
            raise SystemExit("could not connect")
        await peer.connected
        peer.transport.write(struct.pack("<I", rank))  # type: ignore[union-attr]
        peers[p] = peer
    for _ in lower:  # each lower partner says who it is first
        peer = await accepted.get()
        await peer.connected
        while peer.filled < 4:
            peer.waiter = loop.create_future()
            await peer.waiter
        (who,) = struct.unpack_from("<I", peer.buf)
        peer.buf[: peer.filled - 4] = peer.buf[4 : peer.filled]
        peer.filled -= 4
        peers[who] = peer
    server.close()
    return peers


def _accepted(queue: asyncio.Queue[Peer]) -> Peer:
    made = Peer()
    queue.put_nowait(made)
    return made


#: Where forked ranks leave their per-iteration seconds for the parent (--json).
TIMES_DIR: str | None = None


#: --checked: each frame also carries the operation's fingerprint (collective, dtype,
#: count, reduction, root), which the receiver compares with its own and the length with
#: its buffer's, and each operation is entered in a registry and an in-flight table (with
#: its start time, for deadlines) and taken out at its end: the least of what aiocollect's
#: contract (mismatch detection, deadlines) asks per message and per operation.
CHECKED = False
CHECKED_HEADER = struct.Struct("<QII5i")


async def run(rank: int, n: int, ports: list[int], star: bool) -> None:
    loop = asyncio.get_running_loop()
    peers = await connect(rank, n, ports, star)
    steps = [peers[p] for p in partners_of(rank, n, star)]
    value = np.zeros(COUNT, np.float32)
    header = CHECKED_HEADER if CHECKED else HEADER
    frame = header.size + value.nbytes
    spin = float(os.environ.get("SPIN_US", "0")) * 1e-6
    fp = (1, 11, COUNT, 0, -1)  # allreduce, float32, count, SUM, no root
    checked = fp if CHECKED else ()  # (the header's fields after the length)
    registry: dict[int, tuple[int, ...]] = {}
    in_flight: dict[int, float] = {}

    def send(peer: Peer, seq: int) -> None:
        assert peer.transport is not None
        peer.transport.write(header.pack(seq, 1, value.nbytes, *checked) + value.tobytes())

    async def take(peer: Peer, seq: int, add: bool) -> None:
        """Wait for ``peer``'s frame of ``seq``; add its value (else copy it)."""
        while peer.filled < frame:
            peer.waiter = loop.create_future()
            if spin:
                end = time.perf_counter() + spin
                # the busy-wait being measured: poll the loop, then sleep on the future
                while not peer.waiter.done() and time.perf_counter() < end:  # noqa: ASYNC110
                    await asyncio.sleep(0)
            await peer.waiter
        if CHECKED:
            got, _, length, *theirs_fp = CHECKED_HEADER.unpack_from(peer.buf, 0)
            if got != seq or tuple(theirs_fp) != fp or length != value.nbytes:
                raise RuntimeError(f"frame {got} does not match operation {seq}")
        else:
            got, _, _ = HEADER.unpack_from(peer.buf, 0)
            assert got == seq, (got, seq)
        if COUNT:  # (--count 0: empty frames, a barrier)
            theirs = np.frombuffer(peer.buf, np.float32, COUNT, header.size)
            if add:
                np.add(value, theirs, out=value)
            else:
                value[:] = theirs
        rest = peer.filled - frame
        peer.buf[:rest] = peer.buf[frame : peer.filled]
        peer.filled = rest

    async def exchange(seq: int) -> None:
        if CHECKED:
            registry[seq] = fp
            in_flight[seq] = loop.time()
            try:
                await unchecked(seq)
            finally:
                del registry[seq], in_flight[seq]
        else:
            await unchecked(seq)

    async def unchecked(seq: int) -> None:
        if not star:
            for peer in steps:
                send(peer, seq)
                await take(peer, seq, True)
        elif rank == 0:
            for peer in steps:  # (in rank order, as aiocollect's star folds)
                await take(peer, seq, True)
            for peer in steps:
                send(peer, seq)
        else:
            send(steps[0], seq)
            await take(steps[0], seq, False)

    for i in range(WARMUP):
        await exchange(i)
    lat = np.empty(ITERS)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for i in range(ITERS):
        t = time.perf_counter()
        await exchange(WARMUP + i)
        lat[i] = time.perf_counter() - t
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    us = 1e6 / ITERS
    print(
        f"minimal exchange{' (star)' if star else ''}{' (checked)' if CHECKED else ''}, "
        f"N={n} rank {rank}: "
        f"mean {wall * us:.1f} us, p50 "
        f"{np.median(lat) * 1e6:.1f}, p99 {np.percentile(lat, 99) * 1e6:.1f}; CPU per op: "
        f"user {(r1.ru_utime - r0.ru_utime) * us:.1f} us, sys "
        f"{(r1.ru_stime - r0.ru_stime) * us:.1f} us; context switches per op: "
        f"{(r1.ru_nvcsw - r0.ru_nvcsw) / ITERS:.2f} voluntary, "
        f"{(r1.ru_nivcsw - r0.ru_nivcsw) / ITERS:.2f} involuntary",
        flush=True,
    )
    if TIMES_DIR is not None:
        np.save(os.path.join(TIMES_DIR, f"{rank}.npy"), lat)
    for peer in steps:
        assert peer.transport is not None
        peer.transport.close()


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--rank"]:  # a rank started by --exec: --rank R N PORTS
        rank, n, ports = int(args[1]), int(args[2]), [int(p) for p in args[3].split(",")]
        uvloop.run(run(rank, n, ports, "--star" in args))
        return
    global TIMES_DIR, COUNT, CHECKED
    if "--checked" in args:
        CHECKED = True
        args.remove("--checked")
    if "--count" in args:
        at = args.index("--count")
        COUNT = int(args[at + 1])
        del args[at : at + 2]
    json_out = None
    if "--json" in args:
        at = args.index("--json")
        json_out = args[at + 1]
        del args[at : at + 2]
    star = "--star" in args
    fresh = "--exec" in args
    if fresh and (json_out is not None or COUNT != 1 or CHECKED):
        raise SystemExit("--json, --count and --checked need forked ranks (not --exec)")
    numbers = [a for a in args if a not in ("--star", "--exec", "--unix")]
    n = int(numbers[0]) if numbers else 2
    if n < 2 or (not star and n & (n - 1)):
        raise SystemExit("the number of ranks must be at least 2 (a power of two without --star)")
    probes = [socket.socket() for _ in range(n)]
    for probe in probes:  # free ports, picked by the kernel (closed just before use)
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in probes]
    for probe in probes:
        probe.close()
    if fresh:
        spec = ",".join(map(str, ports))
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(rank), str(n), spec]
                + (["--star"] if star else [])
            )
            for rank in range(1, n)
        ]
        uvloop.run(run(0, n, ports, star))
        for proc in procs:
            proc.wait()
        return
    if "--unix" in args:
        if fresh:
            raise SystemExit("--unix needs forked ranks (not --exec)")
        for a in range(n):
            for b in partners_of(a, n, star):
                if a < b:
                    PAIRS[(a, b)] = socket.socketpair()
    tmp = tempfile.TemporaryDirectory() if json_out is not None else None
    TIMES_DIR = tmp.name if tmp is not None else None
    children = []
    for rank in range(1, n):
        child = os.fork()
        if child == 0:
            try:
                uvloop.run(run(rank, n, ports, star))
            finally:
                os._exit(0)
        children.append(child)
    uvloop.run(run(0, n, ports, star))
    for child in children:
        os.waitpid(child, 0)
    if tmp is not None and json_out is not None:
        with tmp:
            times = np.array([np.load(os.path.join(tmp.name, f"{r}.npy")) for r in range(n)])
        stats = {
            "n": n,
            "shape": "star" if star else "doubling",
            "each_us": float(np.median(times.max(axis=0))) * 1e6,
            "rank_us": float(max(np.median(t) for t in times)) * 1e6,
        }
        with open(json_out, "w") as f:
            json.dump(stats, f)


if __name__ == "__main__":
    main()
