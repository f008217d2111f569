"""``spawn_ranks``: one real process per rank, joined over TCP through a TCP store.

Children are started with the ``spawn`` method (no fork of a running event loop), or with
``start_method="forkserver"`` forked from a server process that imported aiocollect, numpy
and uvloop first (as ``aiocollect run`` forks its ranks, docs/design.md, *Ranks forked
from the launcher*); either way the target must be importable (a module-level function)
and each rank starts with the caller's environment and working directory as they are at
the call. ``AIOCOLLECT_SPAWN_START_METHOD`` picks the method where a call names none (this
project's test suite sets ``forkserver``: a spawned interpreter imports numpy and
aiocollect again, about 0.5 s of CPU per rank). Each child opens the group, runs
``target(group, *args)``, closes the group and sends back its result or its formatted
traceback through a pipe.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Generator, Iterable
from multiprocessing.connection import Connection
from typing import Any

from aiocollect._net import free_port as free_port  # re-exported: callers import it here
from aiocollect.cli.forked import PRELOAD
from aiocollect.errors import AiocollectError, UsageError

#: The environment variable that gives ``spawn_ranks`` its start method where the call
#: names none (``spawn`` or ``forkserver``).
START_METHOD_ENV = "AIOCOLLECT_SPAWN_START_METHOD"


class RankFailed(AiocollectError):
    """A rank of ``run_ranks``/``spawn_ranks`` failed; ``rank`` says which, ``traceback``
    holds the child's formatted traceback (spawned ranks), ``exc_type`` its class name.

    Args:
        rank: the rank that failed.
        message: what it raised, in one line.
        tb: the child's formatted traceback (spawned ranks; appended to the message).
        exc_type: the class name of what the child raised (spawned ranks).
    """

    def __init__(self, rank: int, message: str, tb: str = "", exc_type: str = "") -> None:
        super().__init__(message + (f"\n{tb}" if tb else ""))
        self.rank = rank
        self.traceback = tb
        self.exc_type = exc_type


def _child(
    rank: int,
    world_size: int,
    store: str,
    conn: Connection,
    target: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    options: dict[str, Any],
    context: tuple[dict[str, str], str],
) -> None:
    environ, cwd = context
    if os.environ != environ:  # a forkserver child: the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)

    async def main() -> Any:
        from aiocollect.api import open_group

        if "group_timeout" in options:
            options["timeout"] = options.pop("group_timeout")
        group = await open_group(rank, world_size, store=store, **options)
        try:
            result = await target(group, *args)
        except BaseException as exc:
            failed[0] = time.time()  # before the abort makes the others fail
            group.abort(exc)
            raise
        await group.aclose()
        return result

    failed = [0.0]
    try:
        if options.pop("uvloop", False):
            import uvloop

            result = uvloop.run(main())
        else:
            result = asyncio.run(main())
        conn.send(("ok", result))
    except BaseException as exc:
        conn.send(
            (
                "error",
                type(exc).__name__,
                str(exc),
                traceback.format_exc(),
                failed[0] or time.time(),
            )
        )
    finally:
        conn.close()


class SpawnedRanks:
    """Running rank processes. ``await`` it for the results in rank order.

    Made by :func:`spawn_ranks`, whose arguments these are.

    Args:
        world_size: how many ranks (processes).
        target: the module-level coroutine function each rank runs as
            ``target(group, *args)``.
        args: the positional arguments after the group.
        timeout: seconds the whole run may take.
        options: keyword arguments for ``open_group`` (see :func:`spawn_ranks`).
        start_method: ``"spawn"`` or ``"forkserver"``.

    Raises:
        UsageError: another ``start_method`` (before any process starts).
    """

    def __init__(
        self,
        world_size: int,
        target: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        timeout: float,
        options: dict[str, Any],
        start_method: str = "spawn",
    ) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise UsageError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
        ctx: Any
        if start_method == "forkserver":
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
        else:
            ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout = timeout
        self.store = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[Any] = []
        self._conns: list[Connection] = []
        self._failed_at: dict[int, float] = {}  # when a rank failed (time.time)
        # Each rank runs with the caller's environment and working directory as they are
        # now, whichever the start method (a forkserver's children would otherwise have the
        # server's, from when it started).
        context = (dict(os.environ), os.getcwd())
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                name=f"aiocollect-rank-{rank}",
                daemon=True,
                args=(rank, world_size, self.store, child, target, args, dict(options), context),
            )
            proc.start()
            child.close()
            self.processes.append(proc)
            self._conns.append(parent)

    def pid(self, rank: int) -> int:
        """The process id of a rank.

        Args:
            rank: the rank.
        """
        return int(self.processes[rank].pid)

    def kill(self, rank: int) -> None:
        """SIGKILL a rank (fault injection).

        Args:
            rank: the rank to kill.
        """
        os.kill(self.pid(rank), signal.SIGKILL)

    def stop(self, rank: int) -> None:
        """SIGSTOP a rank (it freezes; ``resume`` or the final cleanup continues it).

        Args:
            rank: the rank to freeze.
        """
        os.kill(self.pid(rank), signal.SIGSTOP)

    def resume(self, rank: int) -> None:
        """SIGCONT a rank that ``stop`` froze.

        Args:
            rank: the rank to continue.
        """
        os.kill(self.pid(rank), signal.SIGCONT)

    async def _outcome(self, rank: int) -> tuple[Any, ...]:
        conn = self._conns[rank]
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        fd = conn.fileno()
        loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        seen = time.time()
        try:
            msg: tuple[Any, ...] = conn.recv()
            if msg[0] == "error" and len(msg) > 4:
                self._failed_at[rank] = float(msg[4])
                msg = msg[:4]
            return msg
        except (EOFError, OSError):
            self._failed_at[rank] = seen
            proc = self.processes[rank]
            await asyncio.to_thread(proc.join, 5)
            code = proc.exitcode
            how = (
                f"signal {signal.Signals(-code).name}"
                if code is not None and code < 0
                else f"exit code {code}"
            )
            return ("died", how)

    async def outcomes(self, wait_for: Iterable[int] | None = None) -> list[tuple[Any, ...]]:
        """Wait for every rank (up to ``timeout``; stragglers are killed) and return one
        tuple per rank without raising: ``("ok", value)``, ``("error", type name, message,
        traceback)`` or ``("died", how)`` — for fault tests where some ranks must fail.

        Args:
            wait_for: wait only for these ranks, then kill the others (e.g. a rank frozen
                with :meth:`stop`, which would otherwise be waited for until ``timeout``).
        """
        tasks = [asyncio.ensure_future(self._outcome(r)) for r in range(self.world_size)]
        awaited = tasks if wait_for is None else [tasks[r] for r in wait_for]
        try:
            await asyncio.wait(awaited, timeout=self.timeout)
        finally:
            pending = [t for t in tasks if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            self.terminate()
        out: list[tuple[Any, ...]] = []
        for rank, task in enumerate(tasks):
            if task.done() and not task.cancelled() and task.exception() is None:
                out.append(task.result())
            else:
                task.cancel()
                out.append(("died", f"rank {rank} did not finish within {self.timeout} s"))
        return out

    async def results(self) -> list[Any]:
        """Wait for every rank (up to ``timeout``) and return results in rank order.

        Raises:
            ExceptionGroup of RankFailed: ranks that raised, died or timed out.
        """
        try:
            async with asyncio.timeout(self.timeout):
                outcomes = await asyncio.gather(*(self._outcome(r) for r in range(self.world_size)))
        except TimeoutError:
            self.terminate()
            raise ExceptionGroup(
                f"spawned ranks did not finish within {self.timeout} s",
                [RankFailed(r, f"rank {r} timed out") for r, p in enumerate(self.processes)],
            ) from None
        finally:
            self.terminate()
        failures = []
        for rank, out in enumerate(outcomes):
            if out[0] == "error":
                failures.append(
                    RankFailed(rank, f"rank {rank} raised {out[1]}: {out[2]}", out[3], out[1])
                )
            elif out[0] == "died":
                failures.append(RankFailed(rank, f"rank {rank} died ({out[1]})", "", "died"))
        if failures:
            first = min(failures, key=lambda f: self._failed_at.get(f.rank, float("inf")))
            what = outcomes[first.rank]
            detail = f"{what[1]}: {what[2]}" if what[0] == "error" else f"died ({what[1]})"
            raise ExceptionGroup(
                headline(first.rank, detail, [f.rank for f in failures], self.world_size), failures
            )
        return [out[1] for out in outcomes]

    def terminate(self) -> None:
        """Kill every rank still running and reap them (idempotent)."""
        for proc in self.processes:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                except OSError:
                    pass
        for proc in self.processes:
            proc.join(5)
        for conn in self._conns:
            conn.close()

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.results().__await__()


def headline(rank: int, detail: str, failed: list[int], world_size: int) -> str:
    """The message of the ExceptionGroup of ``run_ranks``/``spawn_ranks``: the rank that
    failed first and its exception (first line), then how many failed."""
    first_line = detail.splitlines()[0] if detail else ""
    if len(first_line) > 300:
        first_line = first_line[:297] + "..."
    return (
        f"rank {rank} failed first: {first_line} ({len(failed)} of {world_size} ranks "
        f"failed: ranks {failed})"
    )


def spawn_ranks(
    world_size: int,
    target: Callable[..., Awaitable[Any]],
    *args: Any,
    timeout: float = 60.0,
    start_method: str | None = None,
    **options: Any,
) -> SpawnedRanks:
    """Start one process per rank running ``target(group, *args)``; ``await`` the result
    for their return values in rank order.

    Args:
        world_size: how many ranks (processes).
        target: a module-level coroutine function (the children import it by name), run
            as ``target(group, *args)`` on each rank's group.
        *args: the positional arguments after the group (picklable).
        timeout: seconds the whole run may take, from start to the last result.
        start_method: ``"spawn"`` (fresh interpreters) or ``"forkserver"`` (forked from a
            server process that imported aiocollect first; see the module docstring).
            ``None`` (the default) reads ``AIOCOLLECT_SPAWN_START_METHOD``, else
            ``"spawn"``.
        **options: keyword arguments for ``open_group``, plus ``uvloop=True`` to run the
            children on uvloop and ``group_timeout=`` for open_group's ``timeout`` (since
            ``timeout`` here bounds the whole run).

    Returns:
        The running ranks: ``await`` it, or ``await .outcomes()``, for what each returned.

    Raises:
        UsageError: another ``start_method`` (before any process starts).
    """
    method = start_method or os.environ.get(START_METHOD_ENV) or "spawn"
    return SpawnedRanks(world_size, target, args, timeout, options, method)
