"""Two ``aiocollect run`` jobs on one ``--master-port`` never mix.

Without the job nonce, ranks of two jobs started together would form mixed groups (both
jobs "succeeding" with 301 instead of 201 and 401), and one started 2 s later would fail
with a misleading "could not connect to rank 0" (reading the first job's address). Here real
launchers with real rank processes race, many times: every job either succeeds with its own
sum or fails
with a RendezvousError naming the other job, and no rank ever computes a mixed sum. A job
started while another runs fails at once saying so, and the running one is unaffected; a
standalone store serves one job after another under the same group name.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiocollect.testing import free_port

SCRIPT = """\
    import asyncio, sys
    import numpy as np
    import aiocollect

    async def main() -> None:
        base = int(sys.argv[1])
        async with aiocollect.open_group(timeout=20) as group:
            data = np.full(4, base + group.rank, dtype=np.int64)
            await group.allreduce(data)
            print("result", int(data[0]))
            if "--hold" in sys.argv:  # stay in the group until a line arrives on stdin
                if group.rank == 0:
                    print("holding", flush=True)
                    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                await group.barrier()

    asyncio.run(main())
"""

BASES = (100, 200)  # 2 ranks each: 100 + 101 = 201, 200 + 201 = 401, mixed 301
ITERATIONS = 6  # races, two at a time (a few seconds each on a quiet host)
PAIRS_AT_ONCE = 2
RESULT = re.compile(r"^\[rank (\d)\] result (\d+)$", re.MULTILINE)
#: What a job that lost the race says: its rank found the other job's claims or store
#: (RendezvousError), or it reached the embedded store of the other job just as that job
#: ended and took its store with it (StoreError).
LOST = re.compile(
    r"another job on the same store|StoreError: connection to the TCP store at "
    r"\S+ lost: "
)


def _start(
    script: Path, port: int, base: int, cwd: Path, *extra: str, stdin: int = subprocess.DEVNULL
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiocollect",
            "run",
            "-n",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--timeout",
            "40",
            str(script),
            str(base),
            *extra,
        ],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=stdin,
        text=True,
    )


def _check(base: int, rc: int, out: str, err: str) -> str:
    """Assert the job's outcome is one of the two allowed ones; return which."""
    want = 2 * base + 1
    sums = {int(rank): int(total) for rank, total in RESULT.findall(out)}
    assert all(total == want for total in sums.values()), (
        f"job {base}: a rank computed a mixed sum {sums} (want {want})\n{out}\n{err}"
    )
    if rc == 0:
        assert sums == {0: want, 1: want}, (base, out, err)
        return "ok"
    assert LOST.search(err), f"job {base} failed otherwise (rc {rc}):\n{err}"
    return "lost" if "another job on the same store" in err else "store lost"


@pytest.mark.timeout(180)
def test_two_jobs_on_one_port_never_mix(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    outcomes: dict[str, int] = {}
    done = 0
    while done < ITERATIONS:
        batch = []
        for _ in range(PAIRS_AT_ONCE):
            port = free_port("127.0.0.1")
            batch.append([(base, _start(script, port, base, tmp_path)) for base in BASES])
        try:
            for pair in batch:
                for base, proc in pair:
                    out, err = proc.communicate(timeout=60)
                    kind = _check(base, proc.returncode, out, err)
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                done += 1
        finally:
            for pair in batch:
                for _, proc in pair:
                    if proc.poll() is None:
                        proc.kill()
                        proc.communicate()
    print(f"{done} races: {outcomes}")
    assert outcomes.get("ok", 0) >= done, outcomes  # at least one job of each race succeeds


@pytest.mark.timeout(90)
def test_a_job_started_while_another_runs_fails_at_once(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    port = free_port("127.0.0.1")
    with _start(script, port, 100, tmp_path, "--hold", stdin=subprocess.PIPE) as first:
        try:
            assert first.stdout is not None
            assert first.stdin is not None
            seen = []
            for line in first.stdout:  # bounded by pytest-timeout
                seen.append(line)
                if line.strip() == "[rank 0] holding":
                    break
            second = _start(script, port, 200, tmp_path)
            out, err = second.communicate(timeout=60)
            assert second.returncode != 0, out
            assert "RendezvousError" in err, err
            assert "another job on the same store" in err, err
            assert "could not connect" not in err, err
            first.stdin.write("go\n")
            first.stdin.close()
            seen.append(first.stdout.read())
            assert first.wait(timeout=60) == 0, first.stderr.read() if first.stderr else ""
            assert sorted(RESULT.findall("".join(seen))) == [("0", "201"), ("1", "201")], seen
        finally:
            if first.poll() is None:
                first.kill()


@pytest.mark.timeout(90)
def test_a_standalone_store_serves_one_job_after_another(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    port = free_port("127.0.0.1")
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiocollect",
            "store",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--insecure",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as store:
        try:
            assert store.stdout is not None
            assert "listening" in store.stdout.readline()  # bounded by pytest-timeout
            for base in (100, 200, 300):  # the same group name ("default") each time
                job = _start(script, port, base, tmp_path)
                out, err = job.communicate(timeout=60)
                assert job.returncode == 0, err
                assert sorted(RESULT.findall(out)) == [
                    ("0", str(2 * base + 1)),
                    ("1", str(2 * base + 1)),
                ], out
        finally:
            store.terminate()
