"""``aiocollect bench --baseline mpi``: Open MPI (mpi4py under mpirun) beside aiocollect.

The end-to-end test runs the real ``mpirun`` for a few iterations (skipped, with the
reason, where mpirun or mpi4py is missing); the others need neither: the skip message, the
argument checks, and the report's MPI columns from synthetic rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiocollect.bench import mpi, report
from aiocollect.cli import bench
from tests.support.bench import CASES, META, SMOKE, positive, run_bench, synthetic_rounds, table_of

MISSING = mpi.missing()
#: No warm-up by time, and the MPI baseline.
QUICK = ("--warmup-seconds", "0", "--baseline", "mpi")


@pytest.mark.skipif(MISSING is not None, reason=f"no MPI baseline here: {MISSING}")
@pytest.mark.timeout(120)
def test_mpi_baseline_beside_aiocollect(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["allreduce", "barrier", "-n", "2", "--sizes", "4", *SMOKE, "--warmup-seconds", "0"]
    done = run_bench(*args, "--baseline", "mpi", "--json", str(out), cwd=tmp_path, timeout=110)
    assert done.returncode == 0, done.stderr
    head, body = table_of(done.stdout, "allreduce: 2 ranks")
    assert head[-7:] == [
        "mpi shm p50",
        "mpi shm GB/s",
        "x mpi shm",
        "mpi tcp p50",
        "mpi tcp GB/s",
        "x mpi tcp",
        "check",
    ]
    assert [line[-1] for line in body] == ["ok"]
    assert "[mpi shm r1/1 allreduce 4] 3 iters" in done.stderr
    assert "[mpi tcp r1/1 barrier 0] 3 iters" in done.stderr
    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    assert doc["config"]["mpi_used"] == ["mpi_shm", "mpi_tcp"]
    for row in doc["summary"]:
        for leg in ("mpi_shm", "mpi_tcp"):
            assert row[leg]["correct"] is True, (row["name"], leg)
            assert positive(row[leg]["p50_us"])
            assert positive(row[f"{leg}_lat_ratio"])
    assert {r["mpi_shm"]["rounds"] for r in doc["summary"]} == {1}


@pytest.mark.timeout(60)
def test_missing_mpirun_is_skipped_with_a_message(tmp_path: Path) -> None:
    # A PATH without mpirun (the command is started through sys.executable's full path).
    env = {**os.environ, "PATH": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiocollect",
            "bench",
            "-n",
            "2",
            "--sizes",
            "4",
            *SMOKE,
            "--warmup-seconds",
            "0",
            "--baseline",
            "mpi",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "baseline mpi: mpirun is not on PATH" in done.stderr
    assert "mpi shm" not in done.stdout
    assert "no Open MPI baseline" in done.stdout  # the note under the table


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("openmpi", "--baseline: unknown 'openmpi'"),
        ("none,mpi", "--baseline none cannot be combined"),
    ],
)
def test_bad_baselines_exit_2(value: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.bench_main(["allreduce", "--baseline", value]) == 2
    assert why in capsys.readouterr().err


def test_mpi_baseline_needs_spawned_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--baseline", "mpi", "--store", "tcp://127.0.0.1:1", "--rank", "0"]
    assert bench.bench_main(args) == 2
    assert "only available when this command spawns" in capsys.readouterr().err


def _with_mpi(correct: bool = True) -> list[dict[str, Any]]:
    """Synthetic rounds whose Open MPI shared-memory leg takes a quarter of aiocollect's
    time and whose TCP leg failed in the first round."""
    rounds = synthetic_rounds(False)
    for entry in rounds:
        fast = json.loads(json.dumps(entry["aiocollect"]))
        for rec in fast["records"]:
            rec["times_us"] = [t / 4 for t in rec["times_us"]]
            rec["mean_us"] /= 4
            rec["correct"] = correct
        entry["mpi_shm"] = fast
        entry["mpi_tcp"] = {"error": "boom"} if entry["round"] == 1 else fast
    return rounds


def test_report_has_the_ratio_of_medians_per_mpi_leg() -> None:
    rows = report.aggregate(_with_mpi(), CASES, 2)
    one = rows[0]
    assert one["mpi_shm_lat_ratio"] == pytest.approx(4.0)
    assert one["mpi_shm_bw_ratio"] == pytest.approx(0.25)
    assert one["mpi_tcp"]["rounds"] == 1  # the failed round is left out
    assert report.all_correct(rows)
    text = report.format_tables(rows, META)
    head, body = table_of(text, "allreduce: 2 ranks")
    assert "x mpi shm" in head
    assert "x mpi tcp" in head
    assert body[0][head.index("x mpi shm")] == "4.00x"
    assert "mpi shm conc/seq" in text  # the concurrent case's table
    assert "x mpi: aiocollect p50 / Open MPI p50" in text


def test_report_flags_a_wrong_mpi_result() -> None:
    rows = report.aggregate(_with_mpi(correct=False), CASES, 2)
    assert not report.all_correct(rows)
    assert "ok (mpi shm, mpi tcp WRONG)" in report.format_tables(rows, META)


def test_rounds_without_mpi_have_no_mpi_columns() -> None:
    rows = report.aggregate(synthetic_rounds(True), CASES, 2)
    assert not any("mpi_shm" in row for row in rows)
    assert "mpi" not in report.format_tables(rows, META)
