"""Head-of-line blocking: small send/recv round trips while bulk allreduces run.

``python -m aiocollect.bench.hol -n 2 --transport tcp --size 64M --allreduces 8``

Every rank runs ``--allreduces`` back-to-back allreduces of ``--size`` bytes; meanwhile
``--requesters`` coroutines on rank 0 each send ``--ping`` bytes to a worker rank and wait
for them back, over and over, on the same group (so on the same links): the small
requests of a parameter server. Before that it times the same round trips with the group
idle, and the allreduces alone, so the report has, from one run: the round trip's p50/p99
and the requests per second idle and under load, bulk bandwidth with and without the
requests, and every rank's event-loop lag p99 during the allreduces
(:mod:`aiocollect.bench.hol_ranks` says what exactly). Prints one JSON line (``--json F``
also writes it).

How the ranks start:

- ``--launcher spawn`` (the default): the bench's own ranks
  (:func:`aiocollect.testing.spawn.spawn_ranks`), from a fork server that imported
  aiocollect (``--start-method fork``) or as fresh interpreters (``exec``);
- ``--launcher run``: as users start theirs, ``aiocollect run -n N --start-method M
  -m aiocollect.bench.hol_ranks`` (forked from the launcher, or exec'd).

``--loop uvloop`` (the default) or ``asyncio`` (plain :func:`asyncio.run`) picks the
ranks' event loop.

``--transport tls`` runs the measurement on a TLS group (mutual certificate
authentication) opened beside the spawned one, with throw-away certificates made for the
run (:mod:`aiocollect.testing.certs`: the ``cryptography`` package or the ``openssl``
command); it needs ``--launcher spawn``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiocollect.bench.hol_ranks import busbw, hol_rank, summary
from aiocollect.bench.machine import load_average
from aiocollect.bench.spec import parse_size

if TYPE_CHECKING:
    from aiocollect.group import Group
    from aiocollect.testing.certs import Certs


async def tls_hol_rank(
    group: Group,
    certs: Certs,
    size: int,
    allreduces: int,
    ping: int,
    idle_pings: int,
    requesters: int,
) -> dict[str, Any] | None:
    """:func:`hol_rank` on a TLS group opened beside ``group``."""
    from aiocollect.api import open_group

    async with open_group(
        group.rank,
        group.world_size,
        store=group.store,
        transport="tls",
        ssl=certs.config(group.rank),
        name="bench-hol-tls",
        timeout=600.0,
    ) as t:
        return await hol_rank(t, size, allreduces, ping, idle_pings, requesters)


def _floor_report(n: int, size: int, allreduces: int, ping: int) -> dict[str, Any]:
    """The head-of-line floor's entries for the report (:mod:`aiocollect.bench.hol_floor`):
    its round trip's p50/p99/max, its lag p50/p99 and its bus bandwidth; ``floor_error``
    instead where it cannot run here."""
    from aiocollect.bench import hol_floor

    nbytes = size - size % (4 * n)
    try:
        floor = hol_floor.measure(n, nbytes, allreduces, ping)
    except (ValueError, OSError, RuntimeError) as exc:
        return {"floor_error": str(exc)}
    return {
        "floor_loaded_rtt_us": summary(floor.rtt_us, top=True),
        "floor_lag_us": summary(floor.lag_us),
        "floor_busbw_gbps": busbw(n, nbytes * allreduces, floor.bulk_seconds),
    }


def _spawned(ns: argparse.Namespace, method: str, sizes: tuple[int, ...], tmp: str) -> Any:
    """Rank 0's report from ranks started by ``spawn_ranks`` (``--launcher spawn``)."""
    from aiocollect.testing.certs import make_certs
    from aiocollect.testing.spawn import spawn_ranks

    async def run() -> list[Any]:
        if ns.transport == "tls":
            certs = make_certs(Path(tmp), ns.nproc)
            target: Any = tls_hol_rank
            args: tuple[Any, ...] = (certs, *sizes)
            options: dict[str, Any] = {}
        else:
            target, args, options = hol_rank, sizes, {"transport": ns.transport}
        results: list[Any] = await spawn_ranks(
            ns.nproc,
            target,
            *args,
            timeout=600.0,
            uvloop=ns.loop == "uvloop",
            start_method="forkserver" if method == "fork" else "spawn",
            **options,
        )
        return results

    return asyncio.run(run())[0]


def _launched(ns: argparse.Namespace, method: str, tmp: str) -> Any:
    """Rank 0's report from ranks started by ``aiocollect run`` (``--launcher run``).

    Raises:
        RuntimeError: the job failed (its output's tail says why).
    """
    out = Path(tmp) / "report.json"
    cmd = [
        *(sys.executable, "-m", "aiocollect", "run", "-n", str(ns.nproc)),
        *("--start-method", method, "--transport", ns.transport, "--timeout", "900"),
        *("-m", "aiocollect.bench.hol_ranks", "--size", ns.size, "--ping", ns.ping),
        *("--allreduces", str(ns.allreduces), "--idle-pings", str(ns.idle_pings)),
        *("--requesters", str(ns.requesters), "--loop", ns.loop, "--out", str(out)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"aiocollect run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement and print its JSON line."""
    from aiocollect.cli.forked import default_start_method

    p = argparse.ArgumentParser(prog="python -m aiocollect.bench.hol")
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--transport", default="tcp", help="auto, tcp, shm or tls")
    p.add_argument("--size", default="64M")
    p.add_argument("--allreduces", type=int, default=8)
    p.add_argument("--ping", default="1K")
    p.add_argument("--idle-pings", type=int, default=300, help="round trips per requester")
    p.add_argument("--requesters", type=int, default=1, help="concurrent requesters on rank 0")
    p.add_argument(
        "--floor",
        action="store_true",
        help="then the same measurement with no framework (aiocollect.bench.hol_floor)",
    )
    p.add_argument(
        "--start-method",
        choices=("fork", "exec"),
        default=None,
        help="fork the ranks from a process that imported aiocollect (as aiocollect run "
        "does by default) or start fresh interpreters (default: $AIOCOLLECT_START_METHOD, "
        "else fork)",
    )
    p.add_argument(
        "--launcher",
        choices=("spawn", "run"),
        default="spawn",
        help="the bench's own ranks, or the ranks aiocollect run starts (as users run them)",
    )
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="the ranks' event loop: uvloop.run or plain asyncio.run",
    )
    p.add_argument("--json", type=Path)
    ns = p.parse_args(argv)
    method = ns.start_method or default_start_method()
    if ns.nproc < 2:
        p.error("-n must be at least 2")
    if ns.requesters < 1:
        p.error("--requesters must be at least 1")
    if ns.transport == "tls" and ns.launcher == "run":
        p.error("--transport tls needs --launcher spawn")
    start = load_average()
    sizes = (parse_size(ns.size), ns.allreduces, parse_size(ns.ping), ns.idle_pings)
    with tempfile.TemporaryDirectory(prefix="aiocollect-hol-") as tmp:
        if ns.launcher == "run":
            result = _launched(ns, method, tmp)
        else:
            result = _spawned(ns, method, (*sizes, ns.requesters), tmp)
    report = {
        **result,
        "transport": ns.transport,
        "start_method": method,
        "launcher": ns.launcher,
        "loop": ns.loop,
    }
    if ns.floor:
        report.update(_floor_report(ns.nproc, *sizes[:3]))
    report.update(loadavg_start=start, loadavg_end=load_average())
    text = json.dumps(report)
    print(text)
    if ns.json is not None:
        ns.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
