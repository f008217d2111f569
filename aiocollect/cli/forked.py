"""Rank processes forked from the launcher, with aiocollect, numpy and uvloop already imported.

``aiocollect run`` starts its ranks this way by default (``--start-method fork``) where
the platform allows it: before its event loop starts, the launcher imports what every
rank imports anyway (:data:`PRELOAD`), then forks one child per local rank, and each
child runs the user's script or module in its own fresh ``__main__`` (``runpy``), with the
rank's environment, command line, ``sys.path[0]``, standard streams and signal handling
as ``python script.py`` would have them.

Why: where ranks outnumber the cores they time-share them, and every switch between two
ranks refills the caches with the other's memory. Forked ranks share the pages of the
interpreter state they inherited (the imported modules), so a switch refills less: at
four ranks on two cores a 4-byte allreduce's p50 per rank was 0.66x that of ranks started
by ``exec`` over twelve paired rounds (0.8-0.9x of each iteration's slowest rank in the
bench; ``tools/alternate.py`` over ``aiocollect run -n 4 --start-method fork`` (and ``exec``)
``tools/op_cpu.py``; docs/design.md, *Ranks forked from the launcher*); with a core per rank
there was no difference. The ranks also start sooner (a four-rank job that only imports:
0.49-0.55
against 0.75-0.81 s) and hold less memory together (35 against 105 MB of proportional
set size for four ranks).

What differs from a separate interpreter: the modules in :data:`PRELOAD` (and what they
import) are already imported, with the launcher's environment, so numpy's BLAS threads
follow the launcher's ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/``MKL_NUM_THREADS``,
which the launcher sets to the ranks' values (one thread each unless the user chose
otherwise) before it imports anything, re-executing itself once if it must
(``launch.run_main``); ``sys.orig_argv`` is the launcher's. When forking would not be
safe, because the launcher runs another Python thread (:func:`fork_safe`), or a module
fails to import, it falls back to ``exec`` and says why.

The child never returns into the launcher's code: it runs the target, then the
interpreter's exit steps (non-daemon threads joined, ``atexit`` handlers, streams
flushed) and leaves with ``os._exit``, with the status ``python`` would have given
(:func:`exit_code`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

START_METHODS = ("fork", "exec")
START_METHOD_ENV = "AIOCOLLECT_START_METHOD"
#: Imported by the launcher before it forks: what every rank of an aiocollect job imports.
PRELOAD = ("numpy", "uvloop", "aiocollect", "aiocollect.api", "aiocollect.group")
#: The BLAS/OpenMP thread variables the ranks get (launch.rank_env sets them to 1 unless
#: the user chose otherwise); the launcher imports numpy under the same values.
BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def default_start_method(environ: Mapping[str, str] | None = None) -> str:
    """``AIOCOLLECT_START_METHOD`` if it names a start method, else ``fork`` where this
    platform can fork (Linux), ``exec`` elsewhere."""
    chosen = (os.environ if environ is None else environ).get(START_METHOD_ENV, "").strip()
    if chosen in START_METHODS:
        return chosen
    return "fork" if hasattr(os, "fork") and sys.platform.startswith("linux") else "exec"


def preload(modules: Iterable[str] = PRELOAD) -> str | None:
    """Import ``modules`` into this (the launcher's) process. Returns None when forking
    is then safe, else why not (a module failed to import, or :func:`fork_safe` says no).
    Numpy's BLAS is imported with this process's environment, which the launcher gives
    the ranks' BLAS thread settings first (``launch.run_main``): its OpenBLAS stops its
    pool before a fork and each rank starts its own with the same settings."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken install: the ranks will say it themselves
            return f"importing {name} failed: {exc}"
    return fork_safe()


def flush_stdio() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr`` as far as they let themselves be (before a
    fork or an exec, so that nothing buffered is written twice or lost)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def kill_and_reap(pids: Iterable[int], group: bool = False) -> None:
    """SIGKILL each of ``pids`` (its whole process group with ``group``: a rank leads its
    own session) and reap it, so that none is left a zombie; processes already gone are
    skipped."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)


def fork_safe() -> str | None:
    """None if no Python thread but this one runs (a fork copies only the calling
    thread, so another thread's locks would stay held in the child), else why not."""
    threads = threading.active_count()
    if threads > 1:
        return f"the launcher runs {threads} Python threads"
    return None


@dataclass
class ForkedRank:
    """A rank forked by :func:`fork_rank`: the surface of ``asyncio.subprocess.Process``
    that the launcher's supervision uses (``pid``, ``returncode``, ``wait()``, ``stdout``
    and ``stderr`` stream readers). Call :meth:`attach` on the launcher's loop first."""

    pid: int
    out_fd: int
    err_fd: int
    returncode: int | None = None
    stdout: asyncio.StreamReader | None = None
    stderr: asyncio.StreamReader | None = None
    _exited: asyncio.Future[int] | None = field(default=None, repr=False)
    _pidfd: int = -1

    async def attach(self) -> None:
        """Connect the output pipes and the exit notification to the running loop."""
        loop = asyncio.get_running_loop()
        self.stdout = await _reader(loop, self.out_fd)
        self.stderr = await _reader(loop, self.err_fd)
        self._exited = loop.create_future()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): a thread waits instead
            waited = loop.run_in_executor(None, os.waitpid, self.pid, 0)
            waited.add_done_callback(self._waited)
            return
        loop.add_reader(self._pidfd, self._pid_ready)

    def _pid_ready(self) -> None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return  # (spurious)
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self._set_status(status)

    def _waited(self, fut: asyncio.Future[tuple[int, int]]) -> None:
        self._set_status(fut.result()[1])

    def _set_status(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        """The exit status, ``Popen``-style (negative: killed by that signal)."""
        assert self._exited is not None, "attach() first"
        return await asyncio.shield(self._exited)


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader


def fork_rank(
    target: str, module: bool, args: Sequence[str], env: Mapping[str, str], stdin_null: bool
) -> ForkedRank:
    """Fork a rank that runs ``target`` (a script path, or a module name with ``module``)
    with ``args`` in environment ``env``, as the leader of its own session, its stdout and
    stderr on new pipes (read by the returned :class:`ForkedRank`), its stdin /dev/null if
    ``stdin_null`` else the launcher's. Call before the launcher's event loop runs.

    Raises:
        OSError: the fork or a pipe failed.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    flush_stdio()
    try:
        pid = os.fork()
    except OSError:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    if pid == 0:  # the rank: never returns
        os.close(out_r)
        os.close(err_r)
        _child(target, module, args, env, stdin_null, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    return ForkedRank(pid, out_r, err_r)


def _child(
    target: str,
    module: bool,
    args: Sequence[str],
    env: Mapping[str, str],
    stdin_null: bool,
    out_w: int,
    err_w: int,
) -> None:
    code = 1
    try:
        os.setsid()
        if stdin_null:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        _default_signals()
        os.environ.clear()
        os.environ.update(env)
        _fresh_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        code = run_target(target, module, args)
    except BaseException:  # the rank's own setup failed: say so, as python would
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(code)


def _default_signals() -> None:
    """The signal handling ``python`` starts with, except what the launcher ignores (a
    SIGHUP ignored under nohup stays ignored by the ranks, as with exec)."""
    signal.set_wakeup_fd(-1)
    for signum, handler in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGHUP, signal.SIG_DFL),
    ):  # (SIGPIPE: ignored by python in the launcher already, as in a fresh one)
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, handler)


_REPLACED: list[object] = []


def _fresh_stdio(unbuffered: bool) -> None:
    """``sys.stdout``/``stderr`` anew on fds 1 and 2 (now the rank's pipes), as python
    would open them for this rank: unbuffered under ``PYTHONUNBUFFERED`` (the launcher
    sets it), else stdout block-buffered and stderr line-buffered."""
    for name, fd, errors in (("stdout", 1, None), ("stderr", 2, "backslashreplace")):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            binary,
            encoding=encoding,
            errors=errors or getattr(old, "errors", None) or "strict",
            line_buffering=fd == 2 and not unbuffered,
            write_through=unbuffered,
        )
        _REPLACED.append(old)  # (its fd must stay open whatever it would do when freed)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_target(target: str, module: bool, args: Sequence[str]) -> int:
    """Run ``target`` as ``__main__`` the way ``python [-m] target args`` would, then the
    interpreter's exit steps; returns the exit status (or re-raises SIGINT on itself
    for an uncaught KeyboardInterrupt, as python does)."""
    sys.argv = [target, *args]  # (for a module runpy puts its path in argv[0])
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    interrupted = False
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 130, True
    except BaseException:
        traceback.print_exc()
        code = 1
    code = _shutdown(code)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def exit_code(code: object) -> int:
    """The status of ``SystemExit(code)``: None 0, an int itself, anything else printed
    to stderr and 1 (python's rule)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _shutdown(code: int) -> int:
    """Python's exit steps: join the non-daemon threads, run ``atexit``, flush stdio."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120  # python's status when flushing stdout fails at exit
    return code
