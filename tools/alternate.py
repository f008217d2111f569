"""Alternate commands round by round and compare their per-rank figures, paired.

    python tools/alternate.py 20 \\
        "AIOCOLLECT_UNIX_SOCKET=0 aiocollect run -n 4 tools/op_cpu.py --iters 3000" \\
        "aiocollect run -n 4 tools/op_cpu.py --iters 3000"
    python tools/alternate.py 10 "PYTHONPATH=/tree/a aiocollect run -n 2 tools/op_cpu.py" \\
        "PYTHONPATH=/tree/b aiocollect run -n 2 tools/op_cpu.py"

Each command (run by ``bash -c``, bounded by ``--timeout`` seconds) must print one line per
rank with ``p50 <µs>`` and ``user <µs> us, sys <µs>`` (``tools/op_cpu.py`` does). Round r
runs the commands in order, round r+1 in reverse order, so that a slow phase of a shared
machine hits each as often. Per command it prints: the median over rounds of the mean of
the ranks' p50; that median paired against the first command (the median of the
per-round ratios); the median of the rounds whose p50 was under ``--fast`` µs and how many
there were (with more ranks than cores the ranks' processes fall into one of a few
layouts on the cores whose figures differ up to 2x: four ranks on two cores, for
example); the median CPU per operation summed over the ranks (user + system); and every
round's p50 and CPU.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

_P50 = re.compile(r"p50 ([0-9.]+)")
_CPU = re.compile(r"user ([0-9.]+) us, sys ([0-9.]+)")


def measure(command: str, timeout: float) -> tuple[float | None, float | None]:
    """One run: the mean of its ranks' p50 and the sum of their CPU per operation (None
    where the output had none: the run failed, and its output is printed)."""
    try:
        out = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=timeout
        )
        text = out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"timed out after {timeout} s: {exc}"
    p50 = [float(x) for x in _P50.findall(text)]
    cpu = [float(u) + float(s) for u, s in _CPU.findall(text)]
    if not p50:
        print(f"FAILED: {command}\n{text[-600:]}", file=sys.stderr, flush=True)
    return (statistics.mean(p50) if p50 else None, sum(cpu) if cpu else None)


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.1f}" if xs else "      -"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python tools/alternate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("rounds", type=int)
    ap.add_argument("commands", nargs="+")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--fast", type=float, default=150.0, help="a fast round's p50 bound, µs")
    args = ap.parse_args(argv)
    cmds: list[str] = args.commands
    p50s: dict[str, list[float | None]] = {c: [] for c in cmds}
    cpus: dict[str, list[float | None]] = {c: [] for c in cmds}
    for r in range(args.rounds):
        for c in cmds if r % 2 == 0 else cmds[::-1]:
            p50, cpu = measure(c, args.timeout)
            p50s[c].append(p50)
            cpus[c].append(cpu)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    first = p50s[cmds[0]]
    for i, c in enumerate(cmds):
        got = [x for x in p50s[c] if x is not None]
        cpu = [x for x in cpus[c] if x is not None]
        paired = [x / b for x, b in zip(p50s[c], first, strict=True) if x and b]
        fast = [x for x in got if x < args.fast]
        print(f"[{i}] {c}")
        print(
            f"    p50 {_median(got)} µs, paired/[0] "
            f"{statistics.median(paired) if paired else float('nan'):.3f}, "
            f"fast rounds {len(fast)}/{len(got)} at {_median(fast)} µs, "
            f"CPU/op (all ranks) {_median(cpu)} µs"
        )
        print("    p50 " + " ".join(f"{x:.0f}" if x else "-" for x in p50s[c]))
        print("    CPU " + " ".join(f"{x:.0f}" if x else "-" for x in cpus[c]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
