"""Running a script under real ``torchrun`` (``python -m torch.distributed.run``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Variables that would make the ranks join some other job.
FOREIGN = (
    "AIOCOLLECT_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "OMPI_COMM_WORLD_",
    "PMI_",
    "SLURM_",
)


@dataclass
class Run:
    returncode: int
    output: str  # torchrun's and every rank's stdout and stderr


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 90.0) -> Run:
    """Run ``script`` with ``torchrun --standalone --nproc-per-node nproc``; kill the whole
    process tree if it runs past ``timeout`` seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--monitor-interval",
        "0.1",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return Run(-9, f"{out}\n*** killed after {timeout} s ***")
    return Run(proc.returncode, out)


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])
