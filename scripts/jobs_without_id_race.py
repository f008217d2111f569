"""How often two jobs without a job id, racing on one standalone store and group name,
still return a mixed result: the multi-node case, where no launcher gives the ranks of
both nodes one identity unless the user exports ``AIOCOLLECT_JOB_ID``.

    .venv/bin/python scripts/jobs_without_id_race.py [--races 20] [--json]

Each race starts ``aiocollect store`` once (shared by all races), then four rank
processes (jobs 100 and 200, two ranks each, no job id, group ``race<i>``), releases them
at the same moment and classifies the outcome: ``mixed group succeeded`` (a rank returned
301, the sum of one rank of each job), ``failed on the conflict marker`` (a rank got
"another job is using group"), ``both jobs ok`` (one after the other), ``one job ok,
other refused``, ``both refused``. Works against older versions too (to measure "before").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from aiocollect.testing import free_port

SCRIPT = """\
    import asyncio, sys
    import numpy as np
    import aiocollect

    async def main() -> None:
        base, name = int(sys.argv[1]), sys.argv[2]
        print("ready", flush=True)
        sys.stdin.readline()  # released together with the other job's ranks
        try:
            async with aiocollect.open_group(name=name, timeout=15) as group:
                data = np.full(4, base + group.rank, dtype=np.int64)
                await group.allreduce(data)
                print("result", int(data[0]), flush=True)
        except Exception as exc:
            print("error", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)

    asyncio.run(main())
"""

BASES = (100, 200)  # two ranks each: 201 and 401 are right; 301 is a mixed group
MARKER = "another job is using group"


def _rank(script: Path, url: str, name: str, base: int, rank: int) -> subprocess.Popen[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("AIOCOLLECT_JOB_ID", "TORCHELASTIC_RUN_ID")
    }
    env.update(
        AIOCOLLECT_STORE=url,
        AIOCOLLECT_RANK=str(rank),
        AIOCOLLECT_WORLD_SIZE="2",
        AIOCOLLECT_TRANSPORT="tcp",
        AIOCOLLECT_INSECURE="1",
    )
    return subprocess.Popen(
        [sys.executable, str(script), str(base), name],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def race(script: Path, url: str, name: str) -> list[str]:
    """One race: the last output line of each rank (jobs 100 then 200, ranks 0, 1)."""
    procs = [_rank(script, url, name, base, r) for base in BASES for r in (0, 1)]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline() == "ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        return [out.splitlines()[-1] if out else "" for out in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def classify(lines: list[str]) -> str:
    sums = [int(m.group(1)) for line in lines if (m := re.fullmatch(r"result (\d+)", line))]
    if 301 in sums:
        return "mixed group succeeded"
    if any(MARKER in line for line in lines):
        return "failed on the conflict marker"
    if len(sums) == 4:
        return "both jobs ok"
    return "one job ok, other refused" if sums else "both refused"


def main(races: int) -> dict[str, object]:
    port = free_port("127.0.0.1")
    with (
        tempfile.TemporaryDirectory() as tmp,
        subprocess.Popen(
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
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        ) as store,
    ):
        try:
            assert store.stdout is not None
            assert "listening" in store.stdout.readline()
            script = Path(tmp) / "job.py"
            script.write_text(textwrap.dedent(SCRIPT))
            tally: dict[str, int] = {}
            started = time.monotonic()
            for i in range(races):
                kind = classify(race(script, f"tcp://127.0.0.1:{port}", f"race{i}"))
                tally[kind] = tally.get(kind, 0) + 1
            return {
                "races": races,
                "outcomes": tally,
                "seconds": round(time.monotonic() - started, 1),
            }
        finally:
            store.terminate()
            store.wait(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--races", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = main(args.races)
    print(
        json.dumps(result)
        if args.json
        else f"{result['races']} races in {result['seconds']} s: {result['outcomes']}"
    )
