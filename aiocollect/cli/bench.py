"""``aiocollect bench``: latency and bus bandwidth of collectives, optionally against gloo.

Usage::

    aiocollect bench [COLLECTIVE ...] -n N [--sizes 4..64M] [--transport tcp]
                     [--compare T] [--iters K] [--warmup W] [--warmup-seconds S]
                     [--rounds R]
                     [--dtype float32] [--algorithm A] [--concurrent K]
                     [--baseline gloo,mpi] [--floor] [--small] [--json F] [--plot F.png]
                     [--store URL --rank R]

By default N rank processes are started on this machine for each round (see
:mod:`aiocollect.bench.runner`). ``--compare T`` also measures aiocollect over transport T
(other than ``--transport``) in every round, between the ``--transport`` ranks and the
baseline, and adds T's p50 and busbw and the busbw ratio ``--transport``/T to the table; a
failing round over T is recorded and the run goes on, as for the baseline. ``--floor``
measures the framework-free floor of every allreduce, sendrecv and barrier case at the end
of every round (:mod:`aiocollect.bench.floor`) and adds its median and aiocollect's p50
over it (``x floor``) to the table. ``--baseline`` names the baselines measured in every
round after aiocollect: ``gloo`` (torch.distributed's gloo backend), ``mpi`` (Open MPI
through mpi4py under ``mpirun``, over shared memory and over TCP: :mod:`aiocollect.bench.mpi`),
both (``gloo,mpi``) or ``none``; one whose software is missing is skipped with a message.
With ``--store
URL --rank R`` this process is rank R of a multi-node run instead: start one such command
per rank (rank 0 hosts the store when nothing listens at URL yet) and rank 0 prints the
report. The timing method is described in :mod:`aiocollect.bench.sweep`, the report in
:mod:`aiocollect.bench.report`.

``--small`` measures small operations, where the time is the library's per-operation
path: 4-byte cases (unless ``--sizes`` says otherwise), ``SMALL_WARMUP`` warm-up
iterations at least (unless ``--warmup`` says otherwise), no event-loop lag probe (its
1 ms wake-ups would run on rank 0 between operations of tens of microseconds), and after
the table each case's CPU time per operation (user and system), of the busiest rank and
of all ranks together: with more ranks than cores the ranks' CPU bounds the wall time,
so it is the steadier figure on a shared machine. For example
``aiocollect bench allreduce broadcast barrier -n 4 --small --transport auto``.

Exit status: 0 on success, 1 when a result was wrong or a rank failed, 2 on bad arguments,
130 when interrupted. Every rank process started is stopped before returning.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from aiocollect.bench import machine, mpi, report
from aiocollect.bench import plot as plotting
from aiocollect.bench.runner import Plan, RoundFailed, run_rounds, start_method
from aiocollect.bench.spec import (
    COLLECTIVES,
    DEFAULT_SIZES,
    DTYPES,
    NO_DATA,
    Case,
    format_size,
    parse_collective,
    parse_size,
    parse_sizes,
)
from aiocollect.bench.stats import median
from aiocollect.bench.sweep import WARMUP_SECONDS, SweepConfig
from aiocollect.bench.worker import RankOptions, aiocollect_rounds, run_loop
from aiocollect.transport import registry

PROG = "aiocollect bench"
#: ``--warmup``'s default, and with ``--small`` its least.
WARMUP = 5
SMALL_WARMUP = 300
#: ``--sizes`` with ``--small``.
SMALL_SIZES = "4"
#: What ``--transport`` and ``--compare`` offer: the registered transports that link
#: processes and need no certificates.
TRANSPORTS = tuple(t.name for t in registry.transports() if not (t.in_process or t.needs_tls))


class UsageFailure(Exception):
    """Bad command-line arguments (exit status 2)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Measure latency (p50/p99) and bus bandwidth of collectives "
        "over a sweep of sizes, optionally against torch.distributed's gloo backend.",
        epilog="Collectives: " + ", ".join(COLLECTIVES) + "; NAME-concurrentK runs K at "
        "once and compares with K in sequence. Sizes: 4, 4K, 1M, ranges A..B (x4 steps) "
        "or A..B:F (xF steps), comma-separated.",
    )
    p.add_argument(
        "collectives",
        nargs="*",
        metavar="COLLECTIVE",
        default=["allreduce"],
        help="collectives to measure (default: allreduce)",
    )
    p.add_argument("-n", "--nproc", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--sizes", help=f"default {DEFAULT_SIZES} ({SMALL_SIZES} with --small)")
    p.add_argument("--transport", default="tcp", choices=TRANSPORTS)
    p.add_argument(
        "--compare",
        choices=TRANSPORTS,
        metavar="TRANSPORT",
        help="also measure aiocollect over this transport (not --transport) in "
        "every round and report busbw ratios; one of " + ", ".join(TRANSPORTS),
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument(
        "--iters",
        type=int,
        help="timed iterations per size (default: adaptive, about --seconds per size, at least 5)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=0.3,
        help="target time per size for adaptive iterations (default 0.3)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        help=f"untimed iterations (default {WARMUP}; {SMALL_WARMUP} with --small)",
    )
    p.add_argument(
        "--warmup-seconds",
        type=float,
        default=WARMUP_SECONDS,
        help=f"and more untimed iterations until this long has passed (default "
        f"{WARMUP_SECONDS:g}; 0: just --warmup)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="repeat the sweep, report medians (default 3)"
    )
    p.add_argument("--algorithm", default="auto", help="passed to the collectives unless auto")
    p.add_argument(
        "--concurrent", type=int, metavar="K", help="run every collective as NAME-concurrentK"
    )
    p.add_argument("--chunk-bytes", help="aiocollect pipelining chunk size (e.g. 1M)")
    p.add_argument(
        "--baseline",
        default="none",
        metavar="B[,B]",
        help="also measure these, comma-separated: gloo (torch.distributed, needs torch), "
        "mpi (Open MPI over shared memory and TCP, needs mpirun and mpi4py), or none "
        "(default)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also measure the framework-free floor of every allreduce, sendrecv and barrier "
        "case in every round (python -m aiocollect.bench.floor) and report aiocollect p50 / "
        "floor",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help=f"small-operation latency: sizes {SMALL_SIZES} unless --sizes, at least "
        f"{SMALL_WARMUP} warm-up iterations, no lag probe, and each case's CPU time per "
        "operation after the table",
    )
    p.add_argument("--json", type=Path, metavar="F", help="write every number to F")
    p.add_argument("--plot", type=Path, metavar="F.png", help="draw bandwidth and latency")
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        help="event loop of the aiocollect ranks (default: uvloop if installed)",
    )
    p.add_argument("--no-lag-probe", action="store_true", help="do not probe loop lag")
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds allowed per round (default 900)"
    )
    p.add_argument("--store", help="join a multi-node run through this store URL")
    p.add_argument("--rank", type=int, help="this process's rank (with --store)")
    return p


def _defaults(ns: argparse.Namespace) -> None:
    """Fill in the defaults of ``--sizes``, ``--warmup`` and the lag probe, which
    ``--small`` changes."""
    if ns.sizes is None:
        ns.sizes = SMALL_SIZES if ns.small else DEFAULT_SIZES
    if ns.warmup is None:
        ns.warmup = SMALL_WARMUP if ns.small else WARMUP
    if ns.small:
        ns.no_lag_probe = True


def _cases(ns: argparse.Namespace) -> list[Case]:
    sizes = parse_sizes(ns.sizes)
    cases = []
    for name in ns.collectives:
        collective, k = parse_collective(name)
        if ns.concurrent is not None:
            k = ns.concurrent
        # a barrier moves no data: one case, whatever the sizes
        cases += [Case(collective, 0 if collective in NO_DATA else size, k) for size in sizes]
    return list(dict.fromkeys(cases))


#: What ``--baseline`` may name.
BASELINES = ("gloo", "mpi", "none")


def _baselines(text: str) -> list[str]:
    """``--baseline``'s names (``none`` alone: none).

    Raises:
        UsageFailure: an unknown name, or ``none`` with others.
    """
    names = list(dict.fromkeys(n.strip() for n in text.split(",")))
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise UsageFailure(
            f"--baseline: unknown {', '.join(map(repr, unknown))} (choose from "
            f"{', '.join(BASELINES)}, comma-separated)"
        )
    if "none" in names and len(names) > 1:
        raise UsageFailure("--baseline none cannot be combined with other baselines")
    return [n for n in names if n != "none"]


def _validate(ns: argparse.Namespace) -> None:
    ns.baselines = _baselines(ns.baseline)
    if ns.nproc < 1:
        raise UsageFailure(f"-n must be at least 1, got {ns.nproc}")
    for name, value, low in (
        ("--iters", ns.iters, 1),
        ("--rounds", ns.rounds, 1),
        ("--warmup", ns.warmup, 0),
        ("--concurrent", ns.concurrent, 2),
    ):
        if value is not None and value < low:
            raise UsageFailure(f"{name} must be at least {low}, got {value}")
    if ns.seconds <= 0 or ns.timeout <= 0:
        raise UsageFailure("--seconds and --timeout must be positive")
    if ns.warmup_seconds < 0:
        raise UsageFailure(f"--warmup-seconds must be at least 0, got {ns.warmup_seconds}")
    if (ns.store is None) != (ns.rank is None):
        raise UsageFailure("--store and --rank go together (joining a multi-node run)")
    if ns.rank is not None and not 0 <= ns.rank < ns.nproc:
        raise UsageFailure(f"--rank must be in [0, {ns.nproc}), got {ns.rank}")
    if ns.store is not None and ns.baselines:
        raise UsageFailure(
            "--baseline is only available when this command spawns the ranks "
            "(not with --store/--rank)"
        )
    if ns.compare is not None and ns.compare == ns.transport:
        raise UsageFailure(
            f"--compare must name a transport other than --transport (both are {ns.transport})"
        )
    if ns.store is not None and ns.compare is not None:
        raise UsageFailure(
            "--compare is only available when this command spawns the ranks "
            "(not with --store/--rank)"
        )
    if ns.floor and ns.store is not None:
        raise UsageFailure(
            "--floor is only available when this command spawns the ranks (not with --store/--rank)"
        )
    if ns.floor and ns.nproc < 2:
        raise UsageFailure("--floor needs at least 2 ranks (-n 2 or more)")
    if ns.plot is not None and not plotting.available():
        raise UsageFailure(plotting.MISSING)


def _plan(ns: argparse.Namespace) -> tuple[Plan, list[Case], str | None]:
    try:
        cases = _cases(ns)
        chunk = None if ns.chunk_bytes is None else parse_size(ns.chunk_bytes)
    except ValueError as exc:
        raise UsageFailure(str(exc)) from None
    if ns.nproc < 2 and any(c.collective == "sendrecv" for c in cases):
        raise UsageFailure(
            "sendrecv needs at least 2 ranks (-n 2 or more): a rank would send to itself"
        )
    notes = []
    baseline = "gloo" if "gloo" in ns.baselines else None
    if baseline == "gloo" and importlib.util.find_spec("torch") is None:
        notes.append(
            "baseline gloo: torch is not installed, so this run has no gloo baseline "
            "(pip install torch, or pip install 'aiocollect[torch]')"
        )
        baseline = None
    with_mpi = "mpi" in ns.baselines
    why = mpi.missing() if with_mpi else None
    if why is not None:
        notes.append(f"baseline mpi: {why}, so this run has no Open MPI baseline")
        with_mpi = False
    for line in notes:
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    note = " ".join(notes) or None
    sweep = SweepConfig(
        cases=cases,
        dtype=ns.dtype,
        warmup=ns.warmup,
        warmup_seconds=ns.warmup_seconds,
        iters=ns.iters,
        seconds=ns.seconds,
        lag_probe=not ns.no_lag_probe,
    )
    options = RankOptions(
        transport=ns.transport,
        chunk_bytes=chunk,
        algorithm=None if ns.algorithm == "auto" else ns.algorithm,
        loop=ns.loop,
    )
    plan = Plan(
        world_size=ns.nproc,
        rounds=ns.rounds,
        sweep=sweep,
        options=options,
        baseline=baseline,
        mpi=with_mpi,
        compare=ns.compare,
        round_timeout=ns.timeout,
        floor=ns.floor,
    )
    if plan.floor and not plan.floor_sizes():
        raise UsageFailure(
            "--floor measures allreduce, sendrecv and barrier run one at a time: add one "
            "of them to the collectives (and leave out --concurrent)"
        )
    return plan, cases, note


def _measure(ns: argparse.Namespace, plan: Plan) -> list[dict[str, Any]] | None:
    """The rounds (None on a non-zero rank of a multi-node run)."""
    if ns.store is None:
        return run_rounds(plan)
    labels = [f"r{i + 1}/{plan.rounds}" for i in range(plan.rounds)]
    results = run_loop(
        plan.options.loop,
        aiocollect_rounds(ns.rank, plan.world_size, ns.store, plan.sweep, plan.options, labels),
    )
    if ns.rank != 0:
        return None
    return [{"round": i + 1, "aiocollect": r} for i, r in enumerate(results)]


def _publish(
    ns: argparse.Namespace,
    argv: Sequence[str],
    plan: Plan,
    cases: list[Case],
    rounds: list[dict[str, Any]],
    note: str | None,
    load_start: list[float] | None,
    load: dict[str, Any] | None = None,
) -> bool:
    """Print the table, write JSON and plot; True when every result was correct."""
    rows = report.aggregate(rounds, cases, plan.world_size, plan.compare)
    idle = [
        r["aiocollect"]["idle_lag_us"]["p99"]
        for r in rounds
        if r.get("aiocollect", {}).get("idle_lag_us")
    ]
    meta = {
        "world_size": plan.world_size,
        "transport": ns.transport,
        "dtype": ns.dtype,
        "rounds": plan.rounds,
        "baseline_note": note,
        "idle_lag_p99_ms": median(idle) / 1000 if idle else float("nan"),
        "load_warning": load["warning"] if load else None,
        # the group's chunk size (chosen at rendezvous unless --chunk-bytes gave it)
        "chunk_bytes": rounds[0].get("aiocollect", {}).get("chunk_bytes") if rounds else None,
        "chunk_given": plan.options.chunk_bytes is not None,
        # how this run started its aiocollect ranks (None: the user did, across nodes)
        "start_method": None if ns.store is not None else start_method(plan),
    }
    print(report.format_tables(rows, meta), flush=True)
    if ns.small:
        print(_cpu_lines(rows, plan.world_size), flush=True)
    if meta["load_warning"]:
        print(f"{PROG}: WARNING: {meta['load_warning']}", file=sys.stderr)
    ok = report.all_correct(rows)
    loop = rounds[0].get("aiocollect", {}).get("loop", ns.loop) if rounds else ns.loop
    if ns.json is not None:
        doc = {
            "tool": PROG,
            "command": shlex.join(["aiocollect", "bench", *argv]),
            "machine": {**machine.machine_info(loop), "loadavg_start": load_start},
            "config": {
                "world_size": plan.world_size,
                "transport": ns.transport,
                "dtype": ns.dtype,
                "sizes": sorted({c.size for c in cases}),
                "collectives": list(dict.fromkeys(c.name for c in cases)),
                "rounds": plan.rounds,
                "iters": ns.iters,
                "warmup": ns.warmup,
                "warmup_seconds": ns.warmup_seconds,
                "seconds": ns.seconds,
                "algorithm": ns.algorithm,
                "chunk_bytes": plan.options.chunk_bytes,
                "chunk_bytes_used": meta["chunk_bytes"],
                "loop": loop,
                "baseline": ns.baseline,
                "baseline_used": plan.baseline,
                "mpi_used": list(mpi.LEGS) if plan.mpi else [],
                "baseline_note": note,
                "multi_node": ns.store is not None,
                "floor": plan.floor,
                "small": ns.small,
                "start_method": meta["start_method"],
                **({"compare": plan.compare} if plan.compare else {}),
            },
            "load": load,
            "load_warning": meta["load_warning"],
            "ok": ok,
            "summary": rows,
            "rounds": rounds,
        }
        ns.json.write_text(json.dumps(machine.clean(doc), separators=(",", ":")))
        print(f"{PROG}: wrote {ns.json}", file=sys.stderr)
    if ns.plot is not None:
        title = (
            f"aiocollect bench: {plan.world_size} ranks, "
            f"{report.over(ns.transport, plan.compare)}, {ns.dtype}, "
            f"median of {plan.rounds} rounds"
        )
        loads = load or {}
        plotting.plot(
            rows,
            ns.plot,
            title,
            ns.transport,
            footer=plotting.footer(machine.machine_info(loop)["date"], loads),
        )
        print(f"{PROG}: wrote {ns.plot}", file=sys.stderr)
    if not ok:
        print(f"{PROG}: WRONG RESULTS (see the check column)", file=sys.stderr)
    return ok


def _cpu_lines(rows: list[dict[str, Any]], world_size: int) -> str:
    """``--small``'s lines after the table: each case's CPU time per operation."""
    lines = ["CPU per operation (user + system, median over rounds):"]
    for row in rows:
        got = row.get("aiocollect") or {}
        what = row["name"] + ("" if row["size"] == 0 else f" {format_size(row['size'])}B")
        if "cpu_max_us" not in got:
            lines.append(f"  {what}: -")
            continue
        lines.append(
            f"  {what}: busiest rank {got['cpu_max_us']:.1f} us, all {world_size} ranks "
            f"{got['cpu_sum_us']:.1f} us"
        )
    return "\n".join(lines)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    del frame
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def bench_main(argv: list[str]) -> int:
    """Run ``aiocollect bench`` with ``argv`` (the arguments after ``bench``); returns the
    exit status (0 ok, 1 wrong result or failed rank, 2 bad arguments, 130 interrupted)."""
    parser = _parser()
    try:
        ns = parser.parse_args(argv)
        _defaults(ns)
        _validate(ns)
        plan, cases, note = _plan(ns)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except UsageFailure as exc:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    sizes = sorted({c.size for c in cases})
    print(
        f"{PROG}: {plan.world_size} ranks, {report.over(ns.transport, plan.compare)}, "
        f"{ns.dtype}, "
        f"{len(sizes)} sizes {format_size(sizes[0])}..{format_size(sizes[-1])}, "
        f"{', '.join(dict.fromkeys(c.name for c in cases))}, {plan.rounds} rounds"
        + (f", baseline {plan.baseline}" if plan.baseline else "")
        + (", baseline Open MPI (shm, tcp)" if plan.mpi else "")
        + (", floor" if plan.floor else ""),
        file=sys.stderr,
        flush=True,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        load_start = machine.load_average()
        with machine.LoadWatch(ranks=plan.world_size if ns.store is None else 1) as watch:
            rounds = _measure(ns, plan)
        if rounds is None:
            return 0
        return (
            0 if _publish(ns, argv, plan, cases, rounds, note, load_start, watch.summary()) else 1
        )
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; rank processes stopped", file=sys.stderr)
        return 130
    except RoundFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if ns.store is None:
            raise
        print(f"{PROG}: rank {ns.rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
