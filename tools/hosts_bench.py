"""Two-level against flat allreduce across namespace hosts: bytes between hosts and time.

Run as root (it builds network namespaces; aiocollect.testing.hosts)::

    python tools/hosts_bench.py                          # 4 hosts x 2 ranks, both placements
    python tools/hosts_bench.py --hosts 2 --per-host 3 --sizes 4,65536,4194304 --iters 10

For each placement (blocked: ranks 0..R-1 on host 0, ...; cyclic: rank r on host r mod H)
it runs two jobs of H x R rank processes (``transport="auto"``: shared memory inside a
host, TCP over the veths between hosts): one counting the bytes that leave every host's
interface during one 16 MiB allreduce per algorithm (the automatic choice, and the flat
``ring``), one timing ``--iters`` allreduces per size and algorithm (median, in ms;
``auto`` and ``ring`` in the same job, alternating per size). It prints a Markdown
table of each (docs/algorithms.md, "Two levels", has the figures of this machine).

``--one SIZE ALGORITHM`` runs one job instead (the first placement): ``--iters``
allreduces of SIZE bytes back to back, every rank printing its p50 and CPU per operation
as ``tools/op_cpu.py`` does, so ``tools/alternate.py`` pairs two algorithms run after
run::

    python tools/alternate.py 6 "python tools/hosts_bench.py --one 16777216 two_level" \\
        "python tools/hosts_bench.py --one 16777216 ring"
"""

from __future__ import annotations

import argparse
import asyncio
import os

from aiocollect.testing import hosts

MODULE = "aiocollect.testing.hosts_rank"
MIB16 = 16 * 1024 * 1024


async def placement_rows(
    kind: str, n_hosts: int, per_host: int, sizes: str, algorithms: str, iters: int
) -> tuple[list[str], list[str]]:
    host_of = hosts.placement(n_hosts, per_host, kind)
    byte_rows, time_rows = [], []
    for algorithm in algorithms.split(","):
        with hosts.Hosts(host_of) as hs:
            res = await hs.run(MODULE, ["bytes", str(MIB16), algorithm], timeout=300)
        total = sum(r["tx_bytes"] for r in res)
        byte_rows.append(
            f"| {kind} | {algorithm} ({res[0]['algorithm']}) | {total / MIB16:.2f} x 16 MiB |"
        )
    with hosts.Hosts(host_of) as hs:
        res = await hs.run(MODULE, ["bench", sizes, algorithms, str(iters)], timeout=600)
    for size, row in res[0]["median_s"].items():
        cells = " | ".join(f"{name}: {t * 1e3:.2f}" for name, t in row.items())
        time_rows.append(f"| {kind} | {size} | {cells} |")
    return byte_rows, time_rows


async def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python tools/hosts_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--placements", default="blocked,cyclic")
    parser.add_argument("--sizes", default="4,65536,4194304,16777216", help="bytes, commas")
    parser.add_argument("--algorithms", default="auto,ring")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "ALGORITHM"))
    args = parser.parse_args()
    why = hosts.unavailable()
    if why is not None:
        raise SystemExit(f"cannot build namespace hosts: {why}")
    hosts.remove_leftovers()
    if args.one is not None:
        host_of = hosts.placement(args.hosts, args.per_host, args.placements.split(",")[0])
        with hosts.Hosts(host_of) as hs:
            res = await hs.run(MODULE, ["opcpu", *args.one, str(args.iters)], timeout=600)
        print("\n".join(r["line"] for r in res))
        return
    byte_rows, time_rows = [], []
    for kind in args.placements.split(","):
        b, t = await placement_rows(
            kind, args.hosts, args.per_host, args.sizes, args.algorithms, args.iters
        )
        byte_rows += b
        time_rows += t
    print(f"{args.hosts} hosts x {args.per_host} ranks, load average {os.getloadavg()[0]:.1f}")
    print("\n| placement | algorithm | bytes between hosts per 16 MiB allreduce |")
    print("|---|---|---|")
    print("\n".join(byte_rows))
    print("\n| placement | bytes | median ms per allreduce |")
    print("|---|---|---|")
    print("\n".join(time_rows))


if __name__ == "__main__":
    asyncio.run(main())
