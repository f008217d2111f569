"""What the bench tests share: running `aiocollect bench`, reading its tables, synthetic
rounds for the report, and the skips for single-copy pulls and matplotlib."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiocollect.bench import plot as plotting
from aiocollect.bench.spec import Case
from aiocollect.transport import cma

SMOKE = ("--rounds", "1", "--iters", "3", "--warmup", "1")


def run_bench(*args: str, cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiocollect", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


def cells(line: str) -> list[str]:
    """A table line's cells (columns are separated by at least two spaces)."""
    return re.split(r"\s{2,}", line.strip())


def table_of(stdout: str, title: str) -> tuple[list[str], list[list[str]]]:
    """The header and data lines of the table whose title line starts with ``title``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    body: list[list[str]] = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        body.append(cells(line))
    return cells(lines[start + 1]), body


CASES = [Case("allreduce", 4), Case("allreduce", 65536), Case("allreduce", 65536, 2)]
META = {
    "world_size": 2,
    "transport": "shm",
    "dtype": "float32",
    "rounds": 2,
    "baseline_note": None,
    "idle_lag_p99_ms": 0.19,
}


def _record(case: Case, scale: float, algorithm: str, correct: bool) -> dict[str, Any]:
    k = case.concurrency
    return {
        "collective": case.collective,
        "name": case.name,
        "concurrency": k,
        "size": case.size,
        "bytes": case.size,
        "count": max(1, case.size // 4),
        "dtype": "float32",
        "iters": 3,
        "algorithm": algorithm,
        "times_us": [t * scale for t in (100.0, 120.0, 110.0)],
        "seq_times_us": [t * scale * k for t in (90.0, 95.0, 99.0)] if k > 1 else None,
        "mean_us": 111.0 * scale,
        "lag_us": {"samples": 5, "p50": 100.0, "p99": 250.0 * scale, "max": 300.0},
        "rss_growth_mib": [0.5, 0.25],
        "correct": correct,
        "wrong_ranks": [] if correct else [1],
    }


def _result(backend: str, scale: float, algorithm: str, correct: bool = True) -> dict[str, Any]:
    return {
        "backend": backend,
        "label": "r/2",
        "idle_lag_us": {"p99": 190.0},
        "records": [_record(c, scale, algorithm, correct) for c in CASES],
        "loop": "asyncio",
    }


def synthetic_rounds(
    gloo: bool, compare: bool = False, compare_correct: bool = True
) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate((1.0, 1.5)):
        entry: dict[str, Any] = {
            "round": i + 1,
            "aiocollect": _result("aiocollect", s, "auto:ring"),
        }
        if compare:
            entry["compare"] = {
                **_result("aiocollect", 4 * s, "auto:ring", compare_correct),
                "transport": "tcp",
            }
        if gloo:
            entry["gloo"] = _result("gloo", 2 * s, "gloo")
        out.append(entry)
    return out


needs_pulls = pytest.mark.skipif(
    cma.self_check() is not None, reason="process_vm_readv is unavailable or forbidden here"
)


needs_mpl = pytest.mark.skipif(not plotting.available(), reason="matplotlib not installed")


def capture_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import matplotlib.figure

    figs: list[Any] = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig: matplotlib.figure.Figure, *args: Any, **kwargs: Any) -> None:
        figs.append(
            {
                "axes": [
                    {
                        "lines": [
                            (
                                str(ln.get_label()),
                                list(ln.get_xdata()),  # type: ignore[arg-type]
                                list(ln.get_ydata()),  # type: ignore[arg-type]
                                ln.get_color(),
                            )
                            for ln in ax.get_lines()
                        ],
                        "yscale": ax.get_yscale(),
                        "ylabel": ax.get_ylabel(),
                        "texts": [t.get_text() for t in ax.texts],
                    }
                    for ax in fig.axes
                ],
                "texts": [t.get_text() for t in fig.texts],
            }
        )
        save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return figs
