"""examples/soak_kill.py still runs: two short runs, each survivor names the victim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_soak_kill_two_runs(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "examples/soak_kill.py", "--runs", "2", "--seed", "3", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "run   2/2" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed_runs"] == 0
    assert summary["survivor_samples"] == 6
    assert summary["max_ms"] < 5000, summary  # by the socket, not a deadline
