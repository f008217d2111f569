"""``aiocollect``: the command-line entry point (also ``python -m aiocollect``).

Subcommands:

- ``run`` — start the ranks of a job on this node (:mod:`aiocollect.cli.launch`);
- ``store`` — a standalone TCP store server (:func:`aiocollect.store.tcp.store_main`); with
  no secret and no ``--insecure`` it generates a secret and prints the line to export;
- ``info`` — version, event loop, transports, devices (:mod:`aiocollect.cli.info`);
- ``bench`` — collective benchmarks (:mod:`aiocollect.cli.bench`, when present).

Each subcommand parses its own arguments, and is imported only when chosen, so that a broken
or missing optional piece never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from aiocollect import __version__

SubMain = Callable[[list[str]], int]

_COMMANDS = {
    "run": "start N local ranks of a job, prefix their output, stop all when one fails",
    "store": "run a standalone TCP store server for multi-node jobs (prints a secret)",
    "info": "show version, event loop, transports, extras and RDMA devices",
    "bench": "measure collective latency and bandwidth",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiocollect",
        description="asyncio-native collective communications.",
        epilog="Run 'aiocollect COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"aiocollect {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in _COMMANDS.items():
        # Listed for --help only: main() dispatches to a command before parsing.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _unavailable(name: str) -> SubMain:
    def not_available(argv: list[str]) -> int:
        del argv
        print(f"aiocollect: {name} is not available yet", file=sys.stderr)
        return 2

    return not_available


def _run_main(argv: list[str]) -> int:
    from aiocollect.cli.launch import run_main

    return run_main(argv)


def _info_main(argv: list[str]) -> int:
    from aiocollect.cli.info import info_main

    return info_main(argv)


def _store_main(argv: list[str]) -> int:
    try:
        from aiocollect.store.tcp import store_main
    except ImportError:
        return _unavailable("store")(argv)
    return store_main(argv)


def _bench_main(argv: list[str]) -> int:
    if importlib.util.find_spec("aiocollect.cli.bench") is None:
        return _unavailable("bench")(argv)
    bench = importlib.import_module("aiocollect.cli.bench")
    bench_main: SubMain | None = getattr(bench, "bench_main", None)
    if bench_main is None:
        return _unavailable("bench")(argv)
    return bench_main(argv)


_DISPATCH: dict[str, SubMain] = {
    "run": _run_main,
    "store": _store_main,
    "info": _info_main,
    "bench": _bench_main,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aiocollect`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns the exit status: 0 on success, 2 for bad arguments or an unavailable command,
    otherwise the command's own status. ``SystemExit`` raised by argument parsing is turned
    into its status instead of propagating.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in _DISPATCH:
            return _DISPATCH[args[0]](args[1:])
        _parser().parse_args(args)  # prints help, version or a usage error
        return 2  # not reached: every remaining case exits in parse_args
    except SystemExit as exc:
        return _status(exc.code)


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
