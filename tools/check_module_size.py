"""List every module of the package over the house limit of lines; fail if there is one.

    python tools/check_module_size.py               # aiocollect/, 600 lines (make lint)
    python tools/check_module_size.py --limit 450 aiocollect/transport

Counts the lines of every ``*.py`` file under the given folders (default ``aiocollect``)
and prints ``PATH: LINES lines (limit L)`` for each one over ``--limit`` (600: the house
limit, a module has one job), largest first. Exit status 0 when none is over, 1 when some
are, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: The house limit on a module's lines.
LIMIT = 600


def oversized(roots: list[Path], limit: int) -> list[tuple[Path, int]]:
    """``(path, lines)`` of every ``*.py`` file under ``roots`` with more than ``limit``
    lines, largest first."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            with path.open("rb") as f:
                lines = sum(1 for _ in f)
            if lines > limit:
                found.append((path, lines))
    return sorted(found, key=lambda item: -item[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/check_module_size.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("aiocollect")])
    parser.add_argument("--limit", type=int, default=LIMIT, help=f"lines (default {LIMIT})")
    ns = parser.parse_args(argv)
    missing = [str(r) for r in ns.roots if not r.is_dir()]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    over = oversized(ns.roots, ns.limit)
    for path, lines in over:
        print(f"{path}: {lines} lines (limit {ns.limit})")
    if over:
        print(f"check_module_size: {len(over)} module(s) over {ns.limit} lines", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
