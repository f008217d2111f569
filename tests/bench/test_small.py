"""``aiocollect bench --small``: the small-operation mode's defaults, its CPU lines, its JSON.

The end-to-end test runs the real command in a subprocess (seconds long); nothing here
asserts speed, only that the mode measures what it says with the defaults it says.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiocollect.bench import report
from aiocollect.bench.spec import DEFAULT_SIZES, Case
from aiocollect.bench.stats import summarize
from aiocollect.cli import bench


def _resolved(*args: str) -> argparse.Namespace:
    ns = bench._parser().parse_args(list(args))
    bench._defaults(ns)
    return ns


def test_small_changes_only_the_defaults_it_names() -> None:
    plain = _resolved("allreduce")
    assert (plain.sizes, plain.warmup, plain.no_lag_probe) == (DEFAULT_SIZES, bench.WARMUP, False)
    small = _resolved("allreduce", "--small")
    assert (small.sizes, small.warmup, small.no_lag_probe) == (
        bench.SMALL_SIZES,
        bench.SMALL_WARMUP,
        True,
    )
    given = _resolved("allreduce", "--small", "--sizes", "4,4K", "--warmup", "20")
    assert (given.sizes, given.warmup) == ("4,4K", 20)


def test_cpu_per_operation_is_summarized_and_combined_over_rounds() -> None:
    record = {
        "collective": "allreduce",
        "name": "allreduce",
        "size": 4,
        "bytes": 4,
        "times_us": [10.0, 12.0, 11.0],
        "mean_us": 11.0,
        "correct": True,
        "algorithm": "star",
        "cpu_us": [20.0, 30.0],
    }
    got = summarize(record, 2)
    assert (got["cpu_max_us"], got["cpu_sum_us"]) == (30.0, 50.0)
    assert "cpu_max_us" not in summarize({**record, "cpu_us": None}, 2)
    other = {**record, "cpu_us": [40.0, 50.0]}
    rounds = [
        {"round": i + 1, "aiocollect": {"records": [r]}}
        for i, r in enumerate([record, other, record])
    ]
    (row,) = report.aggregate(rounds, [Case("allreduce", 4)], 2)
    assert (row["aiocollect"]["cpu_max_us"], row["aiocollect"]["cpu_sum_us"]) == (30.0, 50.0)
    lines = bench._cpu_lines([row], 2)
    assert "allreduce 4B: busiest rank 30.0 us, all 2 ranks 50.0 us" in lines


@pytest.mark.timeout(120)
def test_small_mode_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    args = ["allreduce", "barrier", "-n", "2", "--small", "--rounds", "1", "--iters", "50"]
    done = subprocess.run(
        [sys.executable, "-m", "aiocollect", "bench", *args, "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "CPU per operation (user + system, median over rounds):" in done.stdout
    assert "allreduce 4B: busiest rank" in done.stdout
    assert "barrier: busiest rank" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["small"] is True
    assert doc["config"]["sizes"] == [0, 4]
    assert doc["config"]["warmup"] == bench.SMALL_WARMUP
    records = doc["rounds"][0]["aiocollect"]["records"]
    assert {r["name"] for r in records} == {"allreduce", "barrier"}
    for rec in records:
        assert rec["lag_us"] is None
        assert len(rec["cpu_us"]) == 2
        assert all(c > 0 for c in rec["cpu_us"])
        assert rec["warmup_iters"] >= bench.SMALL_WARMUP
