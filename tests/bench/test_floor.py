"""``python -m aiocollect.bench.floor``: the framework-free floors run real processes,
check their results, report positive numbers and reject bad arguments.

Nothing here asserts speed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiocollect.bench import floor
from aiocollect.transport import cma
from tests.support.bench import needs_pulls


def run_floor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiocollect.bench.floor", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
        check=False,
    )


@needs_pulls
@pytest.mark.timeout(120)
def test_bandwidth_floor_runs_and_reports(tmp_path: Path) -> None:
    done = run_floor(
        "bandwidth",
        "-n",
        "2,4",
        "--sizes",
        "64K,1M",
        "--chunk",
        "16K",
        "--iters",
        "3",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    for line in lines:
        m = re.fullmatch(
            r"floor allreduce N=(\d) (\d+)MiB \(chunk 16KiB\): ([\d.]+) ms, "
            r"busbw ([\d.]+) GB/s",
            line,
        )
        assert m is not None, line
        assert float(m.group(3)) > 0
        assert float(m.group(4)) >= 0


@pytest.mark.timeout(120)
def test_latency_floor_runs_and_reports(tmp_path: Path) -> None:
    done = run_floor("latency", "-n", "2,4", "--iters", "200", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = [
        re.fullmatch(r"floor allreduce N=(\d) 4B: p50 (\d+) us", line)
        for line in done.stdout.splitlines()
    ]
    assert [m.group(1) for m in got if m] == ["2", "4"], done.stdout
    assert all(m is not None and int(m.group(2)) > 0 for m in got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args",
    [["latency", "-n", "3"], ["bandwidth", "-n", "2", "--sizes", "6"], ["bandwidth", "-n", "1"]],
)
def test_bad_arguments_exit_1_with_a_reason(tmp_path: Path, args: list[str]) -> None:
    done = run_floor(*args, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("floor: "), done.stderr


@needs_pulls
@pytest.mark.timeout(60)
def test_a_wrong_result_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: pulls that copy nothing leave every rank with the wrong sums, which
    the ranks' own check reports (the forked ranks inherit the patch)."""
    parent, real = os.getpid(), cma.pull

    def pull(pid: int, dst: memoryview, src: int) -> None:
        if os.getpid() == parent:  # the run's own probe of process_vm_readv
            real(pid, dst, src)

    monkeypatch.setattr(cma, "pull", pull)
    with pytest.raises(RuntimeError, match=r"wrong result on rank\(s\) \[0, 1\]"):
        floor.bandwidth(2, 1 << 16, 1 << 14, iters=2)


@needs_pulls
@pytest.mark.timeout(60)
def test_a_dead_rank_fails_the_run_promptly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fault injection: one rank dies (a real exit, from inside its first pull) while the
    others go on to a barrier it never reaches; the run ends with an error within seconds
    instead of leaving them waiting."""
    parent, real = os.getpid(), cma.pull
    marker = str(tmp_path / "died")

    def pull(pid: int, dst: memoryview, src: int) -> None:
        if os.getpid() != parent:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass  # another rank is the one that dies
            else:
                os._exit(7)
        real(pid, dst, src)

    monkeypatch.setattr(cma, "pull", pull)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a rank failed: exit codes .*7"):
        floor.bandwidth(4, 1 << 16, 1 << 14, iters=2)
    assert time.monotonic() - start < 10
