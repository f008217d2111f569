"""Run torch's own ``DistributedTest`` suite against the "aiocollect" backend and gloo.

The torch wheel ships ``torch.testing._internal.distributed.distributed_test`` but not the
driver torch's CI uses (``test/distributed/test_distributed_spawn.py``). This script plays
that driver's part: it sets ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR``, builds the test
class from ``TestDistBackend`` and ``DistributedTest._DistTestBase`` whose ``setUp`` spawns
one process per rank, and runs every test with unittest, once per backend, each backend in
its own interpreter (the suite reads ``BACKEND`` at import).

    python tools/torch_dist_suite.py                       # aiocollect, then gloo
    python tools/torch_dist_suite.py --backends aiocollect -k allreduce
    python tools/torch_dist_suite.py --json results.json   # per-test outcomes

Prints ``<backend>: N passed, N failed, N skipped`` per backend, then the tests that pass
with gloo but not with aiocollect (with aiocollect's failure line or skip reason). The suite
decides many skips by the backend's name (``BACKEND != "gloo"``, ``require_backend_is_
available({"gloo"})``); the tests aiocollect skipped that way are run once more on
aiocollect with the skip decisions taken for gloo (the suite imported under gloo's name,
the ranks then initialised with "aiocollect"), and their outcomes printed. Exit status 0
when every test that passed with gloo passed with aiocollect one way or the other (or only
one backend was run and nothing failed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any

_WORKER_ENV = "AIOCOLLECT_DIST_SUITE_WORKER"
_START_ENV = "AIOCOLLECT_DIST_SUITE_START"
_NAME_ONLY_ENV = "AIOCOLLECT_DIST_SUITE_UNDECLARED"
_GATES_ENV = "AIOCOLLECT_DIST_SUITE_GATES"

# -- the worker: defines the test class at import, so that the spawned rank processes (which
# re-run this file as __mp_main__) find it by name -------------------------------------------

if os.environ.get(_WORKER_ENV):
    import torch
    import torch.distributed as dist

    if os.environ["BACKEND"] == "aiocollect":
        import aiocollect.torch  # noqa: F401  (registers the backend in every rank process)

    torch.backends.cuda.matmul.allow_tf32 = False
    from torch.testing._internal.common_distributed import DistTestCases

    if os.environ["BACKEND"] == "aiocollect" and not os.environ.get(_NAME_ONLY_ENV):
        # The suite keeps, per feature, the set of backends that implement it (read by the
        # skip decorators, so before the suite is imported); a backend outside torch
        # declares itself there, as "ucc" is declared. aiocollect offers what gloo offers
        # on CPU: DDP, sub-groups, and it is an available plugin.
        for feature in ("ddp", "subgroup", "plugin"):
            DistTestCases.backend_feature[feature].add("aiocollect")

    _GATES = os.environ.get(_GATES_ENV)  # the backend whose skip decisions apply
    if _GATES:
        os.environ["BACKEND"], _ACTUAL = _GATES, os.environ["BACKEND"]
    from torch.testing._internal.distributed import distributed_test
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    if _GATES:
        # The skip decorators ran with gloo's name; the tests themselves run the real one.
        os.environ["BACKEND"] = distributed_test.BACKEND = _ACTUAL

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
        """As torch's test_distributed_spawn.py builds it: each test starts its ranks (forked
        by default, which saves the ~20 s that importing torch costs each spawned rank on
        a small machine; ``--start spawn`` spawns them as torch's CI does)."""

        def setUp(self) -> None:
            super().setUp()
            if os.environ.get(_START_ENV, "fork") == "spawn":
                self._spawn_processes()
            else:
                self._start_processes(torch.multiprocessing.get_context("fork").Process)

    del dist


class _Recorder(unittest.TextTestResult):
    """A text result that also keeps each test's outcome and first error line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _put(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {
            "outcome": outcome,
            "detail": detail[-2000:],
            "seconds": round(time.monotonic() - self._started, 2),
        }
        self.stream.flush()

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._put(test, "failed", self.failures[-1][1])

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._put(test, "failed", self.errors[-1][1])

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._put(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._put(test, "failed", "unexpected success")


def _worker(pattern: list[str], out: Path) -> int:
    loader = unittest.TestLoader()
    if pattern:
        loader.testNamePatterns = [
            p[1:] if p.startswith("=") else p if "*" in p else f"*{p}*" for p in pattern
        ]
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=_Recorder)
    result = runner.run(suite)
    assert isinstance(result, _Recorder)
    out.write_text(json.dumps(result.outcomes, indent=1, sort_keys=True))
    return 0


# -- the parent: one worker per backend ------------------------------------------------------


def _run_backend(
    backend: str,
    world: int,
    pattern: list[str],
    log: Path | None,
    timeout: float,
    start: str,
    undeclared: bool,
    gates: str | None = None,
) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix=f"dist-suite-{backend}-") as tmp:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
        out = Path(tmp) / "outcomes.json"
        env = dict(
            os.environ,
            BACKEND=backend,
            WORLD_SIZE=str(world),
            TEMP_DIR=tmp,
            **{_WORKER_ENV: "1", _START_ENV: start},
        )
        if undeclared:
            env[_NAME_ONLY_ENV] = "1"
        if gates:
            env[_GATES_ENV] = gates
        env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(out)]
        for p in pattern:
            cmd += ["-k", p]
        stream = open(log, "w") if log else None  # noqa: SIM115
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdout=stream or None,
                stderr=subprocess.STDOUT if stream else None,
                timeout=timeout,
                check=False,
            )
        finally:
            if stream:
                stream.close()
        if not out.exists():
            raise SystemExit(
                f"{backend}: the suite ended (exit {proc.returncode}) without "
                "results" + (f"; see {log}" if log else "")
            )
        outcomes: dict[str, dict[str, Any]] = json.loads(out.read_text())
        return outcomes


def _counts(outcomes: dict[str, dict[str, Any]]) -> str:
    n = {
        k: sum(1 for o in outcomes.values() if o["outcome"] == k)
        for k in ("passed", "failed", "skipped")
    }
    return f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"


def _last_line(detail: str) -> str:
    lines = [
        ln.strip()
        for ln in detail.strip().splitlines()
        if ln.strip()
        and "PYTORCH_PRINT_REPRO" not in ln
        and not ln.strip().startswith("To execute")
    ]
    errors = [ln for ln in lines if "Error:" in ln or "Error(" in ln]
    return (errors or lines or [""])[-1][:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/torch_dist_suite.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backends",
        default="aiocollect,gloo",
        help="comma-separated backends, run one after the other",
    )
    parser.add_argument(
        "--world-size", type=int, default=3, help="ranks per test (3, as torch's CI runs gloo)"
    )
    parser.add_argument(
        "-k",
        dest="pattern",
        action="append",
        default=[],
        help="run only tests whose name contains this (repeatable)",
    )
    parser.add_argument("--json", type=Path, help="write per-test outcomes here")
    parser.add_argument(
        "--log-dir", type=Path, help="write each backend's unittest output to <dir>/<backend>.log"
    )
    parser.add_argument(
        "--timeout", type=float, default=3 * 3600, help="wall limit per backend in seconds"
    )
    parser.add_argument(
        "--start",
        choices=("fork", "spawn"),
        default="fork",
        help="how each test starts its rank processes (default: fork)",
    )
    parser.add_argument(
        "--undeclared",
        action="store_true",
        help="do not declare aiocollect's features (ddp, subgroup) to the "
        "suite: the tests gated on them skip",
    )
    parser.add_argument(
        "--no-gates",
        action="store_true",
        help="do not rerun the tests aiocollect skipped by name under gloo's skip decisions",
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return _worker(args.pattern, args.worker)

    backends = [b for b in args.backends.split(",") if b]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in backends:
        log = None
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            log = args.log_dir / f"{backend}.log"
        started = time.monotonic()
        results[backend] = _run_backend(
            backend, args.world_size, args.pattern, log, args.timeout, args.start, args.undeclared
        )
        print(
            f"{backend}: {_counts(results[backend])} ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))

    print()
    for backend in backends:
        print(f"{backend:>12}: {_counts(results[backend])}")
    status = 0
    if "aiocollect" in results and "gloo" in results:
        ours, ref = results["aiocollect"], results["gloo"]
        gaps = sorted(
            t
            for t, o in ref.items()
            if o["outcome"] == "passed" and ours.get(t, {}).get("outcome") != "passed"
        )
        print(f"\npassed with gloo, not with aiocollect: {len(gaps)}")
        for t in gaps:
            o = ours.get(t, {"outcome": "missing", "detail": ""})
            print(f"  {t}: {o['outcome']}: {_last_line(o['detail'])}")
        gated = [t for t in gaps if ours.get(t, {}).get("outcome") == "skipped"]
        still = [t for t in gaps if t not in gated]
        if gated and not args.no_gates:
            # Skipped for aiocollect by a check of the backend's name: run them on aiocollect
            # with the skip decisions taken for gloo.
            log = args.log_dir / "aiocollect-gloo-gates.log" if args.log_dir else None
            regated = _run_backend(
                "aiocollect",
                args.world_size,
                [f"=*.{t}" for t in gated],
                log,
                args.timeout,
                args.start,
                args.undeclared,
                "gloo",
            )
            results["aiocollect (gloo's gates)"] = regated
            print(
                f"\nof those, skipped by a check of the backend's name, run on aiocollect "
                f"with gloo's skip decisions: {_counts(regated)}"
            )
            for t in gated:
                o = regated.get(t, {"outcome": "missing", "detail": ""})
                print(
                    f"  {t}: {o['outcome']}"
                    + (f": {_last_line(o['detail'])}" if o["outcome"] != "passed" else "")
                )
                if o["outcome"] != "passed":
                    still.append(t)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
        print(f"\npassed with gloo, not passed by aiocollect either way: {len(still)}")
        for t in sorted(still):
            print(f"  {t}")
        status = 1 if still else 0
    else:
        status = (
            1 if any(o["outcome"] == "failed" for r in results.values() for o in r.values()) else 0
        )
    for backend in backends:
        failed = sorted(t for t, o in results[backend].items() if o["outcome"] == "failed")
        if failed:
            print(f"\nfailed with {backend}: {len(failed)}")
            for t in failed:
                print(f"  {t}: {_last_line(results[backend][t]['detail'])}")
    return status


if __name__ == "__main__":
    sys.exit(main())
