"""Fixtures of the elastic tests: a standalone store process (`aiocollect store`) that
outlives every member, and the member processes (tests/support/elastic.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.elastic import SECRET, Procs


@pytest.fixture
def store_url() -> Iterator[str]:
    """``tcp://127.0.0.1:PORT`` of a fresh `aiocollect store` (secret SECRET)."""
    env = dict(os.environ, AIOCOLLECT_SECRET=SECRET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocollect", "store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by pytest-timeout
    assert "listening on" in line, line
    address = line.split("listening on ", 1)[1].split()[0]
    try:
        yield f"tcp://{address}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()
