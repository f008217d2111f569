"""The documentation site's pieces that run without MkDocs: its nav, the role hook, and the
reference-page parsing of tools/check_docstrings.py (with griffe, the docs extra)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_nav_lists_every_page() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", config, re.M))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert nav == pages


def test_the_hook_shows_roles_as_code() -> None:
    hooks = _load("mkdocs_hooks")
    html = (
        "see :class:<code>Store</code>, :func:<code>~aiocollect.store.open_store</code> "
        "and :meth:<code>Group.allreduce</code>; keep <code>:x:</code>"
    )
    assert hooks.on_page_content(html, page=None) == (
        "see <code>Store</code>, <code>open_store</code> and <code>Group.allreduce</code>; "
        "keep <code>:x:</code>"
    )


def test_blocks_reads_identifiers_and_members(tmp_path: Path) -> None:
    pytest.importorskip("griffe", reason="the docs extra (make docs installs it)")
    check = _load("check_docstrings")
    (tmp_path / "a.md").write_text(
        "# A\n\n::: pkg.mod\n    options:\n      members:\n        - one\n        - two\n"
        "\ntext\n\n::: pkg.other.Thing\n"
    )
    assert check.blocks(tmp_path) == {"pkg.mod": {"one", "two"}, "pkg.other.Thing": None}
