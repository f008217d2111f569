"""``aiocollect run`` end to end: real launcher, real rank processes, real groups."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from aiocollect.testing import free_port
from tests.support.cli import PID_LINE, RunCli, WriteScript, assert_all_gone, cli_command, rank_pids

ENV_SCRIPT = """\
    import os, sys
    env = os.environ
    print(f"rank={env['AIOCOLLECT_RANK']} world={env['AIOCOLLECT_WORLD_SIZE']} "
          f"local={env['AIOCOLLECT_LOCAL_RANK']}/{env['AIOCOLLECT_LOCAL_WORLD_SIZE']} "
          f"torch={env['RANK']}/{env['WORLD_SIZE']}/{env['LOCAL_RANK']}/{env['LOCAL_WORLD_SIZE']} "
          f"store={env['AIOCOLLECT_STORE']} master={env['MASTER_ADDR']}:{env['MASTER_PORT']} "
          f"unbuffered={env['PYTHONUNBUFFERED']}")
    print("argv", sys.argv[1:])
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline at the end")
"""

ALLREDUCE_SCRIPT = """\
    import asyncio
    import numpy as np
    import aiocollect

    async def main() -> None:
        async with aiocollect.open_group(timeout=30) as group:
            data = np.full(5, group.rank + 1, dtype=np.int64)
            await group.allreduce(data)
            print("result", group.rank, group.world_size, data.tolist())

    asyncio.run(main())
"""

# Every rank prints its pid, then waits at a barrier (so all pids are printed before anyone
# fails); rank 1 then exits with status 3 and the others wait forever.
FAIL_SCRIPT = """\
    import asyncio, os, signal, sys
    import aiocollect

    async def main() -> None:
        group = await aiocollect.open_group(timeout=30)
        if "--ignore-sigterm" in sys.argv:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pid", os.getpid())
        await group.barrier()
        if group.rank == 1:
            sys.exit(3)
        await asyncio.Event().wait()

    asyncio.run(main())
"""

WAIT_SCRIPT = """\
    import asyncio, os, signal
    print("pid", os.getpid())
    if os.environ["RANK"] == "1" and os.environ.get("SELF_KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    asyncio.run(asyncio.Event().wait())
"""


def lines_of(text: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(60)
def test_three_ranks_get_env_and_prefixed_output(
    run_cli: RunCli, write_script: WriteScript
) -> None:
    script = write_script("env_script.py", ENV_SCRIPT)
    done = run_cli("run", "-n", "3", str(script), "--", "-n", "5", "--flag")
    assert done.returncode == 0, done.stderr
    assert all(line.startswith("[rank ") for line in done.stdout.splitlines()), done.stdout
    stores = set()
    for rank in range(3):
        out = lines_of(done.stdout, rank)
        match = re.fullmatch(
            rf"rank={rank} world=3 local={rank}/3 torch={rank}/3/{rank}/3 "
            r"store=tcp://127\.0\.0\.1:(\d+) master=127\.0\.0\.1:(\d+) unbuffered=1",
            out[0],
        )
        assert match is not None, out
        assert match[1] == match[2]
        stores.add(match[1])
        assert out[1:] == ["argv ['--', '-n', '5', '--flag']", "no newline at the end"]
        assert lines_of(done.stderr, rank) == ["to stderr"]
    assert len(stores) == 1


@pytest.mark.timeout(60)
def test_module_mode(run_cli: RunCli, write_script: WriteScript) -> None:
    write_script(
        "cli_mod_target.py",
        """\
        import os, sys
        print(__name__, os.environ["RANK"], sys.argv[1:])
    """,
    )
    done = run_cli("run", "--nproc-per-node", "2", "-m", "cli_mod_target", "a", "-m")
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert lines_of(done.stdout, rank) == [f"__main__ {rank} ['a', '-m']"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [2, 3])
def test_ranks_open_a_group_and_allreduce(
    nproc: int, run_cli: RunCli, write_script: WriteScript
) -> None:
    script = write_script("allreduce_script.py", ALLREDUCE_SCRIPT)
    done = run_cli("run", "-n", str(nproc), str(script), timeout=80)
    assert done.returncode == 0, done.stderr
    total = nproc * (nproc + 1) // 2
    for rank in range(nproc):
        assert lines_of(done.stdout, rank) == [f"result {rank} {nproc} {[total] * 5}"]


@pytest.mark.timeout(90)
def test_two_launchers_form_one_job(tmp_path: Path, write_script: WriteScript) -> None:
    script = write_script("allreduce_script.py", ALLREDUCE_SCRIPT)
    common = [
        "run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port("127.0.0.1")),
    ]
    nodes = [
        subprocess.Popen(
            cli_command(*common, "--node-rank", str(node), str(script)),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        results = [node.communicate(timeout=80) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.terminate()
                node.wait(30)
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, err
    for rank in range(4):
        out = results[rank // 2][0]
        assert lines_of(out, rank) == [f"result {rank} 4 {[10] * 5}"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_failing_rank_stops_the_others(
    ignore_sigterm: bool, run_cli: RunCli, write_script: WriteScript
) -> None:
    script = write_script("fail_script.py", FAIL_SCRIPT)
    extra = ["--ignore-sigterm"] if ignore_sigterm else []
    started = time.monotonic()
    done = run_cli("run", "-n", "3", "--grace", "1", str(script), *extra, timeout=50)
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert elapsed < 30, f"launcher took {elapsed:.1f} s to stop the job"
    assert re.search(r"rank 1 \(pid \d+\) failed: exit code 3", done.stderr), done.stderr
    assert "job failed: rank 1 failed first, exit code 3" in done.stderr
    if ignore_sigterm:
        assert "sending SIGKILL" in done.stderr
    pids = rank_pids(done.stdout)
    assert sorted(pids) == [0, 1, 2], done.stdout
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_is_reported(tmp_path: Path, write_script: WriteScript) -> None:
    script = write_script("wait_script.py", WAIT_SCRIPT)
    done = subprocess.run(
        cli_command("run", "-n", "3", str(script)),
        cwd=tmp_path,
        env={**os.environ, "SELF_KILL": "1"},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=50,
        check=False,
    )
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert re.search(r"rank 1 \(pid \d+\) failed: killed by SIGKILL \(signal 9\)", done.stderr), (
        done.stderr
    )
    assert_all_gone(rank_pids(done.stdout))


@pytest.mark.timeout(60)
def test_job_timeout(run_cli: RunCli, write_script: WriteScript) -> None:
    script = write_script("wait_script.py", WAIT_SCRIPT)
    done = run_cli("run", "-n", "2", "--timeout", "1", str(script), timeout=50)
    assert done.returncode == 124, done.stderr
    assert "job timed out after 1 s" in done.stderr
    assert_all_gone(rank_pids(done.stdout))


@pytest.mark.timeout(60)
def test_sigint_is_forwarded(tmp_path: Path, write_script: WriteScript) -> None:
    script = write_script("wait_script.py", WAIT_SCRIPT)
    launcher = subprocess.Popen(
        cli_command("run", "-n", "2", str(script)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        pids: dict[int, int] = {}
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before every rank started"
            if match := PID_LINE.match(line.rstrip("\n")):
                pids[int(match[1])] = int(match[2])
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=40)
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # the launcher stops its ranks on SIGTERM
            launcher.wait(30)
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT; forwarding it to the ranks" in err
    assert "job interrupted by SIGINT" in err
    assert_all_gone(pids)
