"""Launchers users already have: Open MPI's mpirun, torchrun, and the PMI / Slurm variables.
Each starts real processes that form a group from the environment alone."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aiocollect.testing import free_port

SCRIPT = str(Path(__file__).parents[1] / "support" / "targets" / "env_rank.py")
ROOT = Path(__file__).resolve().parents[2]


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIOCOLLECT_", "OMPI_", "PMI_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    env["PYTHONPATH"] = str(ROOT)
    return env


def _master_port() -> int:
    """A free port P with P + 1 free too (aiocollect's store goes to MASTER_PORT + 1), below
    the kernel's ephemeral range, so that no client connection of torchrun's own (whose
    local ports come from that range) can take P + 1 meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 12000), low - 1), 200):
        try:
            with (
                socket.create_server(("127.0.0.1", port)),
                socket.create_server(("127.0.0.1", port + 1)),
            ):
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair below the ephemeral range")


def _check(out: str, n: int) -> None:
    total = n * (n + 1) / 2
    for r in range(n):
        assert f"rank={r} size={n} sum={total:g}" in out, out


@pytest.mark.timeout(120)
def test_mpirun() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip(
            "mpirun not installed (Debian package openmpi-bin; `make test` installs it as root)"
        )
    env = _clean_env()
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        AIOCOLLECT_STORE=f"tcp://127.0.0.1:{free_port()}",
    )
    proc = subprocess.run(
        [
            mpirun,
            "--oversubscribe",
            "-np",
            "3",
            "-x",
            "AIOCOLLECT_STORE",
            "-x",
            "PYTHONPATH",
            sys.executable,
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(proc.stdout, 3)


@pytest.mark.timeout(180)
def test_torchrun() -> None:
    pytest.importorskip("torch", reason="torch not installed (extra aiocollect[torch])")
    env = _clean_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_master_port()),
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(proc.stdout, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("rank_var", "size_var"),
    [
        ("PMI_RANK", "PMI_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ],
)
def test_scheduler_variables(rank_var: str, size_var: str) -> None:
    store = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(2):
        env = _clean_env()
        env.update({rank_var: str(rank), size_var: "2", "AIOCOLLECT_STORE": store})
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    out = ""
    try:
        for p in procs:
            out += p.communicate(timeout=50)[0]
            assert p.returncode == 0, out
    finally:
        for p in procs:
            p.kill()
    _check(out, 2)
