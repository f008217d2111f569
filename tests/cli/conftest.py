"""Fixtures for the command-line tests: run the real ``aiocollect`` CLI in a subprocess."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.support.cli import RunCli, WriteScript, cli_command


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every command-line test that starts ranks runs with both ways ``aiocollect run``
    starts them (forked from the launcher, the default, and exec'd); one marked
    ``no_ranks`` (argument errors, ``info``, units) runs once, forked."""
    if "start_method" in metafunc.fixturenames:
        once = metafunc.definition.get_closest_marker("no_ranks") is not None
        metafunc.parametrize("start_method", ["fork"] if once else ["fork", "exec"], indirect=True)


@pytest.fixture(autouse=True)
def start_method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The start method of this run of the test (``AIOCOLLECT_START_METHOD``, inherited
    by the launchers the tests start)."""
    method: str = request.param
    monkeypatch.setenv("AIOCOLLECT_START_METHOD", method)
    return method


@pytest.fixture
def run_cli(tmp_path: Path) -> RunCli:
    """Run ``aiocollect ARGS`` in ``tmp_path`` to completion (bounded by ``timeout``)."""

    def run(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli_command(*args),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    return run


@pytest.fixture
def write_script(tmp_path: Path) -> WriteScript:
    """Write a dedented script into ``tmp_path`` and return its path."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write
