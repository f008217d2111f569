"""Bus bandwidth and p50 latency versus size (log-log), aiocollect against gloo and, with
``--compare``, against aiocollect over the compared transport."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from aiocollect.bench.spec import format_size

MISSING = ("--plot needs matplotlib, which is not installed "
           "(pip install matplotlib, or pip install 'aiocollect[plot]')")


def available() -> bool:
    """Whether matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def plot(rows: list[dict[str, Any]], path: Path, title: str,
         transport: str | None = None) -> None:
    """Draw one PNG with two panels (bandwidth, latency) from :func:`report.aggregate` rows.

    Concurrent cases are left out (their times are for K collectives at once). Rows
    aggregated with ``compare`` add a dotted series per collective for the compared
    transport; the series are then labelled ``aiocollect/TRANSPORT`` (``transport``: the
    ``--transport`` one) and ``aiocollect/COMPARED``.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    if not available():
        raise RuntimeError(MISSING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(r["name"] for r in rows if r["concurrency"] == 1))
    ticks: set[int] = set()
    compare = next((r["compare_transport"] for r in rows if "compare_transport" in r), None)
    series = [("aiocollect", "-", "o",
               f"aiocollect/{transport}" if compare is not None and transport
               else "aiocollect")]
    if compare is not None:
        series.append(("compare", ":", "s", f"aiocollect/{compare}"))
    series.append(("gloo", "--", "x", "gloo"))
    for i, name in enumerate(names):
        color = colors[i % len(colors)]
        mine = [r for r in rows if r["name"] == name]
        for backend, style, marker, tag in series:
            # Requested sizes on the x axis: the bytes moved differ from them only by
            # rounding to whole elements per rank (see spec.shape).
            pts = [(r["size"], r[backend]) for r in mine if r.get(backend) is not None]
            if not pts:
                continue
            sizes = [p[0] for p in pts]
            ticks.update(sizes)
            label = f"{name} ({tag})"
            ax_bw.plot(sizes, [p[1]["busbw_gbps"] for p in pts], style, marker=marker,
                       color=color, label=label)
            ax_lat.plot(sizes, [p[1]["p50_us"] for p in pts], style, marker=marker,
                        color=color, label=label)
    for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s)"), (ax_lat, "p50 latency (µs)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes, NCCL-tests convention)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        shown = sorted(ticks)[:: max(1, (len(ticks) + 7) // 8)]
        ax.set_xticks(shown, [format_size(s) for s in shown])
        ax.xaxis.set_minor_locator(NullLocator())
    ax_bw.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
