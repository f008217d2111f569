"""Which path a process takes: compiled modules only when every one is built, fresh, and
AIOCOLLECT_PURE is unset (aiocollect/_compiled.py); no loop, fake files."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

import pytest

from aiocollect import _compiled

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _tree(root: Path) -> None:
    """A package directory with every compiled module's source and extension module, the
    extensions newer."""
    for name in _compiled.MODULES:
        source = root.joinpath(*name.split(".")[1:]).with_suffix(".py")
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        os.utime(source, (1000, 1000))
    for name in (*_compiled.MODULES, _compiled.SHARED_LIB):
        base = root.joinpath(*name.split(".")[1:])
        base.with_name(base.name + SUFFIX).write_bytes(b"")
        os.utime(base.with_name(base.name + SUFFIX), (2000, 2000))


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _tree(tmp_path)
    monkeypatch.setattr(_compiled, "_PACKAGE_DIR", tmp_path)
    return tmp_path


def test_a_fresh_build_runs_compiled(tree: Path) -> None:
    assert _compiled._pure_reason({}) is None
    assert _compiled._pure_reason({"AIOCOLLECT_PURE": "0"}) is None


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_switch_forces_the_pure_path(tree: Path, value: str) -> None:
    assert _compiled._pure_reason({"AIOCOLLECT_PURE": value}) == "AIOCOLLECT_PURE is set"


def test_a_source_edited_after_the_build_runs_pure(tree: Path) -> None:
    name = _compiled.MODULES[0]
    os.utime(_compiled.source_path(name), (3000, 3000))
    assert _compiled._pure_reason({}) == f"stale build: {name} changed since (make compiled)"


def test_the_shared_library_dates_the_build(tree: Path) -> None:
    """A module's own extension is a stub a rebuild may leave older than its source; the
    shared library holds the code."""
    name = _compiled.MODULES[0]
    os.utime(_compiled.source_path(name), (3000, 3000))
    lib = _compiled.extension_path(_compiled.SHARED_LIB)
    assert lib is not None
    os.utime(lib, (4000, 4000))
    assert _compiled._pure_reason({}) is None


def test_a_missing_module_runs_pure(tree: Path) -> None:
    path = _compiled.extension_path(_compiled.SHARED_LIB)
    assert path is not None
    path.unlink()
    why = _compiled._pure_reason({})
    assert why == f"incomplete build, missing {_compiled.SHARED_LIB} (make compiled)"


def test_no_build_runs_pure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compiled, "_PACKAGE_DIR", tmp_path)
    assert _compiled._pure_reason({}) == "not built (make compiled)"


def test_status_names_every_module() -> None:
    status = _compiled.status()
    assert set(status) == set(_compiled.MODULES)
    want = "pure" if _compiled.PURE_REASON is not None else "compiled"
    assert set(status.values()) == {want}
