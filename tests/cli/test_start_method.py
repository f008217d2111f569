"""``aiocollect run --start-method``: a forked rank sees what an exec'd one does.

Real launcher, real rank processes: the same probe runs under both start methods (the
autouse ``start_method`` fixture of conftest.py) and must report the same ``__main__``,
command line, ``sys.path[0]``, environment, exit steps and exit statuses.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import aiocollect
from aiocollect.cli.forked import BLAS_THREADS, exit_code, fork_safe
from aiocollect.cli.launch import _blas_ready
from tests.support.cli import RunCli, WriteScript

PROBE = """\
    import atexit, os, sys
    import numpy
    print("name", __name__, "file", os.path.basename(__file__))
    print("argv", sys.argv[1:], "argv0", os.path.basename(sys.argv[0]))
    print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    print("blas", os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS"))
    print("stdin", repr(sys.stdin.read()) if os.environ["AIOCOLLECT_RANK"] != "0" else "-")
    print("main is me", sys.modules["__main__"].__dict__ is globals())
    atexit.register(lambda: print("atexit ran", flush=True))
    print("buffered", end="")  # flushed at exit
"""


def test_a_rank_sees_a_fresh_interpreter(
    run_cli: RunCli, write_script: WriteScript, start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The launcher's environment has no BLAS thread settings: a forking launcher then
    re-executes itself with them, so that numpy's threads are the ranks'.)"""
    for var in BLAS_THREADS:
        monkeypatch.delenv(var, raising=False)
    script = write_script("probe.py", PROBE)
    proc = run_cli("run", "-n", "2", str(script), "x", "--flag")
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        lines = [
            line.removeprefix(f"[rank {rank}] ")
            for line in proc.stdout.splitlines()
            if line.startswith(f"[rank {rank}] ")
        ]
        assert lines[:4] == [
            "name __main__ file probe.py",
            "argv ['x', '--flag'] argv0 probe.py",
            "path0 True",
            "blas 1 1",
        ], (start_method, lines)
        assert lines[4] == ("stdin -" if rank == 0 else "stdin ''")
        assert lines[5:] == ["main is me True", "bufferedatexit ran"], lines


@pytest.mark.parametrize(
    ("body", "status", "stderr_has"),
    [
        ("import sys; sys.exit(3)", "exit code 3", None),
        ("import sys; sys.exit('bad input file')", "exit code 1", "bad input file"),
        ("raise ValueError('boom')", "exit code 1", "ValueError: boom"),
        ("raise KeyboardInterrupt", "killed by SIGINT", "KeyboardInterrupt"),
    ],
)
def test_exit_statuses_match_python(
    run_cli: RunCli, write_script: WriteScript, body: str, status: str, stderr_has: str | None
) -> None:
    script = write_script(
        "fail.py", f"import os\nif os.environ['AIOCOLLECT_RANK'] == '1':\n    {body}\n"
    )
    proc = run_cli("run", "-n", "2", str(script))
    assert proc.returncode != 0
    assert f"rank 1 failed first, {status}" in proc.stderr, proc.stderr
    if stderr_has is not None:
        said = [line for line in proc.stderr.splitlines() if line.startswith("[rank 1] ")]
        assert any(stderr_has in line for line in said), proc.stderr


def test_module_target_sees_its_package(
    run_cli: RunCli, write_script: WriteScript, tmp_path: Path
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text(
        "import sys\nprint('tool', __name__, __spec__.name, sys.argv[1:])\n"
    )
    proc = run_cli("run", "-n", "2", "-m", "pkg.tool", "--opt")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tool __main__ pkg.tool ['--opt']") == 2, proc.stdout


def test_an_embedded_launcher_does_not_replace_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Called from another program (here pytest, numpy imported, no BLAS settings) the
    launcher would have to re-execute that program: it says it cannot fork instead."""
    for var in BLAS_THREADS:
        monkeypatch.delenv(var, raising=False)
    why = _blas_ready(["-n", "2", "x.py"])
    assert why is not None
    assert "OPENBLAS_NUM_THREADS" in why


def test_fork_safe_refuses_with_another_thread() -> None:
    assert fork_safe() is None
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert "2 Python threads" in (fork_safe() or "")
    finally:
        stop.set()
        worker.join()


def test_exit_code_follows_python() -> None:
    assert exit_code(None) == 0
    assert exit_code(3) == 3
    assert exit_code(256 + 4) == 4
    assert exit_code("message") == 1
    assert exit_code(sys) == 1


def test_an_unknown_start_method_variable_is_ignored_once(
    run_cli: RunCli, write_script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad ``AIOCOLLECT_START_METHOD`` is reported once (not again by the launcher it
    re-executes for the BLAS settings) and the job runs with the default."""
    for var in BLAS_THREADS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AIOCOLLECT_START_METHOD", "bogus")
    script = write_script("ok.py", "print('ran')\n")
    proc = run_cli("run", "-n", "2", str(script))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ignoring AIOCOLLECT_START_METHOD='bogus'") == 1, proc.stderr
    assert proc.stdout.count("] ran\n") == 2


def test_the_relaunch_runs_this_package_whatever_the_working_directory_holds(
    tmp_path: Path, write_script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher that re-executes itself for the BLAS settings runs the aiocollect it was
    started with, not a package of that name in its working directory (another checkout):
    started like the console script (``-P``: no working directory on the path), from a
    directory holding a decoy ``aiocollect`` package, every rank runs this one."""
    for var in BLAS_THREADS:
        monkeypatch.delenv(var, raising=False)
    checkout = tmp_path / "checkout"  # the working directory; the script is outside it
    decoy = checkout / "aiocollect"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy package was imported')\n")
    script = write_script("where.py", "import aiocollect\nprint('package', aiocollect.__file__)\n")
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "aiocollect", "run", "-n", "2", str(script)],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"package {aiocollect.__file__}\n") == 2, proc.stdout
