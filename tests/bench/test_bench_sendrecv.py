"""``aiocollect bench sendrecv barrier``: the two cases that are not collectives of data,
their floors, and the gloo baseline.

End to end through the real command (rank processes, the floor's forked ranks and, where
torch is installed, gloo's ranks) on tiny iteration counts, and the floors themselves
with real forked ranks. Nothing asserts speed: only that each case ran, was checked where
a result can be checked, and got the floor its size calls for.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from aiocollect.bench import floor
from tests.support.bench import SMOKE, needs_pulls, positive, run_bench, table_of


@needs_pulls
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("transport", "n"), [("auto", 2), ("tcp", 3)])
def test_sendrecv_and_barrier_with_floor(tmp_path: Path, transport: str, n: int) -> None:
    """Every rank sends to r+1 and receives from r-1 (checked against the sender's
    pattern), at a size below and one above the floor's bulk threshold; the barrier is
    one case at size 0 whatever --sizes says, with '-' in its check column."""
    out = tmp_path / "bench.json"
    done = run_bench(
        "sendrecv",
        "barrier",
        "-n",
        str(n),
        "--transport",
        transport,
        "--sizes",
        "4,1M",
        *SMOKE,
        "--floor",
        "--json",
        str(out),
        cwd=tmp_path,
        timeout=140,
    )
    assert done.returncode == 0, done.stderr
    assert "[floor r1/1] sendrecv sizes 4,1048576" in done.stderr
    assert "[floor r1/1] barrier sizes 0" in done.stderr
    head, body = table_of(done.stdout, f"sendrecv: {n} ranks")
    assert head[-4:] == ["floor", "x floor", "rounds", "check"]
    assert [line[-1] for line in body] == ["ok", "ok"]
    _, (barrier_line,) = table_of(done.stdout, f"barrier: {n} ranks")
    assert barrier_line[0] == "0"
    assert barrier_line[-1] == "-"
    doc = json.loads(out.read_text())
    rows = {(r["name"], r["size"]): r for r in doc["summary"]}
    assert set(rows) == {("sendrecv", 4), ("sendrecv", 1 << 20), ("barrier", 0)}
    small, large, bar = rows[("sendrecv", 4)], rows[("sendrecv", 1 << 20)], rows[("barrier", 0)]
    assert (small["floor_method"], large["floor_method"], bar["floor_method"]) == (
        "latency",
        "bandwidth",
        "latency",
    )
    for row in (small, large, bar):
        assert row["aiocollect"]["correct"] is True
        assert positive(row["aiocollect"]["p50_us"])
        assert positive(row["floor_us"])
        assert row["floor_each_us"] >= row["floor_us"]
        assert row["floor_ratio"] == pytest.approx(row["aiocollect"]["p50_us"] / row["floor_us"])
    assert positive(large["aiocollect"]["busbw_gbps"])
    assert bar["aiocollect"]["busbw_gbps"] == 0


@pytest.mark.timeout(120)
def test_sendrecv_and_barrier_against_gloo(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch not installed: the gloo baseline cannot run")
    out = tmp_path / "bench.json"
    done = run_bench(
        "sendrecv",
        "barrier",
        "-n",
        "2",
        "--sizes",
        "4K",
        *SMOKE,
        "--baseline",
        "gloo",
        "--json",
        str(out),
        cwd=tmp_path,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    for row in doc["summary"]:
        assert row["gloo"]["correct"] is True
        assert positive(row["gloo"]["p50_us"])
        assert positive(row["lat_ratio"])
    sr = next(r for r in doc["summary"] if r["name"] == "sendrecv")
    assert positive(sr["bw_ratio"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_barrier_floor_any_rank_count(n: int) -> None:
    """Dissemination: ceil(log2 n) steps, any n (no power of two needed)."""
    got = floor.barrier(n, 40)
    assert 0 < got.seconds <= got.each


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_sendrecv_floor_overlaps_large_payloads(n: int) -> None:
    """A payload larger than a socket takes at once: every rank sends first, so without
    the overlapping exchange every rank would wait for ever; each rank checks the bytes
    it received came from rank r-1."""
    got = floor.sendrecv_latency(n, 1 << 20, 10)
    assert 0 < got.seconds <= got.each


@needs_pulls
@pytest.mark.timeout(60)
def test_sendrecv_bandwidth_floor_reads_the_previous_rank() -> None:
    how, nbytes, got = floor.measure(3, 1 << 20, "sendrecv")
    assert (how, nbytes) == ("bandwidth", 1 << 20)
    assert 0 < got.seconds <= got.each


def test_floor_measure_rejects_what_it_has_no_floor_for() -> None:
    with pytest.raises(ValueError, match="no floor for 'broadcast'"):
        floor.measure(2, 4, "broadcast")
    with pytest.raises(ValueError, match="2\\+ ranks"):
        floor.barrier(1)
