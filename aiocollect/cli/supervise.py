"""Supervision of the local rank processes of ``aiocollect run``.

A :class:`Job` owns the rank processes of one node. It reaps them, and on the first rank that
exits non-zero or dies by a signal it stops every other rank (SIGTERM to the rank's process
group, SIGKILL after a grace period). Signals sent to the launcher are forwarded the same way.
A rank that exits 0 while others still run ``EARLY_EXIT_NOTICE`` seconds later is reported
(peers waiting for it in a collective would hang until their group timeout), and marked in
the summary.
:func:`pump_lines` copies a rank's output line by line, each line prefixed with the rank.

Every rank is started in its own session (``start_new_session=True``), so a signal aimed at
it reaches the helper processes it spawned too, and a Ctrl-C at the terminal reaches the
ranks exactly once: through the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TextIO

LINE_LIMIT = 64 * 1024
"""Bytes of a line kept waiting for its newline; beyond that the line is written in pieces,
each with its own prefix (so memory stays bounded whatever a rank prints)."""

_READ_SIZE = 64 * 1024
#: Seconds after a rank exited 0 at which ranks still running get it reported (the
#: launcher's AIOCOLLECT_EARLY_EXIT_NOTICE overrides it).
EARLY_EXIT_NOTICE = 10.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 64`` for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL (signal 9)`` for a Popen-style return code."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)} (signal {-returncode})"
    return f"exit code {returncode}"


def exit_status(returncode: int) -> int:
    """The shell's status for a Popen-style return code: 128 + signal number if killed."""
    return 128 - returncode if returncode < 0 else returncode


class OutputSink:
    """Writes bytes to a text stream's binary buffer and flushes at once.

    Once the reader is gone (broken pipe, closed stream), output is dropped: the ranks keep
    running and never block on a full pipe.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._broken = False

    def write(self, data: bytes) -> None:
        """Write ``data`` (whole prefixed lines) and flush; never raises for a lost reader."""
        if self._broken or not data:
            return
        try:
            buffer = getattr(self._stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:  # a replaced sys.stdout (e.g. io.StringIO) has no binary buffer
                self._stream.write(data.decode(errors="replace"))
                self._stream.flush()
        except (BrokenPipeError, ValueError):
            self._broken = True


async def pump_lines(stream: asyncio.StreamReader, prefix: bytes, sink: OutputSink) -> None:
    """Copy ``stream`` to ``sink`` until EOF, writing ``prefix`` before every line.

    A last line without a newline is written with one added, also when the pump is
    cancelled. A line still without its newline after more than :data:`LINE_LIMIT` bytes is
    cut into pieces. Undecodable bytes pass through unchanged.
    """
    pending = b""
    try:
        while chunk := await stream.read(_READ_SIZE):
            *lines, pending = (pending + chunk).split(b"\n")
            if lines:
                sink.write(b"".join(prefix + line + b"\n" for line in lines))
            while len(pending) > LINE_LIMIT:
                sink.write(prefix + pending[:LINE_LIMIT] + b"\n")
                pending = pending[LINE_LIMIT:]
    finally:
        if pending:
            sink.write(prefix + pending + b"\n")


class RankProc(Protocol):
    """What supervision needs of a rank's process: an ``asyncio.subprocess.Process``
    (started by exec) or a forked rank (aiocollect.cli.forked.ForkedRank)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None

    async def wait(self) -> int: ...


@dataclass
class RankProcess:
    """One started rank: its global rank and its process (leader of its own session)."""

    rank: int
    proc: RankProc
    stopped: bool = False
    """True once the launcher signalled it (its exit is then not a failure of its own)."""
    exited_at: float | None = None
    """When it was reaped (time.monotonic)."""
    early: bool = False
    """True if it exited 0 while other ranks still ran ``EARLY_EXIT_NOTICE`` s later."""


class Job:
    """The rank processes of one node, supervised until every one has exited.

    Args:
        grace: seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        timeout: seconds the whole job may run before it is stopped; None: no limit.
        report: writes one message line for the user (the launcher's stderr).
        early_exit_notice: seconds after a rank exited 0 at which the ranks still running
            get it reported (once per job); default AIOCOLLECT_EARLY_EXIT_NOTICE, else
            ``EARLY_EXIT_NOTICE``.
    """

    def __init__(
        self,
        *,
        grace: float,
        timeout: float | None,
        report: Callable[[str], None],
        early_exit_notice: float | None = None,
    ) -> None:
        self.ranks: list[RankProcess] = []
        self.failure: RankProcess | None = None
        self.signalled: int | None = None
        self.timed_out = False
        self.grace = grace
        self.timeout = timeout
        self._report = report
        self._stop_requested = asyncio.Event()
        if early_exit_notice is None:
            try:
                early_exit_notice = float(os.environ.get("AIOCOLLECT_EARLY_EXIT_NOTICE", ""))
            except ValueError:
                early_exit_notice = EARLY_EXIT_NOTICE
        self.early_exit_notice = early_exit_notice
        self._early_check: asyncio.TimerHandle | None = None

    @property
    def stopping(self) -> bool:
        """True once a failure, a forwarded signal or the timeout asked every rank to stop."""
        return self._stop_requested.is_set()

    def add(self, rank: int, proc: RankProc) -> None:
        """Supervise a just-started rank; it is signalled at once if the job is stopping."""
        entry = RankProcess(rank, proc)
        self.ranks.append(entry)
        if self.stopping:
            self._signal(entry, signal.SIGTERM)

    def on_signal(self, signum: int) -> None:
        """Forward a signal the launcher received; a second one kills every rank."""
        if self.signalled is None:
            self.signalled = signum
            self._report(f"received {signal_name(signum)}; forwarding it to the ranks")
            self.stop(signum)
        else:
            self._report(f"received {signal_name(signum)} again; killing the ranks")
            self.stop(signal.SIGKILL)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to every rank still running and start the SIGKILL countdown."""
        self._stop_requested.set()
        for entry in self.ranks:
            self._signal(entry, signum)

    def kill_remaining(self) -> None:
        """SIGKILL every rank not yet reaped (synchronous; for cleanup paths)."""
        for entry in self.ranks:
            self._signal(entry, signal.SIGKILL)

    def _signal(self, entry: RankProcess, signum: int) -> None:
        if entry.proc.returncode is not None:
            return  # reaped: its pid may belong to someone else by now
        entry.stopped = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(entry.proc.pid, signum)

    async def run(self) -> int:
        """Wait until every rank has exited; returns the launcher's exit status.

        0 only when every rank exited 0. Otherwise: the status of the first rank that failed
        on its own (128 + signal number if a signal killed it), else 128 + the number of the
        signal the launcher received, else 124 after the job timeout.
        """
        async with asyncio.TaskGroup() as tg:
            reapers = [tg.create_task(self._reap(entry)) for entry in self.ranks]
            watchdog = tg.create_task(self._watchdog(reapers))
            if reapers:
                await asyncio.wait(reapers)
            watchdog.cancel()
        if self._early_check is not None:
            self._early_check.cancel()
        return self.exit_status()

    async def _reap(self, entry: RankProcess) -> None:
        returncode = await entry.proc.wait()
        entry.exited_at = time.monotonic()
        if (
            returncode == 0
            and not self.stopping
            and self._early_check is None
            and any(e.proc.returncode is None for e in self.ranks)
        ):
            self._early_check = asyncio.get_running_loop().call_later(
                self.early_exit_notice, self._flag_early, entry
            )
        if returncode == 0 or self.stopping:
            return
        self.failure = entry
        others = sum(1 for e in self.ranks if e.proc.returncode is None)
        self._report(
            f"rank {entry.rank} (pid {entry.proc.pid}) failed: "
            f"{describe_exit(returncode)}; stopping {others} other rank(s)"
        )
        self.stop(signal.SIGTERM)

    def _flag_early(self, entry: RankProcess) -> None:
        """``entry`` exited 0 ``early_exit_notice`` s ago: report it if others still run."""
        running = sorted(e.rank for e in self.ranks if e.proc.returncode is None)
        if self.stopping or not running:
            return
        entry.early = True
        self._report(
            f"rank {entry.rank} exited 0 but rank(s) {_ranks(running)} are still running "
            f"{self.early_exit_notice:g} s later: if they wait for rank {entry.rank} in a "
            "collective, they hang until their group timeout (--group-timeout)"
        )

    async def _watchdog(self, reapers: list[asyncio.Task[None]]) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self._stop_requested.wait()
        except TimeoutError:
            self.timed_out = True
            self._report(f"job timeout ({self.timeout:g} s) reached; stopping the ranks")
            self.stop(signal.SIGTERM)
        if reapers:
            _, pending = await asyncio.wait(reapers, timeout=self.grace)
            if pending:
                late = sorted(e.rank for e in self.ranks if e.proc.returncode is None)
                self._report(
                    f"rank(s) {_ranks(late)} still running {self.grace:g} s "
                    f"after being stopped; sending SIGKILL"
                )
                self.kill_remaining()

    def exit_status(self) -> int:
        """See :meth:`run`."""
        if self.ranks and all(e.proc.returncode == 0 for e in self.ranks):
            return 0
        if self.failure is not None and self.failure.proc.returncode is not None:
            return exit_status(self.failure.proc.returncode)
        if self.signalled is not None:
            return 128 + self.signalled
        if self.timed_out:
            return 124
        return 1

    def summary(self) -> str:
        """One line on how the job ended, naming the first failure and every rank's exit."""
        parts = []
        for entry in sorted(self.ranks, key=lambda e: e.rank):
            code = entry.proc.returncode
            state = "still running" if code is None else describe_exit(code)
            if entry is not self.failure and entry.stopped:
                state += " after being stopped"
            if entry.early and entry.exited_at is not None:
                last = max((e.exited_at or time.monotonic()) for e in self.ranks)
                state += f" early ({last - entry.exited_at:.0f} s before the last rank)"
            parts.append(f"{entry.rank} {state}")
        if self.failure is not None and self.failure.proc.returncode is not None:
            cause = (
                f"job failed: rank {self.failure.rank} failed first, "
                f"{describe_exit(self.failure.proc.returncode)}"
            )
        elif self.signalled is not None:
            cause = f"job interrupted by {signal_name(self.signalled)}"
        elif self.timed_out:
            cause = f"job timed out after {self.timeout:g} s"
        else:
            cause = "job failed"
        return f"{cause}. Ranks: {', '.join(parts)}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


async def supervise(
    job: Job,
    *,
    report: Callable[[str], None],
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Pump the output of ``job``'s ranks while :meth:`Job.run` waits for them.

    Output still buffered in pipes held open by the ranks' own children is drained for at
    most the grace period after the last rank exits. Reports a summary on failure.
    Returns :meth:`Job.run`'s status.
    """
    out = OutputSink(stdout if stdout is not None else sys.stdout)
    err = OutputSink(stderr if stderr is not None else sys.stderr)
    async with asyncio.TaskGroup() as tg:
        pumps = []
        for entry in job.ranks:
            prefix = f"[rank {entry.rank}] ".encode()
            for stream, sink in ((entry.proc.stdout, out), (entry.proc.stderr, err)):
                if stream is not None:
                    pumps.append(tg.create_task(pump_lines(stream, prefix, sink)))
        status = await job.run()
        if pumps:
            _, late = await asyncio.wait(pumps, timeout=job.grace)
            for task in late:
                task.cancel()
    if status != 0:
        report(job.summary())
    return status
