"""What waking another process costs on this host: a 1-byte ping-pong between two
processes over loopback TCP, a pair of pipes and a Unix socket pair.

Usage::

    python scripts/doorbell_probe.py                 # every kind, 20000 round trips
    taskset -c 0 python scripts/doorbell_probe.py    # both processes on one core

Prints, per kind, the mean round trip and the parent's CPU per round trip (it writes a
byte, then blocks reading the answer). A shared-memory link's doorbell is a byte on its
TCP socket; these figures say what a pipe or a Unix socket would save
(docs/benchmarks.md, *Fourteenth session*).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time


def _ends(kind: str) -> tuple[tuple[int, int], tuple[int, int], list[object]]:
    """(parent write, parent read), (child write, child read), objects to keep alive."""
    if kind == "tcp":
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return (a.fileno(), a.fileno()), (b.fileno(), b.fileno()), [lsock, a, b]
    if kind == "unix":
        a, b = socket.socketpair()
        return (a.fileno(), a.fileno()), (b.fileno(), b.fileno()), [a, b]
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    return (w1, r2), (w2, r1), []


def round_trips(kind: str, count: int) -> tuple[float, float]:
    """Mean seconds per round trip and parent CPU seconds per round trip."""
    (pw, pr), (cw, cr), keep = _ends(kind)
    pid = os.fork()
    if pid == 0:
        for _ in range(count):
            os.read(cr, 1)
            os.write(cw, b"x")
        os._exit(0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(count):
        os.write(pw, b"x")
        os.read(pr, 1)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.waitpid(pid, 0)
    del keep
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return dt / count, cpu / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="*", default=["tcp", "pipe", "unix"])
    parser.add_argument("--count", type=int, default=20000)
    ns = parser.parse_args()
    for kind in ns.kinds:
        rtt, cpu = round_trips(kind, ns.count)
        print(f"{kind}: round trip {rtt * 1e6:.1f} us, parent CPU {cpu * 1e6:.1f} us")


if __name__ == "__main__":
    main()
