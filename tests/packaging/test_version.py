"""The version is written once, in aiocollect/__init__.py, and everything else follows it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import aiocollect

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_reads_the_version_from_the_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["hatch"]["version"]["path"] == "aiocollect/__init__.py"


def test_installed_metadata_matches() -> None:
    assert metadata.version("aiocollect") == aiocollect.__version__


def test_changelog_has_the_version() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (\S+)", changelog, re.M)
    assert headings[0] == "Unreleased"
    assert aiocollect.__version__ in headings, headings
    assert not re.search(r"#\d+|\bissue \d+|\bsessions?\b", changelog, re.I)
