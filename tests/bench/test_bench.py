"""``aiocollect bench`` end to end: the real command in a subprocess, seconds long.

Nothing here asserts speed: only that the command runs, checks results, reports sane
positive numbers, writes its files, rejects bad arguments and cleans up its ranks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiocollect.cli import bench
from aiocollect.testing.spawn import free_port
from tests.support.bench import SMOKE, positive, run_bench


@pytest.mark.timeout(60)
def test_smoke_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench(
        "allreduce",
        "broadcast",
        "-n",
        "2",
        "--sizes",
        "4..4K",
        "--rounds",
        "1",
        "--iters",
        "3",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    for title in ("allreduce: 2 ranks, tcp, float32", "broadcast: 2 ranks"):
        assert title in done.stdout
    assert "p50" in done.stdout
    assert "busbw GB/s" in done.stdout
    assert "WRONG" not in done.stdout
    assert "chunk: 1M per frame (chosen by the group at rendezvous)." in done.stdout
    assert "[aiocollect r1/1 allreduce 4K] 3 iters" in done.stderr  # progress
    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    assert doc["command"].startswith("aiocollect bench allreduce broadcast")
    machine = doc["machine"]
    assert machine["nproc"] >= 1
    assert machine["python"]
    assert machine["date"]
    assert {"uvloop", "torch", "event_loop", "cpu"} <= set(machine)
    assert doc["config"]["world_size"] == 2
    assert doc["config"]["rounds"] == 1
    assert doc["config"]["start_method"] == "fork"  # as aiocollect run starts ranks
    assert doc["config"]["chunk_bytes_used"] == 1 << 20  # what a TCP group chose
    rows = doc["summary"]
    assert [(r["name"], r["size"]) for r in rows] == [
        (c, s) for c in ("allreduce", "broadcast") for s in (4, 16, 64, 256, 1024, 4096)
    ]
    for row in rows:
        ac = row["aiocollect"]
        assert ac["iters"] == 3
        assert ac["correct"] is True
        for key in ("p50_us", "p99_us", "busbw_gbps"):
            assert positive(ac[key]), (row["name"], row["size"], key, ac[key])
        assert ac["p99_us"] >= ac["p50_us"]
        assert ac["rss_growth_mib"] >= 0
        assert row["gloo"] is None
    (round1,) = doc["rounds"]
    records = round1["aiocollect"]["records"]
    assert len(records) == 12
    assert all(len(r["times_us"]) == 3 and all(t > 0 for t in r["times_us"]) for r in records)
    assert all(len(r["rss_growth_mib"]) == 2 for r in records)


@pytest.mark.timeout(90)
def test_gloo_baseline(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch not installed: the gloo baseline cannot run")
    out = tmp_path / "bench.json"
    done = run_bench(
        "allreduce",
        "-n",
        "2",
        "--sizes",
        "4,64K",
        *SMOKE,
        "--baseline",
        "gloo",
        "--json",
        str(out),
        cwd=tmp_path,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr
    assert "gloo p50" in done.stdout
    assert "bw ratio" in done.stdout
    assert "[gloo r1/1 allreduce 64K]" in done.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["baseline_used"] == "gloo"
    for row in doc["summary"]:
        assert row["gloo"]["correct"] is True
        assert positive(row["gloo"]["p50_us"])
        assert positive(row["gloo"]["busbw_gbps"])
        assert positive(row["bw_ratio"])
        assert positive(row["lat_ratio"])


@pytest.mark.timeout(60)
def test_plot_and_concurrent_mode(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed: --plot cannot run")
    png = tmp_path / "bench.png"
    done = run_bench(
        "allreduce",
        "allreduce-concurrent2",
        "-n",
        "2",
        "--sizes",
        "1K,64K",
        *SMOKE,
        "--plot",
        str(png),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "allreduce-concurrent2:" in done.stdout
    assert "conc/seq" in done.stdout


@pytest.mark.timeout(60)
def test_join_mode_two_processes(tmp_path: Path) -> None:
    store = f"tcp://127.0.0.1:{free_port()}"
    args = ["allgather", "-n", "2", "--sizes", "64", *SMOKE, "--store", store]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aiocollect", "bench", *args, "--rank", str(rank)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outputs]
    assert "allgather: 2 ranks" in outputs[0][0]
    assert outputs[1][0] == ""  # only rank 0 reports


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [
        ["--sizes", "lots"],
        ["nosuch"],
        ["-n", "0"],
        ["--rounds", "0"],
        ["--iters", "0"],
        ["--store", "tcp://127.0.0.1:1"],
        ["--rank", "0"],
        ["--concurrent", "1"],
        ["--store", "tcp://127.0.0.1:1", "--rank", "0", "--baseline", "gloo"],
        ["--dtype", "complex64"],
        ["--bogus"],
        ["--chunk-bytes", "0"],
        ["--warmup-seconds", "-1"],
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.bench_main(args) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_bad_arguments_exit_2_from_the_command(tmp_path: Path) -> None:
    done = run_bench("allreduce", "--sizes", "8..4", cwd=tmp_path)
    assert done.returncode == 2
    assert "empty size range" in done.stderr


@pytest.mark.timeout(30)
def test_wrong_result_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # One rank in this process (join mode): a check that fails must make the exit 1.
    monkeypatch.setattr("aiocollect.bench.sweep.verify", lambda *args, **kwargs: False)
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
            "--store",
            f"tcp://127.0.0.1:{free_port()}",
            "--rank",
            "0",
        ]
    )
    captured = capsys.readouterr()
    assert status == 1, captured.err
    assert "WRONG" in captured.out
    assert "WRONG RESULT" in captured.err


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: the ranks, and where they are forked the process
    that forked them (aiocollect.bench.forked)."""
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def _leaves(pid: int) -> list[int]:
    """The processes below ``pid`` with no children of their own: the ranks."""
    return [p for p in _descendants(pid) if not _children(p)]


#: 4 B (done in a moment), then 32 MiB (far longer than the test), 1000 iterations each.
_TWO_CASES = ("--sizes", "4,32M", "--iters", "1000", "--warmup", "1", "--rounds", "1")


#: ``python -m aiocollect`` with a stack dump of every thread on SIGUSR1 (what a stalled
#: run shows the test); the entry point is the same module ``-m aiocollect`` runs.
_CLI_WITH_DUMP = (
    "import faulthandler, runpy, signal, sys; "
    "faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "sys.argv[0] = 'aiocollect'; runpy.run_module('aiocollect', run_name='__main__')"
)


def _state(pid: int) -> str:
    """One line on a process: its state and the kernel function it sleeps in."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return f"{pid}: gone"
    state = next((line for line in status if line.startswith("State:")), "State: ?")
    return f"{pid}: {state}, wchan {wchan}"


def _stalled(proc: subprocess.Popen[str], ranks: list[int]) -> str:
    """What a run that did not stop in time was doing: the processes' states and the
    parent's Python stacks (faulthandler on SIGUSR1, read for up to 2 s)."""
    lines = [_state(pid) for pid in [proc.pid, *ranks]]
    with contextlib.suppress(OSError):
        proc.send_signal(signal.SIGUSR1)
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 2.0
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            break
        chunks.append(chunk)
    return "\n".join(lines) + "\n" + b"".join(chunks).decode(errors="replace")[-6000:]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("start_method", ["fork", "exec"])
def test_interrupt_stops_every_rank(tmp_path: Path, start_method: str) -> None:
    """SIGINT to ``aiocollect bench`` while its ranks measure stops every rank. The signal
    goes once rank 0 printed the first case's line (4 B, 1000 iterations): both ranks are
    then running and in their group, measuring the second (32 MiB, 1000 iterations, far
    longer than the test). (It was sent after polling for two children and a 1 s sleep,
    which on a loaded machine could be before the ranks had started.) A run that has not
    stopped 20 s after the signal fails with its processes' states and the parent's
    stacks, and the pipe is closed whatever happens. Under both start methods (the
    forked ranks' parent process too)."""
    cmd = [sys.executable, "-c", _CLI_WITH_DUMP, "bench", "allreduce", "-n", "2", *_TWO_CASES]
    env = {**os.environ, "AIOCOLLECT_START_METHOD": start_method}
    with subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        try:
            assert proc.stderr is not None
            seen: list[str] = []
            for line in proc.stderr:  # bounded by the test's timeout
                seen.append(line)
                if line.startswith("[aiocollect r1/1 allreduce 4]"):
                    break
            else:
                pytest.fail("the benchmark ended before its first case:\n" + "".join(seen))
            assert len(_leaves(proc.pid)) == 2, (_descendants(proc.pid), seen)
            ranks = _descendants(proc.pid)
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail("not stopped 20 s after SIGINT:\n" + _stalled(proc, ranks))
        finally:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "interrupted" in err
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists(), f"rank pid {pid} survived"


_ORPHAN_PARENT = """\
import os, subprocess, sys
from pathlib import Path
from aiocollect.bench.runner import worker_args, worker_command
from aiocollect.bench.spec import Case
from aiocollect.bench.sweep import SweepConfig
from aiocollect.bench.worker import RankOptions, encode

config = encode(SweepConfig([Case("allreduce", 4)], "float32", 1, 5, 0.1), RankOptions())
cmd = worker_command(worker_args("aiocollect", 1, 2, sys.argv[1], config, "x", Path("r.json")))
quiet = subprocess.DEVNULL
rank = subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet)
print(rank.pid, flush=True)
os._exit(0)  # gone while its rank still starts (as when interrupted inside Popen)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3)")
def test_a_rank_whose_parent_died_while_it_started_exits(tmp_path: Path) -> None:
    """A bench rank whose parent is gone before the rank's parent watch starts exits at once
    (status ORPHANED) instead of waiting for a group that never forms: it once took the
    pid of the process it had been reparented to for its parent, and ran on, keeping
    ``aiocollect bench``'s stderr open (a SIGINT test timed out on it)."""
    parent = subprocess.run(
        [sys.executable, "-c", _ORPHAN_PARENT, f"tcp://127.0.0.1:{free_port()}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid = int(parent.stdout)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already gone
    try:
        ready, _, _ = select.select([fd], [], [], 30)  # readable once the process ended
        if not ready:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
    assert ready, f"the orphaned rank (pid {pid}) still ran 30 s after its parent died"


@pytest.mark.timeout(60)
def test_warm_up_by_time(tmp_path: Path) -> None:
    """--warmup-seconds: more untimed iterations than --warmup until that long has passed,
    as many on every rank (rank 0 says how many: a mismatch would hang or fail the run);
    0 leaves just --warmup."""
    counts = {}
    for seconds in ("0.2", "0"):
        out = tmp_path / f"bench-{seconds}.json"
        done = run_bench(
            "allreduce",
            "-n",
            "2",
            "--sizes",
            "4",
            *SMOKE,
            "--warmup-seconds",
            seconds,
            "--json",
            str(out),
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        doc = json.loads(out.read_text())
        (record,) = doc["rounds"][0]["aiocollect"]["records"]
        counts[seconds] = record["warmup_iters"]
        assert doc["config"]["warmup_seconds"] == float(seconds)
    assert counts["0"] == 1
    # 0.2 s of a 4-byte allreduce: thousands here; at least far more than one
    assert counts["0.2"] > 20
