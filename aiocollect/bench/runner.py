"""Running the rounds: one set of rank processes per backend and round, interleaved.

Round i runs aiocollect's ranks, then (with a baseline) gloo's ranks, then round i+1, so
that slow phases of a shared, noisy machine hit both libraries alike. Every rank is a
``python -m aiocollect.bench.worker`` subprocess; whatever happens (a failing rank, a
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiocollect.bench.sweep import SweepConfig
from aiocollect.bench.worker import RankOptions, encode
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
    round_timeout: float = 900.0
    env: dict[str, str] = field(default_factory=dict)


def rank_env(extra: dict[str, str]) -> dict[str, str]:
    """Our environment, one BLAS/OpenMP thread per rank (like ``aiocollect run``)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_rounds(plan: Plan) -> list[dict[str, Any]]:
    """All rounds, interleaved across backends: ``[{"round": i, "aiocollect": result,
    "gloo": result or {"error": …}}, …]``.

    Raises:
        RoundFailed: an aiocollect round failed (a failing baseline round is recorded).
    """
    backends = ["aiocollect"] + ([plan.baseline] if plan.baseline else [])
    rounds: list[dict[str, Any]] = []
    for i in range(plan.rounds):
        entry: dict[str, Any] = {"round": i + 1}
        label = f"r{i + 1}/{plan.rounds}"
        for backend in backends:
            try:
                entry[backend] = run_round(plan, backend, label)
            except RoundFailed as exc:
                if backend == "aiocollect":
                    raise
                print(f"aiocollect bench: {backend} baseline round {label} failed: {exc}; "
                      "continuing without it", file=sys.stderr, flush=True)
                entry[backend] = {"error": str(exc)}
        rounds.append(entry)
    return rounds


def run_round(plan: Plan, backend: str, label: str) -> dict[str, Any]:
    """Start ``world_size`` ranks of ``backend``, wait for them, return rank 0's result."""
    config = encode(plan.sweep, plan.options)
    env = rank_env(plan.env)
    with tempfile.TemporaryDirectory(prefix="aiocollect-bench-") as tmp:
        result = Path(tmp) / "rank0.json"
        # The aiocollect store URL, or torch.distributed's init_method: the same form.
        rendezvous = f"tcp://127.0.0.1:{free_port()}"
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(plan.world_size):
                cmd = [sys.executable, "-m", "aiocollect.bench.worker", "--backend", backend,
                       "--rank", str(rank), "--world-size", str(plan.world_size),
                       "--rendezvous", rendezvous, "--config", config, "--label", label,
                       "--result", str(result)]
                # Worker stdout goes to our stderr: our stdout is the table.
                procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                              stdout=sys.stderr.fileno()))
            wait_all(procs, plan.round_timeout, f"{backend} round {label}")
        finally:
            stop_all(procs)
        if not result.exists():
            raise RoundFailed(f"{backend} round {label}: rank 0 wrote no result")
        rounds: list[dict[str, Any]] = json.loads(result.read_text())
        return rounds[0]


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
    bad = [(rank, p.returncode) for rank, p in enumerate(procs)
           if p.returncode not in (None, 0)]
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
