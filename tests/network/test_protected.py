"""Protected by default, across network namespaces (one per host): without a secret a
store server and the peer listeners serve their own host only; a stranger on another host
can neither read, write nor join, and is told how to set a secret. With a secret (or an
explicit ``insecure`` opt-out) jobs across hosts work, ``aiocollect run`` included."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiocollect.store import _wire
from tests.support import netns
from tests.support.netns_ranks import ROOT, check_run

STORE_PORT = 29578
_why_not = netns.unavailable()
pytestmark = [pytest.mark.timeout(90)]


@pytest.fixture(scope="module", autouse=True)
def _netns_available() -> None:
    if _why_not is not None:
        pytest.skip(f"needs root and ip netns: {_why_not}")
    netns.remove_leftovers()


@pytest.fixture
def topology() -> Iterator[netns.Topology]:
    with netns.Topology(2) as topo:
        yield topo


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    """``tmp_path``, writable by everyone: a directory the ranks of both hosts share."""
    tmp_path.chmod(0o777)
    return tmp_path


def _env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in ("AIOCOLLECT_SECRET", "AIOCOLLECT_INSECURE")
    }


async def _agent(
    topology: netns.Topology, rank: int, *args: str, stdin: bool = False
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        "ip",
        "netns",
        "exec",
        topology.ns[rank],
        sys.executable,
        "-m",
        "tests.support.targets.protected_agent",
        *args,
        cwd=ROOT,
        env=_env(),
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _event(proc: asyncio.subprocess.Process, timeout: float = 30) -> dict[str, Any]:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        assert proc.stderr is not None
        err = await proc.stderr.read()
        raise AssertionError(f"agent exited: {err.decode(errors='replace')}")
    event: dict[str, Any] = json.loads(line)
    return event


async def _once(topology: netns.Topology, rank: int, *args: str) -> dict[str, Any]:
    proc = await _agent(topology, rank, *args)
    try:
        return await _event(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _is_protected_refusal(message: str) -> bool:
    return (
        "protected mode" in message
        and "AIOCOLLECT_SECRET" in message
        and "AIOCOLLECT_INSECURE=1" in message
    )


async def test_store_without_secret_refuses_other_hosts(topology: netns.Topology) -> None:
    server = await _agent(topology, 0, "store", str(STORE_PORT), stdin=True)
    try:
        assert (await _event(server))["event"] == "ready"
        host = topology.v4(0)
        # This host, by loopback and by its own interface address: served.
        for address in ("127.0.0.1", host):
            local = await _once(topology, 0, "client", address, str(STORE_PORT))
            assert local["ok"], local
        # A client on another host: refused with the way out in the message.
        remote = await _once(topology, 1, "client", host, str(STORE_PORT))
        assert remote["type"] == "StoreError", remote
        assert "refused this connection" in remote["message"], remote
        assert _is_protected_refusal(remote["message"]), remote
        # A stranger that writes anyway: its first frame is the refusal, nothing is
        # answered, nothing stored.
        raw = await _once(topology, 1, "raw", host, str(STORE_PORT))
        assert raw["first"][:3] == [_wire.MAGIC, _wire.VERSION, False], raw
        assert _is_protected_refusal(raw["first"][3]), raw
        assert raw["rest"] == "", raw
        assert server.stdin is not None
        server.stdin.write(b"keys\n")
        keys = await _event(server)
        assert keys["keys"] == ["aiocollect/netns/rank/1"], keys  # the local clients' key
    finally:
        server.kill()
        await server.wait()


async def test_job_without_secret_across_hosts_fails_with_the_fix(
    topology: netns.Topology,
    launch: Any,
) -> None:
    """Rank 1 on another host cannot reach rank 0's embedded store: it fails at once with
    the refusal (not a timeout); it never gets to publish a record."""
    store = f"tcp://{topology.v4(0)}:{STORE_PORT}"
    env = {
        "AIOCOLLECT_STORE": store,
        "AIOCOLLECT_IFNAME": netns.IFNAME,
        "AIOCOLLECT_SECRET": "",
        "NETNS_TIMEOUT": "8",
    }
    ranks = [await launch(0, env)]
    ranks.append(await launch(1, env))
    assert await asyncio.wait_for(ranks[1].proc.wait(), 30) != 0
    await ranks[1]._drain
    err = ranks[1].stderr.decode(errors="replace")
    assert "StoreError" in err, err
    assert _is_protected_refusal(err), err
    assert await asyncio.wait_for(ranks[0].proc.wait(), 30) != 0  # times out alone
    await ranks[0]._drain
    assert "RendezvousTimeout" in ranks[0].stderr.decode(errors="replace")


async def test_peer_listener_without_secret_refuses_other_hosts(
    topology: netns.Topology,
    launch: Any,
    shared_dir: Path,
) -> None:
    """A store both hosts share (a directory: namespaces share the file system): the
    record exchange works, but rank 0's listener refuses the link from the other host, and
    rank 1 says why and what to do."""
    env = {
        "AIOCOLLECT_STORE": f"file://{shared_dir}",
        "AIOCOLLECT_IFNAME": netns.IFNAME,
        "AIOCOLLECT_SECRET": "",
        "NETNS_TIMEOUT": "8",
    }
    ranks = [await launch(r, env) for r in range(2)]
    assert await asyncio.wait_for(ranks[1].proc.wait(), 30) != 0
    await ranks[1]._drain
    err = ranks[1].stderr.decode(errors="replace")
    assert "RendezvousError" in err, err
    assert "rank 0" in err, err
    assert "refused the link" in err, err
    assert _is_protected_refusal(err), err
    await asyncio.wait_for(ranks[0].proc.wait(), 30)


async def test_insecure_opt_out_across_hosts(topology: netns.Topology, launch: Any) -> None:
    store = f"tcp://{topology.v4(0)}:{STORE_PORT}"

    def env(rank: int) -> dict[str, str]:
        return {
            "AIOCOLLECT_STORE": store,
            "AIOCOLLECT_IFNAME": netns.IFNAME,
            "AIOCOLLECT_SECRET": "",
            "AIOCOLLECT_INSECURE": "1",
            "NETNS_MODE": "check",
        }

    await check_run(topology, launch, env, topology.v4)


async def test_secret_job_across_hosts(topology: netns.Topology, launch: Any) -> None:
    store = f"tcp://{topology.v4(0)}:{STORE_PORT}"

    def env(rank: int) -> dict[str, str]:
        return {
            "AIOCOLLECT_STORE": store,
            "AIOCOLLECT_IFNAME": netns.IFNAME,
            "AIOCOLLECT_SECRET": "two-hosts",
            "NETNS_MODE": "check",
        }

    await check_run(topology, launch, env, topology.v4)


RUN_SCRIPT = textwrap.dedent("""
    import asyncio, numpy as np, aiocollect as ac

    async def main():
        async with ac.open_group(transport="tcp", timeout=20) as g:
            a = np.full(4, g.rank + 1.0)
            await g.allreduce(a)
            print("sum", int(a[0]), g.world_size, flush=True)

    asyncio.run(main())
""")


async def _launchers(
    topology: netns.Topology, script: Path, *extra: str
) -> list[tuple[int, str, str]]:
    procs = [
        await asyncio.create_subprocess_exec(
            "ip",
            "netns",
            "exec",
            topology.ns[node],
            sys.executable,
            "-m",
            "aiocollect",
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "-n",
            "1",
            "--master-addr",
            topology.v4(0),
            "--master-port",
            str(STORE_PORT),
            *extra,
            str(script),
            cwd=ROOT,
            env=_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for node in range(2)
    ]
    try:
        outs = [await asyncio.wait_for(p.communicate(), 60) for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    return [
        (p.returncode or 0, o.decode(), e.decode()) for p, (o, e) in zip(procs, outs, strict=True)
    ]


async def test_aiocollect_run_across_hosts(topology: netns.Topology, shared_dir: Path) -> None:
    """`aiocollect run --secret` passes the secret to its ranks: the job runs across hosts;
    without one (nor --insecure) both launchers refuse at once, saying what to do."""
    script = shared_dir / "job.py"
    script.write_text(RUN_SCRIPT)
    for code, out, err in await _launchers(topology, script, "--secret", "run-secret"):
        assert code == 0, err
        assert "sum 3 2" in out, out
    for code, out, err in await _launchers(topology, script):
        assert code == 2, (out, err)
        assert "AIOCOLLECT_SECRET" in err, err
        assert "--insecure" in err, err
