"""``aiocollect bench --compare TRANSPORT``: a second aiocollect transport in every round.

The end-to-end tests run the real command (rank processes through the bench runner) on
tiny sizes; nothing asserts speed, only that the compared transport's columns, JSON entries
and ratios are there, consistent and sane. The unit tests pin the table without
``--compare`` to its format before the option existed.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from aiocollect.bench import plot as plotting
from aiocollect.bench import report
from aiocollect.bench.runner import Plan, run_rounds
from aiocollect.bench.spec import Case
from aiocollect.bench.stats import median, summarize
from aiocollect.bench.sweep import SweepConfig
from aiocollect.bench.worker import RankOptions
from aiocollect.cli import bench
from tests.support.bench import (
    CASES,
    META,
    SMOKE,
    positive,
    run_bench,
    synthetic_rounds,
    table_of,
)

#: The columns of a plain (concurrency 1) table without --compare or --baseline.
PLAIN_HEADER = [
    "size",
    "algorithm",
    "iters",
    "p50",
    "p99",
    "mean",
    "busbw GB/s",
    "lag p99 ms",
    "rss+ MiB",
    "check",
]


def _check_compare_row(row: dict[str, Any], transport: str) -> None:
    ac, cmp = row["aiocollect"], row["compare"]
    assert row["compare_transport"] == transport
    assert cmp is not None
    assert cmp["correct"] is True
    assert cmp["iters"] >= 3
    for key in ("p50_us", "p99_us", "mean_us", "busbw_gbps"):
        assert positive(cmp[key]), (row["name"], row["size"], key, cmp[key])
    assert cmp["p99_us"] >= cmp["p50_us"]
    assert row["compare_algorithm"]
    # The ratios are those of the reported medians.
    assert row["compare_bw_ratio"] == pytest.approx(ac["busbw_gbps"] / cmp["busbw_gbps"], rel=1e-12)
    assert row["compare_lat_ratio"] == pytest.approx(ac["p50_us"] / cmp["p50_us"], rel=1e-12)


# -- end to end: real rank processes ------------------------------------------------------


@pytest.mark.timeout(90)
def test_compare_columns_json_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench(
        "allreduce",
        "-n",
        "2",
        "--sizes",
        "4,64K",
        *SMOKE,
        "--transport",
        "shm",
        "--compare",
        "tcp",
        "--json",
        str(out),
        cwd=tmp_path,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr
    title = "allreduce: 2 ranks, shm vs tcp, float32, ranks forked, median of 1 rounds"
    assert title in done.stdout
    header, body = table_of(done.stdout, "allreduce: ")
    assert header == [*PLAIN_HEADER[:-1], "tcp p50", "tcp GB/s", "shm/tcp bw", "check"]
    assert "shm/tcp bw: busbw over shm / busbw over tcp" in done.stdout
    assert "(>1 favours shm)" in done.stdout
    # Progress lines name their transport; per round shm comes before tcp.
    shm_at = done.stderr.index("[aiocollect/shm r1/1 allreduce 64K] 3 iters")
    tcp_at = done.stderr.index("[aiocollect/tcp r1/1 allreduce 64K] 3 iters")
    assert shm_at < tcp_at
    assert "[aiocollect r1/1" not in done.stderr

    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    assert doc["config"]["transport"] == "shm"
    assert doc["config"]["compare"] == "tcp"
    rows = doc["summary"]
    assert [r["size"] for r in rows] == [4, 65536]
    for row, cells in zip(rows, body, strict=True):
        _check_compare_row(row, "tcp")
        assert len(cells) == len(header)
        assert cells[header.index("size")] == ("4" if row["size"] == 4 else "64K")
        # The table prints the JSON's medians and ratio.
        assert cells[header.index("shm/tcp bw")] == f"{row['compare_bw_ratio']:.2f}x"
        assert cells[header.index("tcp GB/s")] == f"{row['compare']['busbw_gbps']:.3f}"
        assert cells[header.index("check")] == "ok"
    (round1,) = doc["rounds"]
    assert round1["compare"]["transport"] == "tcp"
    assert round1["compare"]["backend"] == "aiocollect"
    records = round1["compare"]["records"]
    assert [r["size"] for r in records] == [4, 65536]
    assert all(r["correct"] and len(r["times_us"]) == 3 for r in records)


@pytest.mark.timeout(120)
def test_compare_rounds_interleave_and_use_medians(tmp_path: Path) -> None:
    """Two rounds (with the gloo baseline when torch is there): the order per round is
    --transport, --compare, baseline; the summary holds the medians over rounds."""
    gloo = importlib.util.find_spec("torch") is not None
    out = tmp_path / "bench.json"
    done = run_bench(
        "allreduce",
        "-n",
        "2",
        "--sizes",
        "4K",
        "--rounds",
        "2",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--transport",
        "tcp",
        "--compare",
        "shm",
        *(("--baseline", "gloo") if gloo else ()),
        "--json",
        str(out),
        cwd=tmp_path,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    tags = re.findall(r"^\[(\S+) (r\d/2) allreduce 4K\]", done.stderr, re.MULTILINE)
    per_round = ["aiocollect/tcp", "aiocollect/shm", *(["gloo"] if gloo else [])]
    assert tags == [(tag, f"r{i}/2") for i in (1, 2) for tag in per_round]
    header, _ = table_of(done.stdout, "allreduce: ")
    compare_cols = ["shm p50", "shm GB/s", "tcp/shm bw"]
    gloo_cols = ["gloo p50", "gloo GB/s", "bw ratio", "lat ratio"] if gloo else []
    assert header == [*PLAIN_HEADER[:-1], *compare_cols, *gloo_cols, "check"]

    doc = json.loads(out.read_text())
    assert [list(r) for r in doc["rounds"]] == [
        ["round", "aiocollect", "compare", *(["gloo"] if gloo else [])]
    ] * 2
    (row,) = doc["summary"]
    _check_compare_row(row, "shm")
    for key, backend in (("aiocollect", "aiocollect"), ("compare", "compare")):
        sums = [summarize(r[backend]["records"][0], 2) for r in doc["rounds"]]
        assert row[key]["busbw_gbps"] == pytest.approx(median([s["busbw_gbps"] for s in sums]))
        assert row[key]["p50_us"] == pytest.approx(median([s["p50_us"] for s in sums]))
    if gloo:
        assert row["gloo"]["correct"] is True
        assert positive(row["bw_ratio"])


@pytest.mark.timeout(60)
def test_without_compare_the_output_is_unchanged(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench(
        "allreduce", "-n", "2", "--sizes", "64", *SMOKE, "--json", str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "allreduce: 2 ranks, tcp, float32, ranks forked, median of 1 rounds\n" in done.stdout
    header, _ = table_of(done.stdout, "allreduce: ")
    assert header == PLAIN_HEADER
    assert "--compare" not in done.stdout
    assert " vs " not in done.stdout
    assert "[aiocollect r1/1 allreduce 64] 3 iters" in done.stderr
    doc = json.loads(out.read_text())
    assert "compare" not in doc["config"]
    assert not any(key.startswith("compare") for key in doc["summary"][0])
    assert list(doc["rounds"][0]) == ["round", "aiocollect"]


@pytest.mark.timeout(60)
def test_failing_compared_round_is_recorded(capfd: pytest.CaptureFixture[str]) -> None:
    """A compared round that fails (here: a transport aiocollect does not know) is
    recorded like a failing baseline round; the run goes on and reports '-'."""
    case = Case("allreduce", 64)
    plan = Plan(
        world_size=2,
        rounds=1,
        sweep=SweepConfig(
            cases=[case], dtype="float32", warmup=1, iters=2, seconds=0.05, lag_probe=False
        ),
        options=RankOptions(transport="tcp", loop="asyncio"),
        compare="nosuch",
    )
    (entry,) = run_rounds(plan)
    assert entry["aiocollect"]["records"][0]["correct"] is True
    assert entry["compare"]["transport"] == "nosuch"
    assert "error" in entry["compare"]
    assert "aiocollect/nosuch compared round r1/1 failed" in capfd.readouterr().err
    (row,) = report.aggregate([entry], [case], 2, "nosuch")
    assert row["compare"] is None
    assert row["compare_bw_ratio"] != row["compare_bw_ratio"]
    assert report.all_correct([row])
    table = report.format_tables(
        [row], {"world_size": 2, "transport": "tcp", "dtype": "float32", "rounds": 1}
    )
    header, (cells,) = table_of(table, "allreduce: ")
    assert cells[header.index("nosuch p50") : header.index("check")] == ["-", "-", "-"]


# -- arguments ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [
        ["--compare", "tcp"],
        ["--transport", "shm", "--compare", "shm"],
        ["--transport", "auto", "--compare", "auto", "--baseline", "gloo"],
    ],
)
def test_compare_equal_to_transport_is_a_usage_error(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def must_not_run(plan: Plan) -> list[dict[str, Any]]:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(bench, "run_rounds", must_not_run)
    assert bench.bench_main(["allreduce", "-n", "2", "--sizes", "4", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: aiocollect bench")
    assert "error: --compare must name a transport other than --transport" in captured.err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [
        ["--compare", "nosuch"],
        ["--compare"],
        ["--compare", "shm", "--store", "tcp://127.0.0.1:1", "--rank", "0"],
    ],
)
def test_bad_compare_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.bench_main(args) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_compare_equal_to_transport_from_the_command(tmp_path: Path) -> None:
    done = run_bench("allreduce", "--transport", "tcp", "--compare", "tcp", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "--compare must name a transport other than --transport (both are tcp)" in done.stderr
    assert "2 ranks" not in done.stderr  # failed before the start line


# -- the report, from synthetic rounds ----------------------------------------------------

#: format_tables' output for synthetic_rounds(False) and synthetic_rounds(True) as it was
#: before --compare.
GOLDEN = {
    False: """\
allreduce: 2 ranks, shm, float32, median of 2 rounds
size  algorithm  iters      p50      p99     mean  busbw GB/s  lag p99 ms  rss+ MiB  check
   4  auto:ring      3  137.5us  149.8us  138.8us       0.000        0.31       0.5     ok
 64K  auto:ring      3  137.5us  149.8us  138.8us       0.492        0.31       0.5     ok

allreduce-concurrent2: 2 ranks, shm, float32, median of 2 rounds
size  algorithm  iters  2 conc p50  2 seq p50  conc/seq  busbw GB/s  lag p99 ms  rss+ MiB  check
 64K  auto:ring      3     137.5us    237.5us     0.58x       0.984        0.31       0.5     ok

p50/p99: per iteration, the slowest rank; mean: the slowest rank's batch time / iterations \
(NCCL-tests' time); busbw: NCCL-tests bus bandwidth at mean (1e9 B/s).
lag p99: rank 0's event loop, 1 ms sleeps (idle floor 0.19 ms); rss+: peak RSS growth in \
the timed iterations, max over ranks and rounds.""",
    True: """\
allreduce: 2 ranks, shm, float32, median of 2 rounds
size  algorithm  iters      p50      p99     mean  busbw GB/s  lag p99 ms  rss+ MiB  \
gloo p50  gloo GB/s  bw ratio  lat ratio  check
   4  auto:ring      3  137.5us  149.8us  138.8us       0.000        0.31       0.5   \
275.0us      0.000     2.00x      0.50x     ok
 64K  auto:ring      3  137.5us  149.8us  138.8us       0.492        0.31       0.5   \
275.0us      0.246     2.00x      0.50x     ok

allreduce-concurrent2: 2 ranks, shm, float32, median of 2 rounds
size  algorithm  iters  2 conc p50  2 seq p50  conc/seq  busbw GB/s  lag p99 ms  rss+ MiB  \
gloo conc/seq  check
 64K  auto:ring      3     137.5us    237.5us     0.58x       0.984        0.31       0.5   \
       0.58x     ok

p50/p99: per iteration, the slowest rank; mean: the slowest rank's batch time / iterations \
(NCCL-tests' time); busbw: NCCL-tests bus bandwidth at mean (1e9 B/s).
lag p99: rank 0's event loop, 1 ms sleeps (idle floor 0.19 ms); rss+: peak RSS growth in \
the timed iterations, max over ranks and rounds.
bw ratio: aiocollect/gloo busbw (>1 favours aiocollect); lat ratio: aiocollect/gloo p50 \
(<1 favours aiocollect); conc/seq: K in flight / K in sequence.""",
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("gloo", [False, True])
def test_table_without_compare_is_byte_for_byte_unchanged(gloo: bool) -> None:
    rows = report.aggregate(synthetic_rounds(gloo), CASES, 2)
    assert report.format_tables(rows, META) == GOLDEN[gloo]
    # Rounds that somehow hold a "compare" entry change nothing unless asked for.
    assert (
        report.format_tables(report.aggregate(synthetic_rounds(gloo, compare=True), CASES, 2), META)
        == GOLDEN[gloo]
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize("gloo", [False, True])
def test_table_with_compare(gloo: bool) -> None:
    rows = report.aggregate(synthetic_rounds(gloo, compare=True), CASES, 2, "tcp")
    text = report.format_tables(rows, META)
    plain, conc = text.split("\n\n")[:2]
    gloo_cols = ["gloo p50", "gloo GB/s", "bw ratio", "lat ratio"] if gloo else []
    header, body = table_of(plain, "allreduce: 2 ranks, shm vs tcp, float32")
    assert header == [*PLAIN_HEADER[:-1], "tcp p50", "tcp GB/s", "shm/tcp bw", *gloo_cols, "check"]
    # The compared transport is 4x slower: p50 4 x 137.5 us, busbw ratio 4.
    assert [c[9:12] for c in body] == [["550.0us", "0.000", "4.00x"], ["550.0us", "0.123", "4.00x"]]
    header, (cells,) = table_of(conc, "allreduce-concurrent2: 2 ranks, shm vs tcp")
    assert header[9:12] == ["tcp conc p50", "tcp GB/s", "shm/tcp bw"]
    assert cells[9:12] == ["550.0us", "0.246", "4.00x"]
    for row in rows:
        assert row["compare_bw_ratio"] == pytest.approx(4.0)
        assert row["compare_lat_ratio"] == pytest.approx(0.25)
    assert (
        "tcp p50, tcp GB/s: aiocollect over tcp (--compare); shm/tcp bw: busbw over shm "
        "/ busbw over tcp, medians over rounds (>1 favours shm)."
    ) in text
    assert report.all_correct(rows)


@pytest.mark.timeout(10)
def test_wrong_compared_result_fails_the_check() -> None:
    rows = report.aggregate(
        synthetic_rounds(True, compare=True, compare_correct=False), CASES, 2, "tcp"
    )
    assert not report.all_correct(rows)
    assert "ok (tcp WRONG)" in report.format_tables(rows, META)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not plotting.available(), reason="matplotlib not installed")
def test_plot_draws_the_compared_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    labels: list[str] = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig: matplotlib.figure.Figure, *args: Any, **kwargs: Any) -> None:
        # The bandwidth panel (the ratio panel has its own labels: test_plot.py).
        labels.extend(str(line.get_label()) for line in fig.axes[1].get_lines())
        save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    png = tmp_path / "bench.png"
    rows = report.aggregate(synthetic_rounds(True, compare=True), CASES, 2, "tcp")
    plotting.plot(rows, png, "test", "shm")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert sorted(set(labels)) == [
        "allreduce (aiocollect/shm)",
        "allreduce (aiocollect/tcp)",
        "allreduce (gloo)",
    ]
