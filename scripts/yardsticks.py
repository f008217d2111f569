"""The floor, two minimal event-loop exchanges and aiocollect, in both statistics, alternated.

    python scripts/yardsticks.py 6                 # 4 ranks, 4 bytes, six rounds
    python scripts/yardsticks.py 6 -n 2 --size 4K
    python scripts/yardsticks.py 6 --barrier      # empty frames against the barrier floor

``aiocollect bench --floor`` divides its p50 (the median over iterations of each
iteration's slowest rank) by the floor's slowest rank's median, a smaller statistic of the
floor's own run (docs/benchmarks.md, *Eighteenth session*). Issue 17's four-rank target is
2x the floor in that column. This script asks what the column would read for the least an
event loop can do, in the same minutes: each round runs, in an order that alternates from
round to round,

- the floor (``aiocollect.bench.floor.latency``: blocking recursive doubling over Unix
  socket pairs, no event loop),
- ``scripts/minimal_exchange.py N --unix --json`` with and without ``--star`` (uvloop, one
  ``BufferedProtocol`` per Unix socket pair, a 16-byte header, no checks, no deadlines,
  no failure handling: the least an asyncio program does per message), and the star with
  ``--checked`` (each frame's fingerprint and length compared, each operation entered in
  a registry and an in-flight table: the least of what aiocollect's contract asks),
- ``aiocollect bench allreduce -n N --transport auto --sizes S --rounds 1 --baseline none``,

(with ``--barrier``: the barrier floor, a dissemination barrier over blocking socket
pairs; the minimal exchanges with empty frames; ``aiocollect bench barrier``) and prints,
per series, the median over rounds of both statistics and of the bench
column's ratio (per-iteration statistic over the floor's slowest-rank median) and the
like-for-like ratio (per-iteration over per-iteration). A yardstick; not part of
aiocollect.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from aiocollect.bench.floor import barrier, latency
from aiocollect.bench.spec import parse_size

HERE = Path(__file__).resolve().parent


def _minimal(n: int, star: bool, nbytes: int, checked: bool = False) -> tuple[float, float]:
    if nbytes % 4 or nbytes > 16384:  # (0: empty frames, the barrier's)
        raise SystemExit("minimal_exchange.py sends float32 elements, at most 16 KiB")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        cmd = [sys.executable, str(HERE / "minimal_exchange.py"), str(n), "--unix", "--json", out]
        cmd += ["--count", str(nbytes // 4)]
        cmd += (["--star"] if star else []) + (["--checked"] if checked else [])
        subprocess.run(cmd, check=True, capture_output=True)
        d = json.loads(Path(out).read_text())
    return d["each_us"], d["rank_us"]


def _library(n: int, nbytes: int, collective: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "b.json")
        cmd = [sys.executable, "-m", "aiocollect", "bench", collective, "-n", str(n)]
        cmd += ["--transport", "auto", "--sizes", str(max(nbytes, 4)), "--rounds", "1"]
        cmd += ["--baseline", "none", "--no-lag-probe", "--json", out]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        rec = json.loads(Path(out).read_text())["summary"][0]["aiocollect"]
    return rec["p50_us"], rec["rank_p50_us"]


def _floor(n: int, nbytes: int) -> tuple[float, float]:
    f = latency(n, nbytes=nbytes) if nbytes else barrier(n)
    return f.each * 1e6, f.seconds * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("rounds", type=int)
    ap.add_argument("-n", type=int, default=4, help="ranks (a power of two: the floor)")
    ap.add_argument("--size", default="4", help="bytes per allreduce (default 4)")
    ap.add_argument("--barrier", action="store_true", help="barriers: empty frames")
    args = ap.parse_args(argv)
    n, nbytes = args.n, 0 if args.barrier else parse_size(args.size)
    collective = "barrier" if args.barrier else "allreduce"
    if not nbytes and not args.barrier:
        raise SystemExit("--size must be at least 4 bytes (--barrier for empty frames)")
    series: dict[str, Callable[[], tuple[float, float]]] = {
        "floor (blocking)": lambda: _floor(n, nbytes),
        "minimal asyncio star": lambda: _minimal(n, True, nbytes),
        "minimal asyncio doubling": lambda: _minimal(n, False, nbytes),
        "checked minimal star": lambda: _minimal(n, True, nbytes, checked=True),
        "aiocollect (auto)": lambda: _library(n, nbytes, collective),
    }
    names = list(series)
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    floors: list[tuple[float, float]] = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        this: dict[str, tuple[float, float]] = {}
        for name in order:
            this[name] = series[name]()
            got[name].append(this[name])
        floors.append(this[names[0]])
        print(
            f"round {r + 1}: "
            + ", ".join(f"{k.split(' (')[0]} {v[0]:.1f}/{v[1]:.1f}" for k, v in this.items()),
            flush=True,
        )
    what = "barrier" if args.barrier else f"allreduce, {nbytes} B"
    print(f"\n{n} ranks, {what}; per series the medians over {args.rounds} rounds:")
    print("per-iteration p50 / slowest rank's median (µs); x floor: the bench's column,")
    print("then per-iteration over the floor's per-iteration")
    for name in names:
        each = [e for e, _ in got[name]]
        rank = [k for _, k in got[name]]
        column = [e / f[1] for (e, _), f in zip(got[name], floors, strict=True)]
        alike = [e / f[0] for (e, _), f in zip(got[name], floors, strict=True)]
        print(
            f"  {name:28s} {statistics.median(each):7.1f} / {statistics.median(rank):7.1f}"
            f"   x floor {statistics.median(column):5.2f} ({min(column):.2f}-{max(column):.2f})"
            f"   like-for-like {statistics.median(alike):5.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
