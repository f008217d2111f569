"""``python -m aiocollect.bench.forked --parent PID ARGS_JSON``: one benchmark round's
aiocollect ranks, forked from one process that imported aiocollect.

``aiocollect run`` forks its ranks from the launcher by default (aiocollect.cli.forked),
and where ranks share cores that makes small operations faster (``aiocollect run -n 4
[--start-method exec] tools/op_cpu.py`` compares the two). So that ``aiocollect bench``
measures the ranks users get, its runner starts an aiocollect round through this module
under the same start method (``AIOCOLLECT_START_METHOD``, default ``fork``): it imports
what the ranks import, forks one child per rank, each running
:func:`aiocollect.bench.worker.main` with its own arguments (``ARGS_JSON``: a JSON list of
argument lists, ``--parent`` of each set to this process), and waits for them all. The
framework-free floor forks its ranks too; torch's gloo ranks are exec'd as ``torchrun``
starts them.

Exit status 0 when every rank exited 0; otherwise 1, after the other ranks had
``FAIL_GRACE`` seconds to finish (then SIGKILL). A SIGTERM stops every rank at once. It
exits (and its ranks with it) when ``--parent`` (the bench runner) goes away; it ignores
SIGINT (a Ctrl-C reaches the ranks, and the runner, which then stops it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from types import FrameType

from aiocollect.cli.forked import PRELOAD, exit_code, flush_stdio, kill_and_reap, preload

#: Seconds the other ranks get to finish after one failed (as the runner's wait_all).
FAIL_GRACE = 5.0


def _rank(args: list[str]) -> None:
    """The forked rank: run the worker, leave with its status (never returns)."""
    code = 1
    try:
        from aiocollect.bench import worker

        code = worker.main(args)
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
    finally:
        flush_stdio()
        os._exit(code)


def run(parent: int, ranks: list[list[str]]) -> int:
    """Fork one worker per argument list in ``ranks`` and wait for them (see the module
    docstring); returns the exit status."""
    why = preload((*PRELOAD, "aiocollect.bench.worker"))
    if why is not None:
        print(f"aiocollect bench: cannot fork the ranks: {why}", file=sys.stderr, flush=True)
        return 1
    me = str(os.getpid())
    pids: list[int] = []
    for args in ranks:
        pid = os.fork()
        if pid == 0:
            _rank([*args, "--parent", me])
        pids.append(pid)

    def stop(signum: int, frame: FrameType | None) -> None:
        kill_and_reap(running)
        os._exit(128 + signum)

    running = set(pids)
    signal.signal(signal.SIGTERM, stop)
    # A Ctrl-C reaches the ranks and the runner itself; the runner then stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    failed_at: float | None = None
    status = 0
    while running:
        if os.getppid() != parent:  # the runner is gone
            kill_and_reap(running)
            return 1
        pid, wstatus = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > FAIL_GRACE:
                kill_and_reap(running)
                return 1
            time.sleep(0.05)
            continue
        running.discard(pid)
        if os.waitstatus_to_exitcode(wstatus) != 0:
            status = 1
            failed_at = failed_at or time.monotonic()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiocollect.bench.forked")
    parser.add_argument("--parent", type=int, required=True, help="pid of the bench runner")
    parser.add_argument("ranks", help="JSON list of each rank's worker arguments")
    ns = parser.parse_args(argv)
    return run(ns.parent, json.loads(ns.ranks))


if __name__ == "__main__":
    sys.exit(main())
