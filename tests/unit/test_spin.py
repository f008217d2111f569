"""The busy-wait policy (engine/spin.py): on while this host's rank processes fit its cores,
off when they outnumber them, the environment variable overriding both; the budget a real
group gets from its real links; and a spinner that stops by itself.

The policy is checked with this machine's real CPU affinity, and in a child process whose
affinity is cut to one core (so "more ranks than cores" is real there, not a number passed
in). No test here measures time."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.engine import spin
from aiocollect.testing import run_ranks
from aiocollect.transport import shm_ring, sockets

pytestmark = pytest.mark.timeout(60)


def test_on_while_ranks_fit_the_cores_off_beyond(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)
    cores = len(os.sched_getaffinity(0))
    assert spin.usable_cores() == cores
    assert spin.spin_budget(1) == spin.SPIN_SECONDS
    assert spin.spin_budget(cores) == spin.SPIN_SECONDS
    assert spin.spin_budget(cores + 1) == 0.0
    assert spin.spin_budget(4 * cores) == 0.0


def test_the_load_average_does_not_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1-minute load average counts the job's own ranks (and a job that just ended):
    two ranks busy on two cores read 2.0-3.6 here, and a gate on it turned spinning off
    for every group formed after them, small TCP operations 2-3x slower
    (``aiocollect bench allreduce -n 2 --transport tcp --small`` after a busy job). The
    host's load, however high, leaves the rule to the ranks and the cores; spins that keep
    missing back off by themselves (the spinner's test)."""
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert spin.spin_budget(2, cores=2) == spin.SPIN_SECONDS
    assert spin.spin_budget(1, cores=2) == spin.SPIN_SECONDS
    assert spin.spin_budget(3, cores=2) == 0.0


_CHILD = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ.pop("AIOCOLLECT_SPIN_US", None)
from aiocollect.engine import spin
print(json.dumps([spin.usable_cores(), spin.spin_budget(1),
                  spin.spin_budget(2)]))
"""


def test_a_process_pinned_to_one_core_does_not_spin_with_a_local_peer() -> None:
    """The affinity, not the host's CPU count, decides: pinned to one core, two local
    ranks are oversubscribed (the CI host has more cores than that)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    cores, alone, with_peer = json.loads(out.stdout)
    assert cores == 1
    assert alone == spin.SPIN_SECONDS
    assert with_peer == 0.0


def test_the_environment_overrides_the_rule(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cores = spin.usable_cores()
    monkeypatch.setenv(spin.SPIN_ENV, "0")
    assert spin.spin_budget(1) == 0.0  # off, even with a core to spare
    monkeypatch.setenv(spin.SPIN_ENV, "120")
    assert spin.spin_budget(cores + 3) == pytest.approx(120e-6)  # forced on, oversubscribed
    monkeypatch.setenv(spin.SPIN_ENV, "-5")
    assert spin.spin_budget(1) == 0.0
    monkeypatch.setenv(spin.SPIN_ENV, "fast")
    with caplog.at_level("WARNING", logger="aiocollect"):
        assert spin.spin_budget(1) == spin.SPIN_SECONDS  # ignored: the rule
        assert spin.spin_budget(cores + 1) == 0.0
    assert "AIOCOLLECT_SPIN_US" in caplog.text
    assert spin.spin_budget(5, cores=8, env={}) == spin.SPIN_SECONDS
    assert spin.spin_budget(9, cores=8, env={}) == 0.0


@pytest.mark.parametrize(("transport", "n"), [("tcp", 2), ("tcp", 3), ("memory", 2), ("shm", 2)])
async def test_a_group_counts_its_same_host_peers(
    monkeypatch: pytest.MonkeyPatch, transport: str, n: int
) -> None:
    """Real links say what the engine asks (``LinkCaps``): every TCP or shared-memory peer
    on loopback is a local process; memory links are in-process (nothing to poll, never
    spins); only shared-memory links poll for their frames themselves (the engine's
    spinner leaves them alone). The budget is the policy's for that many local ranks on
    this machine's cores, and the group's results are right either way."""
    if transport == "shm" and (why := shm_ring.unavailable()) is not None:
        pytest.skip(why)
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)

    async def body(g: ac.Group) -> tuple[list[bool | None], list[bool], float]:
        buf = np.full(4, g.rank + 1.0)
        await g.allreduce(buf)
        assert buf.tolist() == [n * (n + 1) / 2] * 4
        fabric = g._fabric
        caps = [link.caps for link in fabric.links.values()]
        return [c.local for c in caps], [c.polls for c in caps], fabric.spinner.budget

    for hosts, polls, budget in await run_ranks(n, body, transport=transport):
        assert polls == [transport == "shm"] * (n - 1)
        if transport == "memory":
            assert hosts == [None] * (n - 1)
            assert budget == 0.0
        else:
            assert hosts == [True] * (n - 1)
            assert budget == spin.spin_budget(n)
            assert (budget > 0) == (n <= spin.usable_cores())


@pytest.mark.parametrize(
    ("peer", "here", "local"),
    [
        (("127.0.0.1", 5000), ("127.0.0.1", 6000), True),
        (("10.1.2.3", 5000), ("10.1.2.3", 6000), True),
        (("::1", 5000, 0, 0), ("::1", 6000, 0, 0), True),
        (("10.1.2.4", 5000), ("10.1.2.3", 6000), False),
        ("", "/tmp/sock", None),  # a Unix socket: not a network address
        (None, None, None),
    ],
)
def test_a_stream_link_is_local_when_its_two_ends_share_an_address(
    peer: object, here: object, local: bool | None
) -> None:
    assert sockets.is_local(peer, here) is local


async def _stopped(s: spin.Spinner) -> None:
    """Loop turns until ``s`` stops spinning (its budget bounds them)."""
    for _ in range(10_000_000):
        if not s.spinning:
            return
        await asyncio.sleep(0)
    raise AssertionError("the spinner never stopped")


async def test_the_spinner_stops_by_itself_and_backs_off() -> None:
    loop = asyncio.get_running_loop()
    s = spin.Spinner(0.002, loop)
    done: asyncio.Future[None] = loop.create_future()
    s.wait(done)
    assert s.spinning
    done.set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)
    assert not s.spinning  # the frame came: it stopped, and the next wait spins
    never: asyncio.Future[None] = loop.create_future()
    s.wait(never)
    await _stopped(s)  # the budget runs out on its own
    assert not never.done()
    s.wait(never)
    assert not s.spinning  # one miss: the next wait sleeps at once
    s.wait(never)
    assert s.spinning
    await _stopped(s)
    for _ in range(3):  # two misses in a row: three waits sleep at once
        s.wait(never)
        assert not s.spinning
    s.wait(never)
    assert s.spinning
    never.set_result(None)
    await _stopped(s)
    s.wait(never)
    assert s.spinning  # a success reset the back-off
    await _stopped(s)
