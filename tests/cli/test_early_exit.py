"""``aiocollect run``: a rank that exits 0 while the others still run is flagged, and
``--group-timeout`` reaches the ranks as their groups' timeout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import RunCli, WriteScript, cli_command

EARLY_SCRIPT = """\
    import os, sys, time
    if os.environ["RANK"] == "1":
        sys.exit(0)
    time.sleep(float(os.environ["STAY"]))
    sys.exit(int(os.environ["STATUS"]))
"""

TIMEOUT_SCRIPT = """\
    import asyncio, os
    import aiocollect

    async def main() -> None:
        async with aiocollect.open_group() as group:
            print("env", os.environ.get("AIOCOLLECT_TIMEOUT"), "group", group.timeout)

    asyncio.run(main())
"""


def _run(
    tmp_path: Path, script: Path, stay: float, status: int
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "AIOCOLLECT_EARLY_EXIT_NOTICE": "0.5",
        "STAY": str(stay),
        "STATUS": str(status),
    }
    return subprocess.run(
        cli_command("run", "-n", "3", str(script)),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=50,
        check=False,
    )


@pytest.mark.timeout(60)
def test_rank_exiting_0_while_others_run_is_flagged(
    tmp_path: Path, write_script: WriteScript
) -> None:
    script = write_script("early.py", EARLY_SCRIPT)
    done = _run(tmp_path, script, 2.0, 4)
    assert done.returncode == 4, done.stderr
    assert "rank 1 exited 0 but rank(s) 0, 2 are still running 0.5 s later" in done.stderr
    assert "--group-timeout" in done.stderr
    # the summary marks it too
    assert "1 exit code 0 early (" in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_ranks_finishing_together_are_not_flagged(
    tmp_path: Path, write_script: WriteScript
) -> None:
    script = write_script("early.py", EARLY_SCRIPT)
    done = _run(tmp_path, script, 0.0, 0)
    assert done.returncode == 0, done.stderr
    assert "exited 0 but" not in done.stderr


@pytest.mark.timeout(60)
def test_group_timeout_sets_the_groups_timeout(run_cli: RunCli, write_script: WriteScript) -> None:
    script = write_script("timeout.py", TIMEOUT_SCRIPT)
    done = run_cli("run", "-n", "2", "--group-timeout", "7.5", str(script), timeout=50)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] env 7.5 group 7.5" in done.stdout, done.stdout
    bad = run_cli("run", "-n", "2", "--group-timeout", "0", str(script), timeout=50)
    assert bad.returncode == 2
    assert "--group-timeout must be > 0" in bad.stderr
