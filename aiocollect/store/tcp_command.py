"""``aiocollect store``: the standalone TCP store server's command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable
from typing import Any

from aiocollect import _auth, _fdlimit, _protect
from aiocollect.store.tcp_server import (
    BACKLOG_DEFAULT,
    DEFAULT_PORT,
    MAX_BYTES,
    MAX_KEYS,
    TCPStoreServer,
    listen_backlog,
)


async def serve_store(
    host: str | None,
    port: int,
    secret: bytes | str | None = None,
    *,
    insecure: bool = False,
    ready: Callable[[TCPStoreServer], object] | None = None,
    **limits: Any,
) -> None:
    """Run a TCP store server until cancelled.

    Args:
        host: address to bind (``None``: every interface).
        port: port to bind (0: a free one).
        secret: shared secret clients must prove, or None.
        insecure: without a secret, accept other hosts too (see :class:`TCPStoreServer`).
        ready: called with the started server (e.g. to print its address).
        limits: more :class:`TCPStoreServer` arguments (``max_bytes=``, ...).

    Raises:
        OSError: the address could not be bound.
    """
    server = TCPStoreServer(host, port, secret=secret, insecure=insecure, **limits)
    await server.start()
    try:
        if ready is not None:
            ready(server)
        await server.serve_forever()
    finally:
        await server.close()


def _store_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiocollect store",
        description="Standalone TCP store server for multi-node aiocollect jobs. With no "
        "secret (--secret or $AIOCOLLECT_SECRET) and no --insecure, it "
        "generates a secret and prints the line to export on every node.",
    )
    parser.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: pick a free one)")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--secret",
        default=None,
        help="shared secret clients must prove (default: $AIOCOLLECT_SECRET, else a "
        "generated one; prefer the variable: arguments show in `ps`)",
    )
    auth.add_argument(
        "--insecure",
        action="store_true",
        help="no secret: accept any client from any host (also $AIOCOLLECT_INSECURE=1); "
        "only on a network you trust",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=MAX_BYTES,
        metavar="N",
        help=f"quota of stored keys and values in bytes (default {MAX_BYTES})",
    )
    parser.add_argument(
        "--max-keys",
        type=int,
        default=MAX_KEYS,
        metavar="N",
        help=f"quota of stored keys (default {MAX_KEYS})",
    )
    return parser


def store_main(argv: list[str]) -> int:
    """``aiocollect store``: run a standalone TCP store until SIGINT/SIGTERM.

    The process's soft limit on open files is raised to its hard limit first (one
    descriptor per client: :mod:`aiocollect._fdlimit`).

    Prints ``aiocollect store listening on HOST:PORT`` once ready. The secret comes from
    ``--secret``, else ``AIOCOLLECT_SECRET``; with neither, and neither ``--insecure`` nor
    ``AIOCOLLECT_INSECURE=1``, one is generated and the next line printed is
    ``export AIOCOLLECT_SECRET=...``, to run on every node before starting the ranks.

    Args:
        argv: the command line after ``aiocollect store`` (``--help`` lists the options).

    Returns:
        The process exit status.
    """
    args = _store_parser().parse_args(argv)
    secret = args.secret if args.secret is not None else os.environ.get("AIOCOLLECT_SECRET")
    insecure = not secret and (args.insecure or _protect.insecure_from_env())
    generated = None
    if not secret and not insecure:
        generated = secret = secrets.token_urlsafe(32)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _fdlimit.raise_soft_limit()
    if listen_backlog() < BACKLOG_DEFAULT:
        logging.getLogger("aiocollect.store.tcp").warning(
            "listen backlog %d (net.core.somaxconn): a burst of more connects than that is "
            "slowed by retries; raise it with `sysctl -w net.core.somaxconn=%d`",
            listen_backlog(),
            BACKLOG_DEFAULT,
        )

    def ready(srv: TCPStoreServer) -> None:
        mode = "secret required" if secret else "INSECURE: no secret, any host may connect"
        print(f"aiocollect store listening on {srv.address} ({mode})", flush=True)
        if generated is not None:
            print(f"export AIOCOLLECT_SECRET={generated}", flush=True)
            print(
                "aiocollect store: generated the secret above (no --secret, no "
                "$AIOCOLLECT_SECRET); run that line on every node before starting the "
                "ranks, e.g. `aiocollect run` or torchrun, which pass it on",
                flush=True,
            )

    limits = {"max_bytes": args.max_bytes, "max_keys": args.max_keys}
    try:
        asyncio.run(
            _run_until_signal(
                args.host, args.port, _auth.as_secret(secret), insecure, ready, limits
            )
        )
    except OSError as exc:
        print(f"aiocollect store: cannot listen on port {args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _run_until_signal(
    host: str | None,
    port: int,
    secret: bytes | None,
    insecure: bool,
    ready: Callable[[TCPStoreServer], object],
    limits: dict[str, Any],
) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(
        serve_store(host, port, secret, insecure=insecure, ready=ready, **limits)
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["serve_store", "store_main"]
