"""``python -m aiocollect.bench.hol`` end to end: the real command in a subprocess, with
small sizes. Nothing here asserts speed: only that it runs over each kind of link
(TLS with the throw-away certificates it makes) and reports sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiocollect.transport import cma


def run_hol(tmp_path: Path, transport: str, *extra: str) -> dict[str, Any]:
    """Run the command for two ranks with small sizes; its JSON report (also checked
    against what ``--json`` wrote)."""
    out = tmp_path / "hol.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "aiocollect.bench.hol", "-n", "2", "--transport", transport),
            *("--size", "2M", "--allreduces", "3", "--idle-pings", "20", "--json", str(out)),
            *extra,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert report == json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["auto", "tcp", "tls"])
def test_hol_reports_round_trips_and_bandwidth(transport: str, tmp_path: Path) -> None:
    report = run_hol(tmp_path, transport)
    assert report["transport"] == transport
    assert report["start_method"] == "fork"  # the default: as aiocollect run starts ranks
    assert report["world_size"] == 2
    assert report["idle_rtt_us"]["n"] == 20
    assert report["idle_rtt_us"]["p50"] > 0
    assert report["loaded_rtt_us"]["n"] >= 1
    assert report["loaded_rtt_us"]["p99"] > 0
    assert report["busbw_gbps_alone"] > 0
    assert report["busbw_gbps_with_pings"] > 0
    assert "floor_loaded_rtt_us" not in report
    assert report["launcher"] == "spawn"
    assert report["loop"] == "uvloop"
    assert report["requesters"] == 1
    assert report["requests_per_s_alone"] > 0
    assert len(report["lag_us_with_pings"]) == 2


@pytest.mark.timeout(180)
def test_hol_with_exec_started_ranks(tmp_path: Path) -> None:
    report = run_hol(tmp_path, "auto", "--start-method", "exec")
    assert report["start_method"] == "exec"
    assert report["loaded_rtt_us"]["n"] >= 1


def check_requesters(report: dict[str, Any], ranks: int, requesters: int) -> None:
    """The many-requester entries: every requester's idle round trips, a rate alone and
    under load, and every rank's loop lag in both bulk phases."""
    assert report["world_size"] == ranks
    assert report["requesters"] == requesters
    assert report["idle_rtt_us"]["n"] == 20 * requesters
    assert report["loaded_rtt_us"]["n"] >= requesters
    assert report["requests_per_s_alone"] > 0
    assert report["requests_per_s_loaded"] > 0
    for phase in ("lag_us_bulk_alone", "lag_us_with_pings"):
        assert len(report[phase]) == ranks
        assert all(rank["p99"] >= 0 for rank in report[phase] if rank["n"])
    assert report["busbw_gbps_with_pings"] > 0


@pytest.mark.timeout(180)
def test_hol_many_requesters_plain_asyncio(tmp_path: Path) -> None:
    """``--requesters 3`` among 3 ranks spread over both workers, on plain asyncio."""
    report = run_hol(tmp_path, "tcp", "-n", "3", "--requesters", "3", "--loop", "asyncio")
    assert report["loop"] == "asyncio"
    check_requesters(report, 3, 3)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["exec", "fork"])
def test_hol_ranks_started_by_aiocollect_run(method: str, tmp_path: Path) -> None:
    """``--launcher run``: the ranks are the ones ``aiocollect run`` starts, both ways."""
    report = run_hol(
        tmp_path,
        "auto",
        *("--launcher", "run", "--start-method", method, "--requesters", "2"),
        *("--loop", "asyncio" if method == "exec" else "uvloop"),
    )
    assert (report["launcher"], report["start_method"]) == ("run", method)
    check_requesters(report, 2, 2)


def test_hol_refuses_tls_under_the_launcher(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aiocollect.bench.hol", "--transport", "tls", "--launcher", "run"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--transport tls needs --launcher spawn" in proc.stderr


@pytest.mark.timeout(180)
def test_hol_with_the_floor(tmp_path: Path) -> None:
    """``--floor`` adds the framework-free run's round trips, lag and bandwidth (or says
    why it could not run)."""
    report = run_hol(tmp_path, "auto", "--floor")
    assert report["loaded_rtt_us"]["n"] >= 1
    if cma.self_check() is not None:
        assert "floor_error" in report
        return
    assert report["floor_loaded_rtt_us"]["n"] >= 1
    assert report["floor_loaded_rtt_us"]["p99"] > 0
    assert report["floor_lag_us"]["n"] >= 0
    assert report["floor_busbw_gbps"] > 0
