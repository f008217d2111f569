"""Plain helpers for the command-line tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

RunCli = Callable[..., "subprocess.CompletedProcess[str]"]
"""The ``run_cli`` fixture: ``run_cli(*args, timeout=60.0)``."""
WriteScript = Callable[[str, str], Path]
"""The ``write_script`` fixture: ``write_script(name, source) -> path``."""

PID_LINE = re.compile(r"^\[rank (\d+)\] pid (\d+)$", re.MULTILINE)


def cli_command(*args: str) -> list[str]:
    """``python -m aiocollect ARGS`` with this interpreter."""
    return [sys.executable, "-m", "aiocollect", *args]


def rank_pids(stdout: str) -> dict[int, int]:
    """``{rank: pid}`` from the ``[rank R] pid P`` lines the test scripts print first."""
    return {int(rank): int(pid) for rank, pid in PID_LINE.findall(stdout)}


def assert_all_gone(pids: dict[int, int]) -> None:
    """Every process in ``pids`` has exited (and been reaped by the launcher)."""
    for rank, pid in pids.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"rank {rank} (pid {pid}) survived the launcher")
