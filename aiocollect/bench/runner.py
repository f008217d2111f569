"""Running the rounds: one set of rank processes per backend and round, interleaved.

Round i runs aiocollect's ranks over ``--transport``, then (with ``--compare T``)
aiocollect's ranks over transport T, then (with the gloo baseline) gloo's ranks, then
(with the MPI baseline) Open MPI's over shared memory and over TCP, then (with
``--floor``) the framework-free floor of every allreduce, sendrecv and barrier case
(``python -m aiocollect.bench.floor measure``), then round i+1, so that slow phases of a
shared, noisy machine hit every backend alike. Every rank is a
``python -m aiocollect.bench.worker`` subprocess (forked from one such process, or under
``mpirun`` for Open MPI: :mod:`aiocollect.bench.mpi`); whatever happens (a failing rank, a
timeout, Ctrl-C), every process started here is terminated and reaped before returning.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiocollect.bench import mpi
from aiocollect.bench.floor import FLOORED
from aiocollect.bench.sweep import SweepConfig
from aiocollect.bench.worker import RankOptions, encode
from aiocollect.cli.forked import default_start_method
from aiocollect.testing.spawn import free_port

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
GRACE = 3.0
#: Seconds the other ranks get to finish after one has failed.
FAIL_GRACE = 5.0


class RoundFailed(Exception):
    """A rank of a round failed, or the round ran past its deadline."""


@dataclass(frozen=True)
class Plan:
    """Everything ``aiocollect bench`` runs in spawn mode."""

    world_size: int
    rounds: int
    sweep: SweepConfig
    options: RankOptions
    baseline: str | None = None
    #: Open MPI as a baseline too, over shared memory and TCP (``mpi.LEGS``).
    mpi: bool = False
    #: A second aiocollect transport measured in every round (``--compare``).
    compare: str | None = None
    round_timeout: float = 900.0
    env: dict[str, str] = field(default_factory=dict)
    #: Measure the framework-free floor of every case that has one in every round.
    floor: bool = False

    def floor_sizes(self) -> dict[str, list[int]]:
        """The sizes whose floor ``--floor`` measures, by collective: those of the cases
        run one at a time whose collective has a floor (``floor.FLOORED``: allreduce,
        sendrecv, barrier; a floor runs one at a time)."""
        out: dict[str, list[int]] = {}
        for c in self.sweep.cases:
            if c.collective in FLOORED and c.concurrency == 1:
                out.setdefault(c.collective, []).append(c.size)
        return {coll: sorted(set(sizes)) for coll, sizes in out.items()}


def rank_env(extra: dict[str, str]) -> dict[str, str]:
    """Our environment, one BLAS/OpenMP thread per rank (like ``aiocollect run``)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass(frozen=True)
class _Leg:
    """One set of ranks run in every round: its key in the round entry, the worker's
    backend, the rank options and the tag of its progress lines."""

    key: str
    backend: str
    options: RankOptions
    name: str


def _legs(plan: Plan) -> list[_Leg]:
    """What one round runs, in order: aiocollect, the compared transport, the baselines."""
    main = plan.options
    legs = [
        _Leg(
            "aiocollect",
            "aiocollect",
            main,
            f"aiocollect/{main.transport}" if plan.compare else "aiocollect",
        )
    ]
    if plan.compare:
        legs.append(
            _Leg(
                "compare",
                "aiocollect",
                replace(main, transport=plan.compare),
                f"aiocollect/{plan.compare}",
            )
        )
    if plan.baseline:
        legs.append(_Leg(plan.baseline, plan.baseline, main, plan.baseline))
    if plan.mpi:
        legs += [_Leg(key, key, main, label) for key, (label, _) in mpi.LEGS.items()]
    return legs


def run_rounds(plan: Plan) -> list[dict[str, Any]]:
    """All rounds, interleaved across backends: ``[{"round": i, "aiocollect": result,
    "compare": result, "gloo": result, "mpi_shm": result, "mpi_tcp": result, "floor":
    {"records": [...]}}, …]``, ``"compare"`` only with ``plan.compare``, ``"gloo"`` and
    the ``mpi`` entries only with those baselines and ``"floor"`` only with
    ``plan.floor`` (see :func:`run_floor`; ``{"error": …}`` for a round whose floor
    failed, which the run goes on without).

    In each round aiocollect runs over ``plan.options.transport``, then over
    ``plan.compare``, then the baseline runs. The compared transport is treated like the
    baseline: a round of it that fails is reported on stderr, recorded as
    ``{"error": …}`` and the run goes on (its table columns then show the other rounds'
    medians, or ``-``); only a failing round over ``--transport`` ends the run. The
    ``"compare"`` entry, result or error, also holds ``"transport": plan.compare``.

    Raises:
        RoundFailed: an aiocollect round over ``--transport`` failed.
    """
    legs = _legs(plan)
    rounds: list[dict[str, Any]] = []
    for i in range(plan.rounds):
        entry: dict[str, Any] = {"round": i + 1}
        label = f"r{i + 1}/{plan.rounds}"
        for leg in legs:
            result: dict[str, Any]
            try:
                result = run_round(plan, leg.backend, label, options=leg.options, name=leg.name)
            except RoundFailed as exc:
                if leg.key == "aiocollect":
                    raise
                role = "compared" if leg.key == "compare" else "baseline"
                print(
                    f"aiocollect bench: {leg.name} {role} round {label} failed: {exc}; "
                    "continuing without it",
                    file=sys.stderr,
                    flush=True,
                )
                result = {"error": str(exc)}
            if leg.key == "compare":
                result["transport"] = plan.compare
            entry[leg.key] = result
        if plan.floor and plan.floor_sizes():
            try:
                entry["floor"] = {"records": run_floor(plan, label)}
            except RoundFailed as exc:
                print(
                    f"aiocollect bench: floor round {label} failed: {exc}; continuing without it",
                    file=sys.stderr,
                    flush=True,
                )
                entry["floor"] = {"error": str(exc)}
        rounds.append(entry)
    return rounds


def run_floor(plan: Plan, label: str) -> list[dict[str, Any]]:
    """The framework-free floor of every case in ``plan.floor_sizes()`` among
    ``world_size`` ranks, measured in a subprocess per collective, one after the other
    (``python -m aiocollect.bench.floor measure --collective C``): one record per case,
    ``{"collective", "size", "method", "bytes", "us"}``, or ``{"collective", "size",
    "error"}`` where the floor cannot measure it (say, the allreduce's latency floor with
    a rank count that is not a power of two).

    Raises:
        RoundFailed: a floor process failed or ran past the round's deadline.
    """
    records: list[dict[str, Any]] = []
    for collective, wanted in plan.floor_sizes().items():
        sizes = ",".join(str(s) for s in wanted)
        print(f"[floor {label}] {collective} sizes {sizes}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="aiocollect-floor-") as tmp:
            result = Path(tmp) / "floor.json"
            cmd = [sys.executable, "-m", "aiocollect.bench.floor", "measure"]
            cmd += ["-n", str(plan.world_size), "--collective", collective]
            cmd += ["--sizes", sizes, "--json", str(result)]
            records += _collect(
                [cmd], rank_env(plan.env), plan.round_timeout, f"floor round {label}", result
            )
    return records


def _collect(
    cmds: list[list[str]], env: dict[str, str], timeout: float, what: str, result: Path
) -> Any:
    """Run ``cmds`` at once (their stdout to our stderr: our stdout is the table), wait
    for all of them (:func:`wait_all`), stop and reap them on every path, and return the
    JSON they left in ``result``.

    Raises:
        RoundFailed: one failed, ``timeout`` passed, or ``result`` was not written.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd in cmds:
            procs.append(
                subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno())
            )
        wait_all(procs, timeout, what)
    finally:
        stop_all(procs)
    if not result.exists():
        raise RoundFailed(f"{what}: no result was written")
    return json.loads(result.read_text())


def run_round(
    plan: Plan,
    backend: str,
    label: str,
    *,
    options: RankOptions | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Start ``world_size`` ranks of ``backend``, wait for them, return rank 0's result.

    ``options`` replaces ``plan.options`` (e.g. another transport); ``name`` tags the
    progress lines and messages (default: ``backend``).
    """
    config = encode(plan.sweep, options or plan.options)
    what = name or backend
    env = rank_env(plan.env)
    if backend in mpi.LEGS:  # one mpirun starts the ranks
        with tempfile.TemporaryDirectory(prefix="aiocollect-bench-") as tmp:
            result = Path(tmp) / "rank0.json"
            args = ["--config", config, "--label", label, "--result", str(result)]
            args += ["--name", what]
            cmd = mpi.command(backend, plan.world_size, args)
            mpi_rounds: list[dict[str, Any]] = _collect(
                [cmd], mpi.environment(env), plan.round_timeout, f"{what} round {label}", result
            )
            return mpi_rounds[0]
    with tempfile.TemporaryDirectory(prefix="aiocollect-bench-") as tmp:
        result = Path(tmp) / "rank0.json"
        # The aiocollect store URL, or torch.distributed's init_method: the same form.
        rendezvous = f"tcp://127.0.0.1:{free_port()}"
        ranks = [
            worker_args(backend, rank, plan.world_size, rendezvous, config, label, result, name)
            for rank in range(plan.world_size)
        ]
        if backend == "aiocollect" and start_method(plan) == "fork":
            cmds = [forked_command(ranks)]
        else:
            cmds = [worker_command(args) for args in ranks]
        rounds: list[dict[str, Any]] = _collect(
            cmds, env, plan.round_timeout, f"{what} round {label}", result
        )
        return rounds[0]


def start_method(plan: Plan) -> str:
    """How this run starts its aiocollect ranks: ``fork`` or ``exec``, as ``aiocollect
    run`` would with the ranks' environment (``AIOCOLLECT_START_METHOD``)."""
    return default_start_method(rank_env(plan.env))


def worker_args(
    backend: str,
    rank: int,
    world_size: int,
    rendezvous: str,
    config: str,
    label: str,
    result: Path,
    name: str | None = None,
) -> list[str]:
    """The arguments of one rank's ``aiocollect.bench.worker`` (without ``--parent``:
    whoever starts it adds its own pid)."""
    args = ["--backend", backend, "--rank", str(rank), "--world-size", str(world_size)]
    args += ["--rendezvous", rendezvous, "--config", config, "--label", label]
    args += ["--result", str(result)]
    if name is not None and name != backend:
        args += ["--name", name]
    return args


def worker_command(args: list[str]) -> list[str]:
    """The command line of a rank with ``args`` (:func:`worker_args`), started by this
    process: the rank exits on its own once this process is gone (``--parent``)."""
    return [sys.executable, "-m", "aiocollect.bench.worker", *args, "--parent", str(os.getpid())]


def forked_command(ranks: list[list[str]]) -> list[str]:
    """One command that forks ranks with these worker arguments (:func:`worker_args`) from
    a process that imported aiocollect (``aiocollect.bench.forked``), as ``aiocollect run``
    starts them by default."""
    parent = ["--parent", str(os.getpid())]
    return [sys.executable, "-m", "aiocollect.bench.forked", *parent, json.dumps(ranks)]


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    """Wait until every process exited 0.

    Raises:
        RoundFailed: one exited non-zero (the others get ``FAIL_GRACE`` seconds, then are
            stopped), or ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if all(code is not None for code in codes):
            break
        now = time.monotonic()
        if bad and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > FAIL_GRACE:
            break
        if now > deadline:
            raise RoundFailed(f"{what} did not finish within {timeout:g} s")
        time.sleep(0.05)
    bad = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
    if bad:
        text = ", ".join(f"rank {rank} exited with status {code}" for rank, code in bad)
        raise RoundFailed(f"{what}: {text} (see its messages above)")


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate (then kill) every process still running, and reap them all."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                p.terminate()
    deadline = time.monotonic() + GRACE
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                p.kill()
            p.wait()
