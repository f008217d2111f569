"""``aiocollect run``: a torchrun-style launcher for the ranks of one node.

Usage::

    aiocollect run -n N [--nnodes K --node-rank I --master-addr A --master-port P]
                   [--transport T] [--group-timeout S] [--timeout S] [--grace S]
                   [--secret S | --insecure] [--start-method fork|exec]
                   script.py ARGS...
    aiocollect run -n N ... -m package.module ARGS...

Each rank runs ``script.py ARGS`` (or the module) as ``python`` would: forked from the
launcher after it imported aiocollect, numpy and uvloop (``--start-method fork``, the
default on Linux; aiocollect.cli.forked), or as ``sys.executable script.py ARGS``
(``exec``), with, in its environment:

- ``AIOCOLLECT_RANK``, ``AIOCOLLECT_WORLD_SIZE``, ``AIOCOLLECT_LOCAL_RANK``,
  ``AIOCOLLECT_LOCAL_WORLD_SIZE``, ``AIOCOLLECT_STORE=tcp://A:P`` (and
  ``AIOCOLLECT_TRANSPORT`` with ``--transport``), so ``await aiocollect.open_group()``
  needs no arguments; rank 0 hosts the TCP store on A:P;
- torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK`` (the node rank), ``MASTER_ADDR=A`` and ``MASTER_PORT=P``;
- ``AIOCOLLECT_SECRET`` (from ``--secret``, else inherited) or ``AIOCOLLECT_INSECURE=1``
  (``--insecure``);
- ``AIOCOLLECT_TIMEOUT`` with ``--group-timeout`` (the deadline of rendezvous and of each
  collective, open_group's ``timeout``; ``--timeout`` is the whole job's wall-clock limit);
- ``PYTHONUNBUFFERED=1``;
- ``AIOCOLLECT_JOB_ID``, fresh per launch with ``--nnodes 1`` (inherited otherwise: give
  every node of a job the same one), so ranks never join another job on the same port.

Protected by default: without a secret the ranks accept store and peer connections from
their own host only, so a job whose store is on another host (``--nnodes`` > 1 with a
``--master-addr`` that is not loopback) needs ``--secret`` or ``AIOCOLLECT_SECRET`` (the
same on every node), or an explicit ``--insecure``; :func:`run_main` refuses to start it
otherwise, saying so, instead of letting the ranks fail one by one.

Global rank = node_rank * nproc_per_node + local_rank; world size = nnodes * nproc_per_node.
Every output line of a rank is prefixed with ``[rank R] `` (stdout to stdout, stderr to
stderr). Local rank 0 inherits the launcher's stdin; the other ranks read from /dev/null.
See :mod:`aiocollect.cli.supervise` for what happens when a rank fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiocollect
from aiocollect._net import free_port
from aiocollect._protect import INSECURE_ENV, insecure_from_env
from aiocollect.cli.forked import (
    BLAS_THREADS,
    START_METHOD_ENV,
    START_METHODS,
    ForkedRank,
    default_start_method,
    flush_stdio,
    fork_rank,
    kill_and_reap,
    preload,
)
from aiocollect.cli.supervise import FORWARDED_SIGNALS, Job, supervise
from aiocollect.transport import registry

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MULTINODE_PORT = 29500
DEFAULT_GRACE = 5.0
#: What ``--transport`` offers: the registered transports that link processes.
TRANSPORT_CHOICES = tuple(t.name for t in registry.transports() if not t.in_process)
PROG = "aiocollect run"
#: Set in the launcher's environment when it re-executed itself to import numpy with the
#: ranks' BLAS thread settings (run_main), so that it does so at most once.
_REEXEC_ENV = "_AIOCOLLECT_RUN_REEXEC"


@dataclass(frozen=True)
class LaunchConfig:
    """What ``aiocollect run`` starts, after validation (see the module docstring)."""

    nproc: int
    script: str
    args: list[str] = field(default_factory=list)
    module: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    transport: str | None = None
    timeout: float | None = None
    group_timeout: float | None = None
    grace: float = DEFAULT_GRACE
    secret: str | None = None
    insecure: bool = False
    start_method: str = "exec"
    #: Given to the ranks as AIOCOLLECT_JOB_ID when this launcher is the whole job, so
    #: they never join another job's ranks on the same store (aiocollect.rendezvous.claims).
    job_id: str = field(default_factory=lambda: os.urandom(8).hex())

    @property
    def world_size(self) -> int:
        """nnodes * nproc."""
        return self.nnodes * self.nproc

    def global_rank(self, local_rank: int) -> int:
        """The rank of this node's ``local_rank`` in the whole job."""
        return self.node_rank * self.nproc + local_rank

    def store_url(self) -> str:
        """``tcp://ADDR:PORT`` (IPv6 addresses in brackets)."""
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{self.master_port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [-n N] [options] (script.py | -m module) [args ...]",
        description="Start N local ranks of an aiocollect job, prefix their output with the "
        "rank, and stop them all with a report when one fails.",
    )
    add = parser.add_argument
    add(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        default=1,
        metavar="N",
        help="ranks to start on this node (default: 1)",
    )
    add("--nnodes", type=int, default=1, metavar="K", help="number of nodes (default: 1)")
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=0,
        metavar="I",
        help="rank of this node, 0..K-1 (default: 0)",
    )
    add(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=None,
        metavar="A",
        help=f"address of node 0, where rank 0 hosts the store (default: {DEFAULT_MASTER_ADDR};"
        " required with --nnodes > 1)",
    )
    add(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        default=None,
        metavar="P",
        help="store port (default: a free port on one node, "
        f"{DEFAULT_MULTINODE_PORT} with several nodes)",
    )
    add(
        "--transport",
        choices=TRANSPORT_CHOICES,
        default=None,
        help="sets AIOCOLLECT_TRANSPORT for the ranks",
    )
    add(
        "--group-timeout",
        type=float,
        default=None,
        metavar="S",
        help="deadline in seconds of rendezvous and of each collective (sets "
        "AIOCOLLECT_TIMEOUT for the ranks; default: 300)",
    )
    add(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="wall-clock limit of the whole job: stop every rank after S seconds (exit "
        "status 124); not the deadline of a collective (--group-timeout)",
    )
    add(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks "
        f"(default: {DEFAULT_GRACE:g})",
    )
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--secret",
        default=None,
        metavar="S",
        help="shared secret, passed to the ranks as AIOCOLLECT_SECRET (default: "
        "$AIOCOLLECT_SECRET; needed across nodes; prefer the variable: arguments show "
        "in `ps`)",
    )
    auth.add_argument(
        "--insecure",
        action="store_true",
        help="no secret across nodes: the ranks accept connections from any "
        "host (sets AIOCOLLECT_INSECURE=1); only on a trusted network",
    )
    add(
        "--start-method",
        choices=START_METHODS,
        default=None,
        help="how ranks start: 'fork' them from the launcher with aiocollect, numpy and "
        "uvloop imported (faster where ranks share cores), or 'exec' a fresh python each "
        f"(default: ${START_METHOD_ENV}, else {default_start_method()})",
    )
    add(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (python -m), like torchrun",
    )
    add("script", metavar="script.py | module", help="the program every rank runs")
    add("args", nargs="*", metavar="args", help="arguments passed to every rank unchanged")
    return parser


def _split_target(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[list[str], list[str]]:
    """Split ``argv`` at the script name: launcher options before, the script's after.

    argparse alone would swallow a ``--`` or a ``-n`` meant for the script.
    """
    takes_value = {
        flag
        for action in parser._actions
        if action.option_strings and action.nargs != 0
        for flag in action.option_strings
    }
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not token.startswith("-") or token == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if token in takes_value else 1
    return list(argv), []


def parse_run_args(argv: Sequence[str]) -> LaunchConfig:
    """Parse and validate ``aiocollect run`` arguments.

    Raises:
        SystemExit: status 2 with a usage message on bad arguments (0 for ``--help``).
    """
    parser = _parser()
    options, target = _split_target(parser, argv)
    if not target:
        if "-h" in options or "--help" in options:
            parser.parse_args(["--help"])
        parser.error("missing the script to run (script.py or -m module)")
    ns = parser.parse_args([*options, "--", *target[:1]])
    ns.args = target[1:]
    if ns.nproc < 1:
        parser.error(f"-n/--nproc-per-node must be >= 1, got {ns.nproc}")
    if ns.nnodes < 1:
        parser.error(f"--nnodes must be >= 1, got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be in [0, {ns.nnodes}), got {ns.node_rank}")
    if ns.nnodes > 1 and not ns.master_addr:
        parser.error("--master-addr (the address of node 0) is required with --nnodes > 1")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        parser.error(f"--master-port must be in [1, 65535], got {ns.master_port}")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {ns.timeout:g}")
    if ns.group_timeout is not None and not 0 < ns.group_timeout < float("inf"):
        parser.error(f"--group-timeout must be > 0, got {ns.group_timeout:g}")
    if ns.grace < 0:
        parser.error(f"--grace must be >= 0, got {ns.grace:g}")
    if not ns.module and not os.path.isfile(ns.script):
        parser.error(f"script not found: {ns.script}")
    addr = ns.master_addr or DEFAULT_MASTER_ADDR
    port = ns.master_port
    if port is None:
        port = DEFAULT_MULTINODE_PORT if ns.nnodes > 1 else free_port(addr)
    return LaunchConfig(
        nproc=ns.nproc,
        script=ns.script,
        args=ns.args,
        module=ns.module,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=addr,
        master_port=port,
        transport=ns.transport,
        timeout=ns.timeout,
        group_timeout=ns.group_timeout,
        grace=ns.grace,
        secret=ns.secret or None,
        insecure=ns.insecure,
        start_method=ns.start_method or default_start_method(),
    )


def unprotected(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> str | None:
    """Why ``cfg`` would start ranks that other nodes cannot reach (protected mode: no
    secret, store on another host, not ``--insecure``), or None if it is fine."""
    env = os.environ if environ is None else environ
    if cfg.secret or env.get("AIOCOLLECT_SECRET") or cfg.insecure or insecure_from_env(env):
        return None
    if cfg.nnodes == 1 or _is_loopback(cfg.master_addr):
        return None
    return (
        f"a job across {cfg.nnodes} nodes needs a shared secret: without one the ranks "
        "accept connections from their own host only (protected mode). Run, on every "
        "node, `export AIOCOLLECT_SECRET=<the same random string>` (e.g. from "
        "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`), or pass "
        "--secret; on a network you trust, --insecure opts out."
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def rank_env(
    cfg: LaunchConfig, local_rank: int, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of local rank ``local_rank``: ``base`` (default: ours) plus the
    variables listed in the module docstring."""
    env = dict(os.environ if base is None else base)
    rank, world = str(cfg.global_rank(local_rank)), str(cfg.world_size)
    env.update(
        {
            "AIOCOLLECT_RANK": rank,
            "AIOCOLLECT_WORLD_SIZE": world,
            "AIOCOLLECT_LOCAL_RANK": str(local_rank),
            "AIOCOLLECT_LOCAL_WORLD_SIZE": str(cfg.nproc),
            "AIOCOLLECT_STORE": cfg.store_url(),
            "RANK": rank,
            "WORLD_SIZE": world,
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(cfg.nproc),
            "GROUP_RANK": str(cfg.node_rank),
            "MASTER_ADDR": cfg.master_addr,
            "MASTER_PORT": str(cfg.master_port),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cfg.nnodes == 1:  # across nodes, AIOCOLLECT_JOB_ID (if any) comes from the user
        env["AIOCOLLECT_JOB_ID"] = cfg.job_id
    if cfg.transport is not None:
        env["AIOCOLLECT_TRANSPORT"] = cfg.transport
    if cfg.group_timeout is not None:
        env["AIOCOLLECT_TIMEOUT"] = repr(cfg.group_timeout)
    if cfg.secret:
        env["AIOCOLLECT_SECRET"] = cfg.secret
    elif cfg.insecure:
        env[INSECURE_ENV] = "1"
    # Like torchrun: one BLAS thread per rank unless the user chose otherwise, since
    # several ranks per machine oversubscribe the cores otherwise.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env


def rank_command(cfg: LaunchConfig) -> list[str]:
    """The command line every rank runs."""
    target = ["-m", cfg.script] if cfg.module else [cfg.script]
    return [sys.executable, *target, *cfg.args]


def _report(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


async def launch(cfg: LaunchConfig, forked: Sequence[ForkedRank] = ()) -> int:
    """Start the ranks of this node and supervise them until all have exited.

    ``forked``: the ranks already forked by :func:`fork_ranks` (``--start-method fork``),
    in local rank order; without them the ranks are started here by ``exec``.
    Returns the launcher's exit status (see :meth:`aiocollect.cli.supervise.Job.run`);
    1 if a rank could not be started. SIGINT, SIGTERM and SIGHUP received meanwhile are
    forwarded to the ranks (those the launcher ignores stay ignored, by the ranks too).
    No rank outlives this coroutine, cancellation included (a SIGKILL of the launcher
    itself, which nothing can catch, excepted).
    """
    job = Job(grace=cfg.grace, timeout=cfg.timeout, report=_report)
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for signum in FORWARDED_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_IGN:
            continue  # e.g. SIGHUP under nohup: the ranks inherit the ignoring too
        try:
            loop.add_signal_handler(signum, job.on_signal, signum)
            handled.append(signum)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread: the caller keeps its own handling
    try:
        for local_rank, rank in enumerate(forked):
            await rank.attach()
            job.add(cfg.global_rank(local_rank), rank)
        if not forked and not await _exec_ranks(cfg, job):
            return 1
        return await supervise(job, report=_report)
    finally:
        job.kill_remaining()
        for signum in handled:
            loop.remove_signal_handler(signum)


async def _exec_ranks(cfg: LaunchConfig, job: Job) -> bool:
    """Start this node's ranks by exec (``--start-method exec``) into ``job``; False (the
    job stopped, every rank started reaped) if one could not be started."""
    command = rank_command(cfg)
    for local_rank in range(cfg.nproc):
        if job.stopping:
            break
        try:
            proc = await asyncio.create_subprocess_exec(
                *command,
                env=rank_env(cfg, local_rank),
                stdin=None if local_rank == 0 else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            _report(f"could not start rank {cfg.global_rank(local_rank)}: {exc}")
            job.stop(signal.SIGKILL)
            await job.run()
            return False
        job.add(cfg.global_rank(local_rank), proc)
    return True


def fork_ranks(cfg: LaunchConfig) -> list[ForkedRank]:
    """Fork this node's ranks (``--start-method fork``, see aiocollect.cli.forked), each
    running the target with :func:`rank_env`; call before the event loop starts.

    Raises:
        OSError: a fork failed (the ranks forked so far have been killed).
    """
    ranks: list[ForkedRank] = []
    try:
        for local_rank in range(cfg.nproc):
            ranks.append(
                fork_rank(
                    cfg.script,
                    cfg.module,
                    cfg.args,
                    rank_env(cfg, local_rank),
                    stdin_null=local_rank != 0,
                )
            )
    except OSError:
        kill_forked(ranks)
        raise
    return ranks


def kill_forked(ranks: Sequence[ForkedRank]) -> None:
    """SIGKILL (and reap) every forked rank not reaped yet: the launcher is failing."""
    kill_and_reap((rank.pid for rank in ranks if rank.returncode is None), group=True)


def _blas_ready(argv: Sequence[str]) -> str | None:
    """Make sure numpy in this process runs under the ranks' BLAS thread settings, so
    that the forked ranks' numpy is set up as an exec'd rank's would be: nothing to do
    when the variables are set (or numpy is not imported yet); else re-execute the
    launcher with them added (does not return) when this process is the ``aiocollect
    run`` command itself. Returns why the ranks cannot be forked otherwise (the launcher
    was called from another program, which it must not replace)."""
    missing = [var for var in BLAS_THREADS if var not in os.environ]
    if not missing or "numpy" not in sys.modules:
        return None
    if os.environ.get(_REEXEC_ENV) or list(sys.argv[1:]) != ["run", *argv]:
        return "numpy was imported without the ranks' BLAS thread settings " + (
            f"({', '.join(missing)} unset)"
        )
    env = dict(os.environ)
    for var in missing:
        env[var] = "1"
    env[_REEXEC_ENV] = "1"
    flush_stdio()
    os.execve(sys.executable, _reexec_command(argv), env)


def _reexec_command(argv: Sequence[str]) -> list[str]:
    """The command that runs ``aiocollect run ARGV`` again with the aiocollect package this
    process runs, whatever the working directory holds: ``python -m aiocollect`` would put
    the working directory first on ``sys.path``, and from inside another checkout the ranks
    would run that checkout's code (so would an A/B run that sets ``PYTHONPATH`` to the
    other tree). ``-P`` keeps the working directory off the path; the package's own parent
    directory goes first instead."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(aiocollect.__file__)))
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from aiocollect.cli.main import main; sys.exit(main())"
    )
    return [sys.executable, "-P", "-c", code, "run", *argv]


def run_main(argv: Sequence[str]) -> int:
    """``aiocollect run ARGS``: parse, launch, return the exit status (2, with the reason,
    for a job across nodes that has no secret and is not ``--insecure``).

    Raises:
        SystemExit: status 2 on bad arguments.
    """
    raw_method = os.environ.get(START_METHOD_ENV, "").strip()
    cfg = parse_run_args(argv)
    reason = unprotected(cfg)
    if reason is not None:
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        return 2
    if raw_method and raw_method not in START_METHODS and not os.environ.get(_REEXEC_ENV):
        _report(  # (once: not again after re-executing itself)
            f"ignoring {START_METHOD_ENV}={raw_method!r}: not one of {', '.join(START_METHODS)}"
        )
    if cfg.start_method != "fork":
        return asyncio.run(launch(cfg))
    why = _blas_ready(argv)
    os.environ.pop(_REEXEC_ENV, None)
    why = why or preload()
    if why is not None:
        _report(f"starting the ranks by exec instead of fork: {why}")
        return asyncio.run(launch(cfg))
    try:
        forked = fork_ranks(cfg)
    except OSError as exc:
        _report(f"could not fork the ranks: {exc}")
        return 1
    try:
        return asyncio.run(launch(cfg, forked))
    finally:
        kill_forked(forked)
