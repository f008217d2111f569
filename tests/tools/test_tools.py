"""tools/: every Python tool says what it measures and how to run it (``--help``), and
the module-size check lists the modules over its limit and fails on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
#: The commands among them (tools/mkdocs_hooks.py is a module MkDocs loads, not a command).
PYTHON_TOOLS = sorted(
    p.name for p in TOOLS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_tools_are_there() -> None:
    assert {
        "alternate.py",
        "check_module_size.py",
        "op_cpu.py",
        "opcodes.py",
        "soak_elastic.py",
        "torch_dist_suite.py",
    } <= set(PYTHON_TOOLS)
    assert (TOOLS / "system-deps.sh").is_file()


@pytest.mark.parametrize("tool", PYTHON_TOOLS)
def test_help_says_how_to_run_it(tool: str) -> None:
    done = _run(str(TOOLS / tool), "--help")
    assert done.returncode == 0, done.stderr
    assert f"tools/{tool}" in done.stdout  # (the usage line, with how to start it)
    assert len(done.stdout.splitlines()) > 8  # (and the docstring: what it measures)


def test_module_size_check_lists_the_modules_over_the_limit(tmp_path: Path) -> None:
    (tmp_path / "small.py").write_text("x = 1\n" * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.py").write_text("x = 1\n" * 5)
    (tmp_path / "notes.txt").write_text("x\n" * 50)
    check = str(TOOLS / "check_module_size.py")
    done = _run(check, str(tmp_path), "--limit", "4")
    assert done.returncode == 1
    assert done.stdout.splitlines() == [f"{tmp_path / 'sub' / 'big.py'}: 5 lines (limit 4)"]
    assert _run(check, str(tmp_path), "--limit", "5").returncode == 0
    assert _run(check, str(tmp_path / "missing")).returncode == 2
