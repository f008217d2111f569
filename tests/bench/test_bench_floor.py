"""``aiocollect bench --floor``: the framework-free floor of every allreduce size (sendrecv and
barrier: test_bench_sendrecv.py), measured
in every round after the other backends, and aiocollect's p50 over it.

End to end through the real command (rank processes and the floor's own forked ranks) on
tiny sizes; the report and the plot through synthetic rounds. Nothing asserts speed: only
that the floor ran with the method its size calls for, that the ratio is the one of the
reported medians, and that what it cannot measure says why instead of a number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiocollect.bench import floor, report
from aiocollect.bench import plot as plotting
from aiocollect.bench.spec import Case
from aiocollect.cli import bench
from tests.support.bench import (
    CASES,
    META,
    SMOKE,
    capture_figures,
    needs_mpl,
    needs_pulls,
    positive,
    run_bench,
    synthetic_rounds,
    table_of,
)


def _run_with_floor(tmp_path: Path, *args: str, rounds: int = 1) -> tuple[Any, dict[str, Any]]:
    """``aiocollect bench ARGS --floor`` over the default transport, tiny iteration counts,
    ``rounds`` rounds; the finished process (exit status checked) and its JSON document."""
    out = tmp_path / "bench.json"
    done = run_bench(
        *args,
        "--transport",
        "auto",
        *SMOKE,
        "--rounds",
        str(rounds),
        "--floor",
        "--json",
        str(out),
        cwd=tmp_path,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    return done, json.loads(out.read_text())


@needs_pulls
@pytest.mark.timeout(120)
def test_floor_columns_json_and_ratio(tmp_path: Path) -> None:
    done, doc = _run_with_floor(
        tmp_path, "allreduce", "broadcast", "-n", "2", "--sizes", "4,1M", rounds=2
    )
    assert "[floor r2/2] allreduce sizes 4,1048576" in done.stderr
    head, body = table_of(done.stdout, "allreduce: 2 ranks")
    assert head[-4:] == ["floor", "x floor", "rounds", "check"]
    assert len(body) == 2
    assert all(line[-1] == "ok" for line in body)
    assert "floor: the framework-free operation of the same bytes" in done.stdout
    # broadcast has no floor: its table is the plain one
    head_b, _ = table_of(done.stdout, "broadcast: 2 ranks")
    assert "floor" not in head_b
    assert doc["config"]["floor"] is True
    assert all(
        [r["size"] for r in entry["floor"]["records"]] == [4, 1 << 20] for entry in doc["rounds"]
    )
    rows = {(r["name"], r["size"]): r for r in doc["summary"]}
    small, large = rows[("allreduce", 4)], rows[("allreduce", 1 << 20)]
    assert (small["floor_method"], large["floor_method"]) == ("latency", "bandwidth")
    assert (small["floor_bytes"], large["floor_bytes"]) == (4, 1 << 20)
    for row in (small, large):
        assert row["floor_rounds"] == 2
        assert positive(row["floor_us"])
        per_round = sorted(
            r["us"]
            for e in doc["rounds"]
            for r in e["floor"]["records"]
            if r["size"] == row["size"]
        )
        assert row["floor_us"] == pytest.approx(sum(per_round) / 2)  # the median of two
        assert row["floor_ratio"] == pytest.approx(row["aiocollect"]["p50_us"] / row["floor_us"])
        # the same runs' other statistic (each iteration's slowest rank) is never lower
        assert row["floor_each_us"] >= row["floor_us"]
        assert row["floor_each_ratio"] == pytest.approx(
            row["aiocollect"]["p50_us"] / row["floor_each_us"]
        )
        # aiocollect's own slowest-rank median: never above its p50 in any round (the
        # median of per-iteration maxima bounds every rank's median), and its ratio
        for rec in (
            r for e in doc["rounds"] for r in e["aiocollect"]["records"] if r["name"] == "allreduce"
        ):
            assert 0 < rec["rank_p50_us"] <= float(np.median(rec["times_us"])) + 0.1
        assert row["floor_rank_ratio"] == pytest.approx(
            row["aiocollect"]["rank_p50_us"] / row["floor_us"]
        )
        assert row["floor_rank_ratio"] <= row["floor_ratio"] + 1e-6
    assert "x floor with one statistic on both sides" in done.stdout
    assert "allreduce 4 " in done.stdout.split("x floor with one statistic")[1]
    assert "floor_us" not in rows[("broadcast", 4)]


@pytest.mark.timeout(120)
def test_floor_that_cannot_measure_says_why(tmp_path: Path) -> None:
    """Three ranks: recursive doubling needs a power of two, so the 4-byte floor is '-'
    with the reason under the table, and the run still succeeds."""
    done, doc = _run_with_floor(tmp_path, "allreduce", "-n", "3", "--sizes", "4")
    _, body = table_of(done.stdout, "allreduce: 3 ranks")
    assert body[0][-4:-1] == ["-", "-", "-"]
    assert "floor not measured ('-'): recursive doubling needs a power-of-two" in done.stdout
    (row,) = doc["summary"]
    assert row["floor_us"] is None
    assert row["floor_ratio"] is None
    assert "power-of-two" in row["floor_error"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["broadcast", "--floor"], "--floor measures allreduce, sendrecv and barrier"),
        (["allreduce", "--floor", "--concurrent", "2"], "--floor measures allreduce"),
        (["barrier", "--floor", "--concurrent", "2"], "--floor measures allreduce"),
        (["allreduce", "--floor", "-n", "1"], "at least 2 ranks"),
        (["sendrecv", "-n", "1"], "sendrecv needs at least 2 ranks"),
        (
            ["allreduce", "--floor", "--store", "tcp://127.0.0.1:1", "--rank", "0"],
            "only available when this command spawns",
        ),
    ],
)
def test_floor_usage_errors(args: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.bench_main(args) == 2
    assert why in capsys.readouterr().err


# -- the report, from synthetic rounds -----------------------------------------------------


def _with_floor(records: list[list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
    """``synthetic_rounds(False)`` with a floor entry per round (None: its floor failed)."""
    rounds = synthetic_rounds(False)
    for entry, recs in zip(rounds, records, strict=True):
        entry["floor"] = {"error": "boom"} if recs is None else {"records": recs}
    return rounds


def test_report_takes_the_median_floor_and_the_ratio_of_medians() -> None:
    rounds = _with_floor(
        [
            [{"size": 4, "method": "latency", "bytes": 4, "us": 10.0}],
            [{"size": 4, "method": "latency", "bytes": 4, "us": 30.0}],
        ]
    )
    rows = report.aggregate(rounds, CASES, 2)
    by = {(r["size"], r["concurrency"]): r for r in rows}
    row = by[(4, 1)]
    assert row["floor_us"] == 20.0
    assert row["floor_method"] == "latency"
    assert row["floor_rounds"] == 2
    assert row["floor_ratio"] == pytest.approx(row["aiocollect"]["p50_us"] / 20.0)
    # and each round's own ratio (the synthetic rounds' p50s are 110 and 165 µs)
    assert row["floor_ratio_rounds"] == pytest.approx([110.0 / 10.0, 165.0 / 30.0])
    # 64K was not in the floor's records: '-' with a reason; concurrent rows have none
    assert by[(65536, 1)]["floor_ratio"] != by[(65536, 1)]["floor_ratio"]  # NaN
    assert by[(65536, 1)]["floor_error"] == "the floor did not run"
    assert "floor_us" not in by[(65536, 2)]
    table = report.format_tables(rows, META)
    assert "20.0us" in table
    assert "5.50-11.00" in table  # the lowest and highest round: 165/30 and 110/10
    assert "x floor" in table
    assert "floor not measured ('-'): the floor did not run." in table


def test_report_survives_a_failed_floor_round() -> None:
    rounds = _with_floor([None, [{"size": 4, "method": "latency", "bytes": 4, "us": 8.0}]])
    row = report.aggregate(rounds, [Case("allreduce", 4)], 2)[0]
    assert row["floor_ratio_rounds"] == pytest.approx([165.0 / 8.0])
    assert row["floor_us"] == 8.0
    assert row["floor_rounds"] == 1


def test_report_when_every_floor_round_failed() -> None:
    rows = report.aggregate(_with_floor([None, None]), [Case("allreduce", 4)], 2)
    assert rows[0]["floor_rounds"] == 0
    assert rows[0]["floor_error"] == "the floor did not run"
    assert "floor not measured ('-')" in report.format_tables(rows, META)


def test_report_without_floor_is_unchanged() -> None:
    rows = report.aggregate(synthetic_rounds(False), CASES, 2)
    assert all("floor_us" not in r for r in rows)
    assert "x floor" not in report.format_tables(rows, META)


@needs_mpl
@pytest.mark.timeout(60)
def test_plot_draws_the_floor_and_its_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figs = capture_figures(monkeypatch)
    rounds = _with_floor([[{"size": 4, "method": "latency", "bytes": 4, "us": 50.0}]] * 2)
    rows = report.aggregate(rounds, CASES, 2)
    plotting.plot(rows, tmp_path / "b.png", "t")
    ratio, _, small, _ = figs[0]["axes"]
    (line, _one) = ratio["lines"]
    assert line[0] == "allreduce: aiocollect / floor"
    row = next(r for r in rows if r["size"] == 4 and r["concurrency"] == 1)
    assert line[2][0] == pytest.approx(1 / row["floor_ratio"])
    floor_lines = [ln for ln in small["lines"] if "floor" in ln[0]]
    assert floor_lines
    assert floor_lines[0][1:3] == ([4], [50.0])


# -- the floor's size rules ---------------------------------------------------------------


def test_floor_method_by_size() -> None:
    assert floor.method(4) == "latency"
    assert floor.method(floor.BULK_MIN - 1) == "latency"
    assert floor.method(floor.BULK_MIN) == "bandwidth"


@pytest.mark.timeout(60)
def test_latency_floor_of_a_larger_payload_checks_its_sums() -> None:
    """Real forked ranks exchange 4 KiB by recursive doubling; every rank checks that each
    element is the rank count (a wrong sum raises)."""
    assert floor.latency(2, 50, 4096).seconds > 0
    how, nbytes, t = floor.measure(4, 4098)
    assert (how, nbytes) == ("latency", 4096)
    assert 0 < t.seconds <= t.each
    with pytest.raises(ValueError, match="multiple of 4"):
        floor.latency(2, 5, 6)
    with pytest.raises(ValueError, match="power-of-two"):
        floor.measure(3, 4)


@needs_pulls
@pytest.mark.timeout(60)
def test_bandwidth_floor_rounds_to_whole_blocks() -> None:
    how, nbytes, t = floor.measure(3, (1 << 20) + 5)
    assert how == "bandwidth"
    assert nbytes % 12 == 0
    assert (1 << 20) - 12 < nbytes <= 1 << 20
    assert 0 < t.seconds <= t.each
