"""Where and under what load a benchmark ran: the machine's description and load
averages (sampled while the run lasts), and strict-JSON cleaning of the document.

Used by ``aiocollect bench`` (:mod:`aiocollect.cli.bench`) for its JSON and its load
warning, and by the head-of-line benchmark (:mod:`aiocollect.bench.hol`).
"""

from __future__ import annotations

import math
import os
import platform
import threading
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from aiocollect import __version__


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where unknown)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cores() -> int:
    """The CPUs this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class LoadWatch:
    """Samples the 1-minute load average every ``period`` seconds on a daemon thread
    while a run lasts, so that a run measured on a busy machine says so.

    :meth:`summary` gives ``cores``, ``start``, ``end`` and ``max`` (1-minute load
    averages; None where the platform has none) and ``warning``: a sentence when the
    load average exceeded the cores at any sample, else None.
    """

    def __init__(self, period: float = 1.0, ranks: int = 0) -> None:
        self.period = period
        self.ranks = ranks  # rank processes this run starts on this machine
        self.cores = cores()
        self.start_load = load_average()
        self.samples: list[float] = [self.start_load[0]] if self.start_load else []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load-watch", daemon=True)

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            now = load_average()
            if now:
                self.samples.append(now[0])

    def stop(self) -> None:
        """Stop sampling (idempotent); takes a last sample."""
        if not self._stop.is_set():
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join()
            now = load_average()
            if now:
                self.samples.append(now[0])

    def summary(self) -> dict[str, Any]:
        end = self.samples[-1] if self.samples else None
        peak = max(self.samples) if self.samples else None
        return {
            "cores": self.cores,
            "start": self.start_load[0] if self.start_load else None,
            "end": end,
            "max": peak,
            "samples": len(self.samples),
            "warning": load_warning(peak, self.cores, self.ranks),
        }


def load_warning(peak: float | None, ncores: int, ranks: int = 0) -> str | None:
    """The warning for a run whose 1-minute load average reached ``peak`` on ``ncores``
    CPUs, or None when it stayed at or below the cores. ``ranks``: the rank processes the
    run itself starts on this machine; when they outnumber the cores, the warning says
    that part of the load is the run's own."""
    if peak is None or peak <= ncores:
        return None
    own = (
        f"; this run's own {ranks} ranks outnumber the cores, so up to {ranks} of that "
        "load is the run itself"
        if ranks > ncores
        else ""
    )
    return (
        f"the load average reached {peak:.2f} on {ncores} cores during this run: "
        "the machine was busy, so these figures are taken under load (compare "
        f"same-run ratios, not absolute times){own}"
    )


def machine_info(loop: str) -> dict[str, Any]:
    """Where the numbers were measured: cores, CPU, Python, libraries, event loop, date,
    load average at the end (the machine may be shared)."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "affinity_cpus": affinity,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "aiocollect": __version__,
        "numpy": np.__version__,
        "event_loop": loop,
        "uvloop": _version("uvloop"),
        "torch": _version("torch"),
        "matplotlib": _version("matplotlib"),
        "loadavg_end": load_average(),
    }


def clean(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
