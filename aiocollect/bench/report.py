"""Medians across rounds, the table printed on stdout, and the JSON document.

Per case and backend, p50, p99, bus bandwidth, loop lag and iteration counts are the
medians over rounds; peak-RSS growth is the maximum over ranks and rounds; a case is
correct only if every rank of every round got the closed-form result. Ratios are
aiocollect/gloo of those medians: bandwidth (above 1 favours aiocollect) and p50 latency
(below 1 favours aiocollect). With ``--compare T``, aiocollect over transport T is a third
backend (key ``"compare"``), and ``compare_bw_ratio`` / ``compare_lat_ratio`` are
aiocollect over ``--transport`` divided by aiocollect over T, from the same medians.
With ``--baseline mpi``, Open MPI over shared memory and over TCP are two more backends
(keys ``"mpi_shm"``, ``"mpi_tcp"``: :data:`aiocollect.bench.mpi.LEGS`), each with
``KEY_lat_ratio`` (aiocollect's median p50 / Open MPI's) and ``KEY_bw_ratio`` (busbw,
aiocollect / Open MPI). With ``--floor``, an allreduce, sendrecv or barrier row run one at
a time also holds the framework-free floor's median over rounds (``floor_us``) and
``floor_ratio``: aiocollect's median p50 / ``floor_us`` (1 is the floor; a bandwidth
target of "85 % of the floor" is a ratio of at most 1/0.85), and each round's own ratio
(``floor_ratio_rounds``).
"""

from __future__ import annotations

from typing import Any

from aiocollect.bench import mpi
from aiocollect.bench.floor import BULK_MIN, FLOORED
from aiocollect.bench.spec import Case, checked, format_size
from aiocollect.bench.stats import format_number, format_time, median, summarize

BACKENDS = ("aiocollect", "gloo")
#: With ``--compare``: in the order of the round and of the table's columns.
COMPARE_BACKENDS = ("aiocollect", "compare", "gloo")


def _records(result: dict[str, Any] | None) -> dict[tuple[str, int], dict[str, Any]]:
    if not result or "records" not in result:
        return {}
    return {(r["name"], r["size"]): r for r in result["records"]}


def _combine(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Medians (and maxima, for RSS) over rounds of one backend's summaries."""
    sums = [s for _, s in pairs]

    def med(key: str) -> float:
        return median([s[key] for s in sums if key in s])

    out: dict[str, Any] = {
        "rounds": len(sums),
        "iters": int(med("iters")),
        "p50_us": med("p50_us"),
        "p99_us": med("p99_us"),
        "mean_us": med("mean_us"),
        "busbw_gbps": med("busbw_gbps"),
        "algbw_gbps": med("algbw_gbps"),
        "lag_p99_ms": med("lag_p99_ms"),
        "rss_growth_mib": max((s["rss_growth_mib"] for s in sums), default=float("nan")),
        "correct": all(s["correct"] for s in sums),
        "wrong_ranks": sorted({r for rec, _ in pairs for r in rec.get("wrong_ranks", [])}),
    }
    if any("rank_p50_us" in s for s in sums):
        out["rank_p50_us"] = med("rank_p50_us")
    if any("sync_p50_us" in s for s in sums):
        out["sync_p50_us"] = med("sync_p50_us")
    if any("cpu_max_us" in s for s in sums):
        out["cpu_max_us"], out["cpu_sum_us"] = med("cpu_max_us"), med("cpu_sum_us")
    if any("concurrent_ratio" in s for s in sums):
        out["seq_p50_us"] = med("seq_p50_us")
        out["concurrent_ratio"] = med("concurrent_ratio")
    return out


def aggregate(
    rounds: list[dict[str, Any]], cases: list[Case], world_size: int, compare: str | None = None
) -> list[dict[str, Any]]:
    """One summary row per case: per-backend medians over rounds and the ratios.

    With ``compare`` (the ``--compare`` transport) a row also holds ``"compare"`` (the
    medians of the rounds' ``"compare"`` results, or None), ``"compare_transport"``,
    ``"compare_algorithm"``, and ``"compare_bw_ratio"`` / ``"compare_lat_ratio"``:
    aiocollect's median busbw / the compared one (>1 favours ``--transport``) and median
    p50 / the compared one (<1 favours ``--transport``). Without it, rows are as before.
    Where rounds ran the Open MPI baseline, a row also holds each MPI leg's medians (its
    key in :data:`aiocollect.bench.mpi.LEGS`, None where no round measured it) and
    ``KEY_lat_ratio`` / ``KEY_bw_ratio``. Where rounds ran the floor (``"floor"``
    entries), allreduce rows run one at a time get the floor's entries (:func:`_floor`).
    """
    mpis = mpi_legs(rounds)
    backends = (*(BACKENDS if compare is None else COMPARE_BACKENDS), *mpis)
    indexed = [{b: _records(entry.get(b)) for b in backends} for entry in rounds]
    floors = _floor_records(rounds)
    floored = any(f is not None for f in floors)
    rows = []
    for case in cases:
        key = (case.name, case.size)
        row: dict[str, Any] = {
            "name": case.name,
            "collective": case.collective,
            "concurrency": case.concurrency,
            "size": case.size,
        }
        p50s: list[float | None] = []  # aiocollect's p50 per round (None: not measured)
        for backend in backends:
            # per round, aligned with ``rounds``: (record, its summary) or None
            per_round = [
                (idx[backend][key], summarize(idx[backend][key], world_size))
                if key in idx[backend]
                else None
                for idx in indexed
            ]
            pairs = [p for p in per_round if p is not None]
            if backend == "aiocollect":
                p50s = [None if p is None else p[1]["p50_us"] for p in per_round]
            row[backend] = _combine(pairs) if pairs else None
            if pairs:
                row.setdefault("bytes", pairs[0][0]["bytes"])
                row[f"{backend}_algorithm"] = pairs[0][0]["algorithm"]
        ac, gl = row["aiocollect"], row["gloo"]
        row["bw_ratio"] = _ratio(ac, gl, "busbw_gbps")
        row["lat_ratio"] = _ratio(ac, gl, "p50_us")
        for leg in mpis:
            row[f"{leg}_lat_ratio"] = _ratio(ac, row[leg], "p50_us")
            row[f"{leg}_bw_ratio"] = _ratio(ac, row[leg], "busbw_gbps")
        if compare is not None:
            row["compare_transport"] = compare
            row["compare_bw_ratio"] = _ratio(ac, row["compare"], "busbw_gbps")
            row["compare_lat_ratio"] = _ratio(ac, row["compare"], "p50_us")
        if floored and case.collective in FLOORED and case.concurrency == 1:
            row.update(_floor(floors, (case.collective, case.size), ac, p50s))
        rows.append(row)
    return rows


FloorKey = tuple[str, int]


def mpi_legs(rounds: list[dict[str, Any]]) -> tuple[str, ...]:
    """The Open MPI legs (keys of :data:`aiocollect.bench.mpi.LEGS`) that some round ran."""
    return tuple(leg for leg in mpi.LEGS if any(leg in entry for entry in rounds))


def _row_mpis(row: dict[str, Any]) -> list[str]:
    """The Open MPI legs of a row from :func:`aggregate` (measured or not)."""
    return [leg for leg in mpi.LEGS if leg in row]


def _floor_records(rounds: list[dict[str, Any]]) -> list[dict[FloorKey, dict[str, Any]] | None]:
    """Per round: its floor records by (collective, size) (``--floor``; records without a
    collective, from versions that had the allreduce's floor only, are allreduce's), None
    where it ran no floor."""
    out: list[dict[FloorKey, dict[str, Any]] | None] = []
    for entry in rounds:
        floor = entry.get("floor")
        out.append(
            None
            if floor is None
            else {
                (str(r.get("collective", "allreduce")), int(r["size"])): r
                for r in floor.get("records", [])
            }
        )
    return out


def _floor(
    floors: list[dict[FloorKey, dict[str, Any]] | None],
    size: FloorKey,
    ac: dict[str, Any] | None,
    p50s: list[float | None],
) -> dict[str, Any]:
    """A row's floor entries (``size``: its collective and size), from the rounds' floor
    records (``floors``) and aiocollect's
    p50 in each round (``p50s``, aligned with them): ``floor_us`` (median over the rounds
    that measured it, NaN where none did), ``floor_method``, ``floor_bytes``,
    ``floor_each_us`` (the floor runs' median of each iteration's slowest rank, the
    statistic of aiocollect's p50; the table's ratio stays against ``floor_us``),
    ``floor_rounds``, ``floor_ratio`` (aiocollect's median p50 / ``floor_us``: the ratio of
    the medians), ``floor_each_ratio`` (the same over ``floor_each_us``: one statistic on
    both sides), ``floor_rank_ratio`` (aiocollect's slowest rank's median, ``rank_p50_us``,
    over ``floor_us``: the floor's own statistic on both sides), ``floor_ratio_rounds``
    (each round's own p50 / floor, for rounds with both) and, where no round measured it,
    ``floor_error`` (why)."""
    mine = [f[size] if f is not None and size in f else None for f in floors]
    got = [r for r in mine if r is not None and "us" in r]
    each = [float(r["us_each"]) for r in got if "us_each" in r]  # (absent from old records)
    out: dict[str, Any] = {
        "floor_us": median([float(r["us"]) for r in got]) if got else float("nan"),
        # the same runs' median of each iteration's slowest rank (aiocollect's p50 statistic)
        "floor_each_us": median(each) if each else float("nan"),
        "floor_method": got[0]["method"] if got else None,
        "floor_bytes": got[0]["bytes"] if got else None,
        "floor_rounds": len(got),
        "floor_ratio_rounds": [
            p50 / float(r["us"])
            for r, p50 in zip(mine, p50s, strict=True)
            if r is not None and "us" in r and p50 is not None and r["us"] > 0
        ],
    }
    mine_p50 = ac.get("p50_us") if ac is not None else None
    out["floor_ratio"] = _over(mine_p50, out["floor_us"])
    # the same statistic on both sides (each iteration's slowest rank), for the reader
    out["floor_each_ratio"] = _over(mine_p50, out["floor_each_us"])
    # the floor's statistic on both sides (each side's slowest rank's median)
    out["floor_rank_ratio"] = _over(
        ac.get("rank_p50_us") if ac is not None else None, out["floor_us"]
    )
    if not got:
        errors = [r["error"] for r in mine if r is not None and "error" in r]
        out["floor_error"] = errors[0] if errors else "the floor did not run"
    return out


def _over(num: float | None, den: float) -> float:
    """``num / den``, NaN where either is missing (None, NaN) or ``den`` is not positive."""
    return num / den if num is not None and den > 0 else float("nan")


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float:
    if a is None or b is None or not b[key] or b[key] != b[key]:
        return float("nan")
    return float(a[key] / b[key])


def all_correct(rows: list[dict[str, Any]]) -> bool:
    """False if any backend got a wrong result for any case (or measured nothing)."""
    return all(
        row["aiocollect"] is not None
        and row["aiocollect"]["correct"]
        and (row["gloo"] is None or row["gloo"]["correct"])
        and (row.get("compare") is None or row["compare"]["correct"])
        and all(row[leg] is None or row[leg]["correct"] for leg in _row_mpis(row))
        for row in rows
    )


# -- the table ----------------------------------------------------------------------------


def _render(headers: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return out


def _check(row: dict[str, Any]) -> str:
    ac, cmp, gl = row["aiocollect"], row.get("compare"), row["gloo"]
    if ac is None:
        return "MISSING"
    if not ac["correct"]:
        return f"WRONG (ranks {ac['wrong_ranks']})"
    if not checked(row["collective"]):
        return "-"  # a barrier: no result to check
    wrong = ([row["compare_transport"]] if cmp is not None and not cmp["correct"] else []) + (
        ["gloo"] if gl is not None and not gl["correct"] else []
    )
    wrong += [mpi.LEGS[leg][0] for leg in _row_mpis(row) if row[leg] and not row[leg]["correct"]]
    if wrong:
        return f"ok ({', '.join(wrong)} WRONG)"
    return "ok"


def _x(value: float) -> str:
    return format_number(value, 2, "x")


def _line(
    row: dict[str, Any], baseline: bool, compare: str | None, floor: bool = False
) -> list[str]:
    ac, gl = row["aiocollect"], row["gloo"]
    line = [format_size(row["size"]), row.get("aiocollect_algorithm", "auto"), str(ac["iters"])]
    if row["concurrency"] > 1:
        line += [
            format_time(ac["p50_us"]),
            format_time(ac["seq_p50_us"]),
            _x(ac["concurrent_ratio"]),
        ]
    else:
        line += [format_time(ac["p50_us"]), format_time(ac["p99_us"]), format_time(ac["mean_us"])]
    line += [
        format_number(ac["busbw_gbps"], 3),
        format_number(ac["lag_p99_ms"], 2),
        format_number(ac["rss_growth_mib"], 1),
    ]
    if floor:
        nan = float("nan")
        rounds = row.get("floor_ratio_rounds") or []
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if len(rounds) > 1 else "-"
        line += [
            format_time(row.get("floor_us", nan)),
            _x(row.get("floor_ratio", nan)),
            spread,
        ]
    if compare is not None:
        cmp = row["compare"]
        line += [
            format_time(cmp["p50_us"]) if cmp else "-",
            format_number(cmp["busbw_gbps"], 3) if cmp else "-",
            _x(row["compare_bw_ratio"]),
        ]
    if baseline:
        if row["concurrency"] > 1:
            line += [_x(gl["concurrent_ratio"]) if gl else "-"]
        else:
            line += [
                format_time(gl["p50_us"]) if gl else "-",
                format_number(gl["busbw_gbps"], 3) if gl else "-",
                _x(row["bw_ratio"]),
                _x(row["lat_ratio"]),
            ]
    for leg in _row_mpis(row):
        got = row[leg]
        if row["concurrency"] > 1:
            line += [_x(got["concurrent_ratio"]) if got else "-"]
        else:
            line += [
                format_time(got["p50_us"]) if got else "-",
                format_number(got["busbw_gbps"], 3) if got else "-",
                _x(row[f"{leg}_lat_ratio"]),
            ]
    return [*line, _check(row)]


def _headers(
    concurrency: int,
    baseline: bool,
    transport: str = "",
    compare: str | None = None,
    floor: bool = False,
    mpis: tuple[str, ...] = (),
) -> list[str]:
    if concurrency > 1:
        head = [
            "size",
            "algorithm",
            "iters",
            f"{concurrency} conc p50",
            f"{concurrency} seq p50",
            "conc/seq",
        ]
    else:
        head = ["size", "algorithm", "iters", "p50", "p99", "mean"]
    head += ["busbw GB/s", "lag p99 ms", "rss+ MiB"]
    if floor:
        head += ["floor", "x floor", "rounds"]
    if compare is not None:
        head += [
            f"{compare} conc p50" if concurrency > 1 else f"{compare} p50",
            f"{compare} GB/s",
            f"{transport}/{compare} bw",
        ]
    if baseline:
        head += (
            ["gloo conc/seq"]
            if concurrency > 1
            else ["gloo p50", "gloo GB/s", "bw ratio", "lat ratio"]
        )
    for leg in mpis:
        label = mpi.LEGS[leg][0]
        head += (
            [f"{label} conc/seq"]
            if concurrency > 1
            else [f"{label} p50", f"{label} GB/s", f"x {label}"]
        )
    return [*head, "check"]


def over(transport: str, compare: str | None) -> str:
    """``transport``, or ``"transport vs compare"`` with ``--compare``."""
    return transport if compare is None else f"{transport} vs {compare}"


def _started(method: object) -> str:
    """The header's note of how the aiocollect ranks were started (nothing if unknown)."""
    return {"fork": ", ranks forked", "exec": ", ranks exec'd"}.get(str(method), "")


def format_tables(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The human-readable report: one table per collective (and concurrency).

    Rows from :func:`aggregate` with ``compare`` get three more columns (the compared
    transport's p50 and busbw, and the busbw ratio), whether or not its rounds succeeded.
    """
    baseline = any(row["gloo"] is not None for row in rows)
    compare: str | None = next(
        (row["compare_transport"] for row in rows if "compare_transport" in row), None
    )
    transport = meta["transport"]
    out: list[str] = []
    names = list(dict.fromkeys(row["name"] for row in rows))
    for name in names:
        group = [r for r in rows if r["name"] == name and r["aiocollect"] is not None]
        if not group:
            continue
        out.append(
            f"{name}: {meta['world_size']} ranks, {over(transport, compare)}, "
            f"{meta['dtype']}{_started(meta.get('start_method'))}, "
            f"median of {meta['rounds']} rounds"
        )
        with_floor = any("floor_us" in r for r in group)
        mpis = tuple(_row_mpis(group[0]))
        out += _render(
            _headers(group[0]["concurrency"], baseline, transport, compare, with_floor, mpis),
            [_line(r, baseline, compare, with_floor) for r in group],
        )
        out.append("")
    out += [
        "p50/p99: per iteration, the slowest rank; mean: the slowest rank's batch time / "
        "iterations (NCCL-tests' time); busbw: NCCL-tests bus bandwidth at mean (1e9 B/s).",
        f"lag p99: rank 0's event loop, 1 ms sleeps (idle floor "
        f"{format_number(meta.get('idle_lag_p99_ms', float('nan')), 2)} ms); rss+: peak RSS "
        "growth in the timed iterations, max over ranks and rounds.",
    ]
    chunk = meta.get("chunk_bytes")
    if isinstance(chunk, int) and chunk > 0:
        how = "--chunk-bytes" if meta.get("chunk_given") else "chosen by the group at rendezvous"
        out.append(f"chunk: {format_size(chunk)} per frame ({how}).")
    if compare is not None:
        out.append(
            f"{compare} p50, {compare} GB/s: aiocollect over {compare} (--compare); "
            f"{transport}/{compare} bw: busbw over {transport} / busbw over {compare}, "
            f"medians over rounds (>1 favours {transport})."
        )
    floored = [r for r in rows if "floor_us" in r]
    if floored:
        out.append(
            "floor: the framework-free operation of the same bytes on this machine, run "
            "after the others in every round (python -m aiocollect.bench.floor; allreduce: "
            f"recursive doubling over socket pairs below {format_size(BULK_MIN)}, "
            "pull-and-add from there; sendrecv: socket pairs below "
            f"{format_size(BULK_MIN)}, one process_vm_readv from there; barrier: "
            "dissemination over socket pairs); x floor: aiocollect p50 / floor, medians "
            "over rounds (1/0.85 = 1.18x is 85 % of the floor's bandwidth); rounds: the "
            "lowest and highest of each round's own ratio."
        )
        nan = float("nan")
        same = [
            f"{r['name']} {format_size(r['size'])} {_x(r.get('floor_each_ratio', nan))} / "
            f"{_x(r.get('floor_rank_ratio', nan))}"
            for r in floored
            if r["aiocollect"] is not None
        ]
        if same:
            out.append(
                "x floor with one statistic on both sides (each iteration's slowest rank / "
                "the slowest rank's median; the floor column is the latter, p50 the "
                "former): " + ", ".join(same) + "."
            )
        missing = {r["floor_error"] for r in floored if "floor_error" in r}
        for why in sorted(missing):
            out.append(f"floor not measured ('-'): {why}.")
    if baseline:
        out.append(
            "bw ratio: aiocollect/gloo busbw (>1 favours aiocollect); lat ratio: "
            "aiocollect/gloo p50 (<1 favours aiocollect); conc/seq: K in flight / K "
            "in sequence."
        )
    if any(_row_mpis(row) for row in rows):
        out.append(
            "mpi shm, mpi tcp: Open MPI (mpi4py under mpirun, --bind-to none, pml ob1) with "
            "--mca btl self,vader and --mca btl self,tcp (loopback), the same timing method; "
            "x mpi: aiocollect p50 / Open MPI p50, medians over rounds (<1 favours aiocollect)."
        )
    synced = [r for r in rows if r["aiocollect"] and "sync_p50_us" in r["aiocollect"]]
    if synced:
        which = ", ".join(dict.fromkeys(r["name"] for r in synced))
        floor = median([r["aiocollect"]["sync_p50_us"] for r in synced])
        out.append(
            f"{which}: every iteration ends with a barrier, so the root waits for "
            f"the receivers (aiocollect's barrier alone: p50 {format_time(floor)})."
        )
    if meta.get("baseline_note"):
        out.append(meta["baseline_note"])
    if meta.get("load_warning"):
        out.append(f"WARNING: {meta['load_warning']}")
    return "\n".join(out)
