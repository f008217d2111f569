"""Runs examples/data_parallel.py for real: 2 processes over TCP, a few epochs.

Uses the ``aiocollect run`` launcher when it is available, else starts the ranks itself with
AIOCOLLECT_RANK / AIOCOLLECT_WORLD_SIZE / AIOCOLLECT_STORE.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiocollect.testing import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"
WORLD = 2
EPOCHS = 3
ARGS = ["--epochs", str(EPOCHS), "--bench-iters", "5"]
DEADLINE = 100.0  # seconds for the whole run (the test's own timeout is 120)
EPOCH_LINE = re.compile(r"epoch\s+(\d+)/(\d+)\s+loss\s+([0-9.]+)\s+train acc\s+([0-9.]+)%")
# Variables that would make the ranks join some other group.
FOREIGN = (
    "AIOCOLLECT_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_",
    "PMI_",
    "SLURM_",
)


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr of every rank


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}


def _have_launcher() -> bool:
    try:
        return importlib.util.find_spec("aiocollect.cli.main") is not None
    except ImportError:
        return False


def _run_with_launcher() -> Run:
    proc = subprocess.run(
        [sys.executable, "-m", "aiocollect", "run", "-n", str(WORLD), str(SCRIPT), *ARGS],
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    return Run(proc.returncode, proc.stdout)


def _run_by_hand() -> Run:
    store = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(WORLD):
        env = _clean_env() | {
            "AIOCOLLECT_RANK": str(rank),
            "AIOCOLLECT_WORLD_SIZE": str(WORLD),
            "AIOCOLLECT_STORE": store,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), *ARGS],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs, codes = [], []
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=DEADLINE)
            outputs.append("".join(f"[{rank}] {line}\n" for line in out.splitlines()))
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Run(max(codes, key=abs), "".join(outputs))


@pytest.fixture(scope="module")
def run() -> Run:
    return _run_with_launcher() if _have_launcher() else _run_by_hand()


@pytest.mark.timeout(120)
def test_trains_and_ends_with_identical_weights(run: Run) -> None:
    assert run.returncode == 0, f"example failed (exit {run.returncode}):\n{run.output}"
    epochs = [m.groups() for m in EPOCH_LINE.finditer(run.output)]
    assert [(int(e), int(total)) for e, total, *_ in epochs] == [
        (e, EPOCHS) for e in range(1, EPOCHS + 1)
    ], run.output  # printed once, by rank 0
    losses = [float(loss) for *_, loss, _ in epochs]
    assert losses[-1] < 0.7 * losses[0], run.output
    assert float(epochs[-1][3]) > float(epochs[0][3]), run.output  # accuracy went up
    assert f"weights identical on all {WORLD} ranks" in run.output, run.output
    assert re.search(r"bus bandwidth [0-9.]+ MB/s", run.output), run.output


@pytest.mark.timeout(120)
def test_output_is_clean(run: Run) -> None:
    """The main demo must not spill tracebacks or asyncio error logs, even at shutdown."""
    assert "Traceback" not in run.output, run.output
    assert "Exception in callback" not in run.output, run.output
