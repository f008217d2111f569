"""The examples run for real: the parameter server under the launcher, the pytest harness
under pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_parameter_server_under_launcher() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiocollect",
            "run",
            "-n",
            "3",
            str(ROOT / "examples" / "parameter_server.py"),
            "--steps",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] server: applied 60 gradients, served 60 pulls" in proc.stdout
    assert "[rank 2] worker 2: 30 steps done" in proc.stdout


@pytest.mark.timeout(120)
def test_pytest_harness_example() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "examples" / "pytest_harness.py"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 passed" in proc.stdout
