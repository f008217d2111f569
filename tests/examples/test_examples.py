"""The examples run for real: the parameter server under the launcher, the pytest harness
under pytest."""

from __future__ import annotations

import json
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
def test_parameter_server_under_bulk_load() -> None:
    """The loaded parameter server: pulls through its TCP front alone and while every rank
    runs small bulk allreduces; the report is sane (no speed asserted)."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "aiocollect", "run", "-n", "3"),
            str(ROOT / "examples" / "parameter_server_load.py"),
            *("--bulk", "1M", "--seconds", "1", "--clients", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] alone: " in proc.stdout
    assert "[rank 0] bulk 1M: " in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[rank 0] report: "))
    report = json.loads(line.removeprefix("[rank 0] report: "))
    assert (report["ranks"], report["bulk"]) == (3, 1 << 20)
    assert report["allreduces"] >= 1
    for phase in ("alone", "loaded"):
        got = report[phase]
        assert got["pulls"] >= 3
        assert got["pulls_per_s"] > 0
        assert 0 < got["p50_ms"] <= got["p99_ms"] <= got["max_ms"]


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
