"""Runs examples/elastic_trainer.py for real: 4 workers, one SIGKILLed mid-training, a
replacement admitted; every live rank ends with identical weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "elastic_trainer.py"


@pytest.mark.timeout(90)
def test_elastic_trainer_loses_a_worker_and_takes_a_replacement() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOCOLLECT_")}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "worker 2 died" in out, out
    assert "redoing step 12" in out, out
    assert "[joiner] admitted as rank 3 of 4" in out, out
    assert "done: 4 live ranks" in out, out
    assert "weights identical on every rank" in out, out
