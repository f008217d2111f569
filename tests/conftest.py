"""Suite-wide strictness: every test's event loop traps unhandled errors, and the in-process
collective, stress and failure suites run on both asyncio and uvloop.

- The loop-error trap: whatever reaches an event loop's exception handler during a test (an
  exception escaping a protocol callback, a Task whose exception nobody retrieved, a callback
  that raised) fails that test. Tests that expect such reports install their own handler
  (``loop_errors`` in tests/failure/conftest.py) and restore this one after.
- Loops: ``pytest_asyncio_loop_factories`` gives the tests under ``LOOP_SUITES`` two loop
  factories, so each of their async tests runs once per loop (test ids ``[asyncio]`` and
  ``[uvloop]``). Tests there that start rank processes themselves (whose ranks choose their
  own loop with ``uvloop=True``), or are marked ``one_loop``, run on asyncio alone.
- Workers: under pytest-xdist (``make test`` runs ``-n auto``; ``--dist loadgroup`` is in
  the ini options) the tests under a directory of ``XDIST_GROUPS`` all run on one worker,
  one after another (docs/testing.md, "In parallel").
- ``redis_url``: one private redis-server per session (so per xdist worker) for every test
  that needs one (the store and rendezvous suites).
- The transport axis: a test that takes the ``axis`` fixture runs over every registered
  transport and its modes (tests/support/transports.py; the ``transports`` mark picks its
  cases).
- Rank processes: ``spawn_ranks`` calls that name no start method fork their ranks from a
  forkserver that imported aiocollect once per worker (``AIOCOLLECT_SPAWN_START_METHOD``),
  rather than starting an interpreter per rank: the same ranks, with the caller's
  environment and directory, for a fifth of the CPU. tests/multiprocess/test_spawned.py
  runs the ``spawn`` method by name.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from aiocollect.testing import free_port
from aiocollect.testing.certs import Certs
from tests.support import transports
from tests.support.certs import make_certs
from tests.support.shm_leaks import nothing_left
from tests.support.stall_warnings import StallWarnings

os.environ.setdefault("AIOCOLLECT_SPAWN_START_METHOD", "forkserver")
from tests.support.transports import Axis

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
    uvloop = None  # type: ignore[assignment]

LOOP_SUITES = ("collectives", "failure", "stress")
_ROOT = Path(__file__).parent
#: Test directories whose tests share one xdist worker (group name: directory prefixes).
#: cpu-bound: a stress case is a world of up to 4 ranks with 32 large operations in flight,
#: a bench test runs whole benchmarks (torch-importing gloo ranks included); each takes every
#: core it gets. Two of them at once on 2 cores doubled each one's time: world-4 stress cases
#: hit their 30 s operation timeout (PeerTimeout) and a bench comparison its 110 s bound, in
#: make test on a loaded machine. One after another they pass.
XDIST_GROUPS = {"cpu-bound": ("tests/stress/", "tests/bench/")}

_unhandled: list[dict[str, Any]] = []


def _trap(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    _unhandled.append(context)
    loop.default_exception_handler(context)


def _trapped(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> Callable[[], asyncio.AbstractEventLoop]:
    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_exception_handler(_trap)
        return loop

    return make


_ASYNCIO = _trapped(asyncio.new_event_loop)
_UVLOOP = None if uvloop is None else _trapped(uvloop.new_event_loop)


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`make test &`, a CI step run with `&`) with SIGINT
    # ignored, and an ignored signal stays ignored across exec: every launcher and rank the
    # tests start would then inherit it, unlike under a terminal. A handled signal is reset
    # to the default on exec, so handling it here gives the tests' children the
    # disposition a terminal gives them.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers",
        "one_loop: run on asyncio only (the test drives spawned processes, "
        "which pick their own loop)",
    )
    config.addinivalue_line(
        "markers", "both_loops: run this async test on asyncio and uvloop, in any suite"
    )
    config.addinivalue_line(
        "markers",
        "transports(argnames=None, values=None, default=None, where='any'): the cases of "
        "a test on the transport axis (tests/support/transports.py)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test that takes ``axis`` over the transport axis."""
    if "axis" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("transports")
    names, params = transports.cases(**(mark.kwargs if mark is not None else {}))
    metafunc.parametrize(names, params, indirect=["axis"])


@pytest.fixture
def stall_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[StallWarnings]:
    """The library's no-progress warnings during the test, the first after 0.4 s."""
    from aiocollect.engine import watchdog

    monkeypatch.setattr(watchdog, "PROGRESS_SECONDS", 0.4)
    handler = StallWarnings()
    logger = logging.getLogger("aiocollect")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def axis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Axis]:
    """The test's place on the transport axis: its mode's environment is set (spawned ranks
    inherit it), certificates are made for a mode that needs TLS, and the test may leave
    nothing in shared memory."""
    m: transports.Mode = request.param
    why = m.unavailable()
    if why is not None:
        pytest.skip(f"{m.name}: {why}")
    for key, value in m.env.items():
        monkeypatch.setenv(key, value)
    certs = request.getfixturevalue("certs") if m.needs_tls else None
    with nothing_left():
        yield Axis(m, certs)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups of ``XDIST_GROUPS``: a whole group goes to one
    worker (the largest group first), every other test is scheduled on its own. (xdist's own
    ``xdist_group`` mark works by renaming test ids, which pytest 9.2 ignores: node ids are
    derived, so such marks would group nothing, silently.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class DirectoryGroups(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            for group, prefixes in XDIST_GROUPS.items():
                if nodeid.startswith(prefixes):
                    return f"group:{group}"
            return nodeid

    return DirectoryGroups(config, log)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    try:
        suite = Path(str(item.path)).relative_to(_ROOT).parts[0]
    except ValueError:
        suite = ""
    both = item.get_closest_marker("both_loops") is not None or (
        suite in LOOP_SUITES
        and not _drives_processes(item)
        and item.get_closest_marker("one_loop") is None
    )
    if both and _UVLOOP is not None:
        return {"asyncio": _ASYNCIO, "uvloop": _UVLOOP}
    return {"asyncio": _ASYNCIO}


def _drives_processes(item: pytest.Item) -> bool:
    """Whether the test body starts rank processes itself (``spawn_ranks``, or ``spawn`` of
    the transport axis; their loop is theirs to pick), or is a collective sweep over memory
    links only (``tests/collectives/*_memory``)."""
    if (
        getattr(item, "name", "").endswith("_memory")
        and "collectives" in Path(str(item.path)).parts
    ):
        return True  # a sweep over memory links: the loop only schedules, no transport
    code = getattr(getattr(item, "obj", None), "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return bool(names & {"spawn_ranks", "SpawnedRanks", "spawn"}) or "spawned" in getattr(
        item, "fixturenames", ()
    )


@pytest.fixture(autouse=True)
def loop_error_trap() -> Iterator[None]:
    """Fail the test if anything reached an event loop's exception handler during it."""
    _unhandled.clear()
    yield
    gc.collect()  # a Task that failed unobserved reports when it is collected
    seen, _unhandled[:] = list(_unhandled), []
    if seen:
        lines = [f"{c.get('message')}: {c.get('exception')!r}" for c in seen]
        pytest.fail(
            "unhandled errors reached the event loop:\n  " + "\n  ".join(lines), pytrace=False
        )


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Certificates for four ranks (skips the test visibly where they cannot be made)."""
    return make_certs(tmp_path_factory.mktemp("certs"), 4)


#: The private redis-server's password; tests/store/test_backends.py replaces it in the URL
#: to provoke a refusal.
REDIS_PASSWORD = "conformance-pw"
#: Loopback only, no persistence, logs to stdout (read until it is ready, then drained).
_REDIS_ARGS = ("--bind", "127.0.0.1", "--protected-mode", "no", "--logfile", "")
_REDIS_NO_SAVE = ("--save", "", "--appendonly", "no")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis://:conformance-pw@127.0.0.1:PORT/0`` of a private redis-server, one per
    session (under pytest-xdist one per worker), on a free port (tried three times: another
    process may take the port between ``free_port`` and the server's bind). It is stopped
    and reaped at the end of the session and its directory removed. Skips visibly when the
    binary is missing. Tests choose their own database number or flush before use."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server): redis skipped")
    workdir = tmp_path_factory.mktemp("redis")
    try:
        for _ in range(3):
            port = free_port()
            args = ["--port", str(port), "--dir", str(workdir), "--requirepass", REDIS_PASSWORD]
            server = _Server([binary, *args, *_REDIS_ARGS, *_REDIS_NO_SAVE])
            try:
                if server.ready():
                    yield f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
                    return
            finally:
                server.stop()
            if not any("Address already in use" in x for x in server.lines):
                pytest.fail("redis-server did not start:\n" + "".join(server.lines))
        pytest.fail("redis-server found no free port in three tries")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _Server:
    """A server process whose output is read until it says it is ready, then drained by a
    thread (so a full pipe never blocks it)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._drain: threading.Thread | None = None

    def ready(self) -> bool:
        """True once it accepts connections; False when it exited first (``lines``: what
        it printed). Bounded by pytest-timeout if it does neither."""
        out = self.proc.stdout
        assert out is not None
        for line in out:
            self.lines.append(line)
            if "Ready to accept connections" in line:
                self._drain = threading.Thread(target=out.read, daemon=True)
                self._drain.start()
                return True
        return False

    def stop(self) -> None:
        """Terminate it (SIGKILL after 10 s), reap it, wait for the drain and close the pipe."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._drain is not None:
            self._drain.join(timeout=10)  # EOF: the server is gone
        assert self.proc.stdout is not None
        self.proc.stdout.close()
