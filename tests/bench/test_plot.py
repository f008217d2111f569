"""The figure, the load-average warning and the synchronised broadcast timing.

Plots are checked through the matplotlib objects (axes, lines, texts) captured at
``savefig``; the warning through ``report`` with a load average patched in, and end to end
through ``bench_main`` in this process (the load watch runs in the parent); the broadcast
timing through the real command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aiocollect.bench import machine, report
from aiocollect.bench import plot as plotting
from aiocollect.cli import bench
from aiocollect.testing.spawn import free_port
from tests.support.bench import CASES, META, capture_figures, needs_mpl, run_bench, synthetic_rounds


def _sized_rows() -> list[dict[str, Any]]:
    """Rows for sizes 4 .. 4M so that both latency panels have points."""
    rows = report.aggregate(synthetic_rounds(True), CASES, 2)
    plain = [r for r in rows if r["concurrency"] == 1]
    out = []
    for size in (4, 4096, 256 * 1024, 4 << 20):
        row = {**plain[0], "size": size}
        out.append(row)
    return out


@needs_mpl
@pytest.mark.timeout(60)
def test_plot_panels_ratio_split_axes_colours_and_footer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figs = capture_figures(monkeypatch)
    rows = _sized_rows()
    text = plotting.footer(
        "2026-12-02T01:00:00+00:00",
        {
            "cores": 2,
            "start": 1.5,
            "max": 3.25,
            "end": 2.0,
            "warning": machine.load_warning(3.25, 2),
        },
    )
    plotting.plot(rows, tmp_path / "b.png", "t", "tcp", footer=text)
    (fig,) = figs
    ratio, bw, small, large = fig["axes"]
    # The headline: the same-run busbw ratio against gloo, with the line at 1.
    (line, one) = ratio["lines"]
    assert line[0] == "allreduce: aiocollect / gloo"
    assert line[1] == [4, 4096, 256 * 1024, 4 << 20]
    assert line[2] == pytest.approx([r["bw_ratio"] for r in rows])
    assert list(one[2]) == [1.0, 1.0]
    # Bandwidth on a linear axis; latency split at 256 KiB.
    assert bw["yscale"] == "linear"
    assert small["yscale"] == "linear"
    assert all(x < plotting.SPLIT for ln in small["lines"] for x in ln[1])
    assert all(x >= plotting.SPLIT for ln in large["lines"] for x in ln[1])
    assert {ln[1][0] for ln in large["lines"]} == {256 * 1024}
    # One colour per series (aiocollect and gloo of the same collective differ).
    assert len({ln[3] for ln in bw["lines"]}) == len(bw["lines"]) == 2
    # Date, load average and the warning on the figure.
    (foot,) = [t for t in fig["texts"] if t.startswith("measured")]
    assert "2026-12-02" in foot
    assert "load average" in foot
    assert "max 3.25" in foot
    assert "WARNING" in foot
    assert "2 cores" in foot


@needs_mpl
@pytest.mark.timeout(60)
def test_plot_without_baseline_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figs = capture_figures(monkeypatch)
    rows = report.aggregate(synthetic_rounds(False), CASES, 2)
    plotting.plot(rows, tmp_path / "b.png", "t")
    assert "no baseline in this run" in figs[0]["axes"][0]["texts"]


@pytest.mark.timeout(10)
def test_load_warning_in_table_and_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    assert machine.load_warning(2.0, 2) is None
    assert machine.load_warning(None, 2) is None
    assert "2.50 on 2 cores" in str(machine.load_warning(2.5, 2))
    assert "own" not in str(machine.load_warning(2.5, 2, ranks=2))
    assert "this run's own 4 ranks outnumber the cores" in str(machine.load_warning(3.5, 2, 4))
    monkeypatch.setattr(machine, "cores", lambda: 2)
    monkeypatch.setattr(machine, "load_average", lambda: [3.5, 1.0, 1.0])
    with machine.LoadWatch(period=0.01) as watch:
        pass
    summary = watch.summary()
    assert summary["cores"] == 2
    assert summary["max"] == 3.5
    assert "3.50 on 2 cores" in summary["warning"]
    rows = report.aggregate(synthetic_rounds(False), CASES, 2)
    text = report.format_tables(rows, {**META, "load_warning": summary["warning"]})
    assert text.splitlines()[-1].startswith("WARNING: the load average reached 3.50")
    monkeypatch.setattr(machine, "load_average", lambda: [0.5, 1.0, 1.0])
    with machine.LoadWatch(period=0.01) as quiet:
        pass
    assert quiet.summary()["warning"] is None


@pytest.mark.timeout(60)
def test_busy_run_warns_in_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(machine, "load_average", lambda: [64.0, 1.0, 1.0])
    out = tmp_path / "b.json"
    status = bench.bench_main(
        [
            "allreduce",
            "-n",
            "1",
            "--sizes",
            "64",
            "--rounds",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--loop",
            "asyncio",
            "--json",
            str(out),
            "--store",
            f"tcp://127.0.0.1:{free_port()}",
            "--rank",
            "0",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "WARNING: the load average reached 64.00" in captured.out
    doc = json.loads(out.read_text())
    assert doc["load"]["max"] == 64.0
    assert doc["load"]["cores"] == machine.cores()
    assert doc["load_warning"].startswith("the load average reached 64.00")


@pytest.mark.timeout(60)
def test_broadcast_iterations_end_with_a_barrier(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    done = run_bench(
        "broadcast",
        "allreduce",
        "-n",
        "2",
        "--sizes",
        "4",
        "--rounds",
        "1",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    bcast, allreduce = doc["summary"]
    assert bcast["name"] == "broadcast"
    assert bcast["aiocollect"]["sync_p50_us"] > 0
    (rec, plain) = doc["rounds"][0]["aiocollect"]["records"]
    assert rec["sync"] == "barrier"
    assert rec["sync_p50_us"] > 0
    assert "sync" not in plain
    assert "sync_p50_us" not in allreduce["aiocollect"]
    assert "broadcast: every iteration ends with a barrier" in done.stdout
