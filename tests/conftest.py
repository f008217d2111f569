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
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
    uvloop = None

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


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups of ``XDIST_GROUPS``: a whole group goes to one
    worker (the largest group first), every other test is scheduled on its own. (xdist's own
    ``xdist_group`` mark works by renaming test ids, which pytest 9.2 ignores: node ids are
    derived, so such marks would group nothing, silently.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class DirectoryGroups(LoadGroupScheduling):
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
    """Whether the test body starts rank processes itself (their loop is theirs to pick),
    or is a collective sweep over memory links only (``tests/collectives/*_memory``)."""
    if (
        getattr(item, "name", "").endswith("_memory")
        and "collectives" in Path(str(item.path)).parts
    ):
        return True  # a sweep over memory links: the loop only schedules, no transport
    code = getattr(getattr(item, "obj", None), "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return bool(names & {"spawn_ranks", "SpawnedRanks"}) or "spawned" in getattr(
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
