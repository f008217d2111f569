"""The figure of ``aiocollect bench --plot``: four panels from the summary rows.

- top left, the headline: the same-run ratio, aiocollect bus bandwidth / the baseline's
  (gloo; else the ``--compare`` transport; else, with ``--floor`` alone, the floor's: floor
  time / aiocollect p50), per size, on a linear axis with the line at 1;
- top right: bus bandwidth on a linear axis (large sizes are what it is about; a log axis
  let the 4-byte points squash them into a sliver);
- bottom: p50 latency split at 256 KiB, each half on its own axis (small sizes linear in
  µs, large sizes in ms), so neither range flattens the other;
- with ``--floor``, the framework-free floor's p50 as a grey dash-dotted series per
  collective in both latency panels;
- a barrier (no data, size 0) has no place on a size axis: it is left out (the table has
  it);
- a footer with the date, the load average (start, peak, end, against the cores) and the
  load warning when the machine was busy.

Every series (a collective and a backend) has its own colour; the backend also sets the line
style and marker.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from aiocollect.bench.spec import NO_DATA, format_size

MISSING = (
    "--plot needs matplotlib, which is not installed "
    "(pip install matplotlib, or pip install 'aiocollect[plot]')"
)

#: Where the latency panels split.
SPLIT = 256 * 1024


def available() -> bool:
    """Whether matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def footer(date: str, load: dict[str, Any]) -> str:
    """The line printed under the figure: date and load averages (``machine.LoadWatch``'s
    summary; empty means unknown)."""

    def fmt(key: str) -> str:
        value = load.get(key)
        return "?" if value is None else f"{value:.2f}"

    text = (
        f"measured {date}; 1-min load average start {fmt('start')}, max {fmt('max')}, "
        f"end {fmt('end')} on {load.get('cores', '?')} cores"
    )
    if load.get("warning"):
        text += "\nWARNING: " + str(load["warning"])
    return text


def _series(rows: list[dict[str, Any]], transport: str | None) -> list[tuple[str, str, str, str]]:
    compare = next((r["compare_transport"] for r in rows if "compare_transport" in r), None)
    out = [
        (
            "aiocollect",
            "-",
            "o",
            f"aiocollect/{transport}" if compare is not None and transport else "aiocollect",
        )
    ]
    if compare is not None:
        out.append(("compare", ":", "s", f"aiocollect/{compare}"))
    out.append(("gloo", "--", "x", "gloo"))
    return out


def _latency(
    ax_small: Any, ax_large: Any, pts: list[tuple[int, float]], style: str, kw: dict[str, Any]
) -> None:
    """One series of (size, p50 µs) points in the two latency panels: sizes below
    ``SPLIT`` in µs, the others in ms."""
    small = [p for p in pts if p[0] < SPLIT]
    large = [p for p in pts if p[0] >= SPLIT]
    if small:
        ax_small.plot([p[0] for p in small], [p[1] for p in small], style, **kw)
    if large:
        ax_large.plot([p[0] for p in large], [p[1] / 1000 for p in large], style, **kw)


def plot(
    rows: list[dict[str, Any]],
    path: Path,
    title: str,
    transport: str | None = None,
    footer: str = "",
) -> None:
    """Draw one PNG (the panels above) from :func:`report.aggregate` rows.

    Concurrent cases are left out (their times are for K collectives at once). Rows
    aggregated with ``compare`` add a dotted series per collective for the compared
    transport; the series are then labelled ``aiocollect/TRANSPORT`` (``transport``: the
    ``--transport`` one) and ``aiocollect/COMPARED``. ``footer`` goes under the panels.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    if not available():
        raise RuntimeError(MISSING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows = [r for r in rows if r["collective"] not in NO_DATA]  # (module docstring)
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (ax_ratio, ax_bw), (ax_small, ax_large) = axes
    palette = (
        list(plt.get_cmap("tab10").colors)  # type: ignore[attr-defined]
        + list(plt.get_cmap("Dark2").colors)  # type: ignore[attr-defined]
    )
    names = list(dict.fromkeys(r["name"] for r in rows if r["concurrency"] == 1))
    series = _series(rows, transport)
    has_gloo = any(r.get("gloo") is not None for r in rows)
    has_compare = any("compare_transport" in r for r in rows)
    ref_key, ref_tag = ("bw_ratio", "gloo") if has_gloo else ("compare_bw_ratio", series[-2][3])
    floor_only = not has_gloo and not has_compare and any("floor_ratio" in r for r in rows)
    if floor_only:
        ref_tag = "floor"

    def headline(r: dict[str, Any]) -> float | None:
        """The row's headline ratio (--floor alone: floor time / aiocollect's p50)."""
        if floor_only:
            return 1 / r["floor_ratio"] if r.get("floor_ratio") else None
        value: float | None = r.get(ref_key)
        return value

    ticks: set[int] = set()
    n = 0
    for name in names:
        mine = [r for r in rows if r["name"] == name and r["concurrency"] == 1]
        ratio = [(r["size"], v) for r in mine if (v := headline(r)) is not None and v == v]
        for backend, style, marker, tag in series:
            # Requested sizes on the x axis: the bytes moved differ from them only by
            # rounding to whole elements per rank (see spec.shape).
            pts = [(r["size"], r[backend]) for r in mine if r.get(backend) is not None]
            if not pts:
                continue
            color = palette[n % len(palette)]
            n += 1
            ticks.update(p[0] for p in pts)
            label = f"{name} ({tag})"
            kw = {"marker": marker, "color": color, "label": label}
            ax_bw.plot([p[0] for p in pts], [p[1]["busbw_gbps"] for p in pts], style, **kw)
            _latency(ax_small, ax_large, [(p[0], p[1]["p50_us"]) for p in pts], style, kw)
            if backend == "aiocollect" and ratio:
                ax_ratio.plot(
                    [p[0] for p in ratio],
                    [p[1] for p in ratio],
                    style,
                    marker=marker,
                    color=color,
                    label=f"{name}: {tag} / {ref_tag}",
                )
    floor = [
        (r["collective"], r["size"], r["floor_us"])
        for r in rows
        if r.get("floor_us") is not None and r["floor_us"] == r["floor_us"]
    ]
    for i, coll in enumerate(dict.fromkeys(f[0] for f in floor)):
        pts = [(size, us) for c, size, us in floor if c == coll]
        kw = {"marker": "+x*"[i % 3], "color": "grey", "label": f"{coll} (framework-free floor)"}
        _latency(ax_small, ax_large, pts, "-.", kw)
        ticks.update(p[0] for p in pts)
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.set_ylim(bottom=0)
    if not ax_ratio.get_lines()[:-1]:
        ax_ratio.text(
            0.5, 0.5, "no baseline in this run", ha="center", transform=ax_ratio.transAxes
        )
    panels = (
        (ax_ratio, f"busbw ratio vs {ref_tag} (>1: aiocollect faster)", ticks),
        (ax_bw, "bus bandwidth (GB/s)", ticks),
        (
            ax_small,
            f"p50 latency (µs), sizes < {format_size(SPLIT)}",
            {t for t in ticks if t < SPLIT},
        ),
        (
            ax_large,
            f"p50 latency (ms), sizes ≥ {format_size(SPLIT)}",
            {t for t in ticks if t >= SPLIT},
        ),
    )
    for ax, ylabel, own in panels:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes, NCCL-tests convention)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if own:
            shown = sorted(own)[:: max(1, (len(own) + 7) // 8)]
            ax.set_xticks(shown, [format_size(s) for s in shown])
        ax.xaxis.set_minor_locator(NullLocator())
        if ax is not ax_ratio:
            ax.set_ylim(bottom=0)
    for ax in (ax_ratio, ax_bw, *((ax_small, ax_large) if floor else ())):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    if footer:
        fig.text(
            0.01,
            0.005,
            footer,
            fontsize="small",
            va="bottom",
            color="darkred" if "WARNING" in footer else "black",
        )
    fig.tight_layout(rect=(0, 0.05 if footer else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
