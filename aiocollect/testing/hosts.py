"""Hosts on one machine: a network namespace per host, its ranks as real processes.

:class:`Namespaces` builds a hub namespace with a bridge and one namespace per member,
each wired to the bridge by a veth pair and given its own address; the multi-host tests
of tests/network use it with one namespace per rank (``tests/support/netns.py``), and
:class:`Hosts` with one per host. :class:`Hosts` builds, for ``host_of[r]`` (the host of
each rank), one namespace per host (``10.78.0.<h+1>``) and, per rank process, its own
hostname (``unshare --uts``): the rendezvous sees as many hosts as namespaces, ranks of
one namespace share a host (shared memory between them), ranks of two talk TCP over the
veths, and the host side of each veth counts what leaves the host (``tx_bytes``). Rank
``r`` runs ``python -m MODULE ARGS`` in its host's namespace with ``AIOCOLLECT_RANK``/
``WORLD_SIZE``/``STORE``/``IFNAME``/``SECRET`` set (rank 0's embedded store on its host's
address) and reports one JSON line on stdout, which :meth:`Hosts.run` returns per rank.

Every name carries a prefix and the creating process id (``achost-<pid>-<n>-...``), so
parallel test workers never collide and leftovers of a killed run are removed by
:func:`remove_leftovers`. Needs root and ``ip`` (:func:`unavailable` says why not);
``close`` removes the namespaces and kills every process still in them, also after a
failure half-way through setup. Used by tests/hosts, tests/network and
tools/hosts_bench.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Self

PREFIX = "achost-"
#: The host-side interface in every host namespace (what AIOCOLLECT_IFNAME names).
IFNAME = "veth-h"
BRIDGE = "br0"
#: The port of rank 0's embedded store (each namespace has its own port space).
STORE_PORT = 29588
#: The secret every rank gets: a job across hosts is protected (docs/multinode.md).
SECRET = "hosts-job-secret"
_serial = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``.

    Raises:
        RuntimeError: it failed (with its stderr) and ``check``.
    """
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable(uts: bool = True) -> str | None:
    """Why namespaces cannot be built here (not root, no ``ip``, no namespaces, veths or
    bridges; with ``uts``, no ``unshare`` or UTS namespaces), or None."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "unshare") if uts else ("ip",):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        veth = ip("link", "add", "p0", "netns", probe, "type", "veth", "peer", "name", "p1",
                  "netns", probe, check=False)  # fmt: skip
        if veth.returncode:
            return f"no veth: {veth.stderr.strip()}"
        bridge = ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode:
            return f"no bridge: {bridge.stderr.strip()}"
        if uts:
            named = subprocess.run(
                ["ip", "netns", "exec", probe, "unshare", "--uts", "hostname", "probe"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if named.returncode:
                return f"unshare --uts failed: {named.stderr.strip()}"
    finally:
        delete_namespace(probe)
    return None


def delete_namespace(name: str) -> None:
    """Kill every process still in namespace ``name``, then delete it."""
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", name, check=False)


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces whose name starts with ``prefix`` and whose creating process (the
    pid after the prefix) is gone; return their names."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix):
            continue
        try:
            owner = int(name[len(prefix) :].split("-", 1)[0])
        except ValueError:
            owner = -1
        if owner == os.getpid() or (owner > 0 and _alive(owner)):
            continue
        delete_namespace(name)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def placement(hosts: int, per_host: int, kind: str) -> list[int]:
    """``host_of`` for ``hosts`` x ``per_host`` ranks: ``"blocked"`` (ranks 0..R-1 on
    host 0, ...) or ``"cyclic"`` (rank r on host r mod H, Slurm's cyclic distribution).

    Raises:
        ValueError: another ``kind``.
    """
    n = hosts * per_host
    if kind == "blocked":
        return [r // per_host for r in range(n)]
    if kind == "cyclic":
        return [r % hosts for r in range(n)]
    raise ValueError(f"placement is blocked or cyclic, not {kind!r}")


class Namespaces:
    """A hub namespace with a bridge and ``count`` member namespaces wired to it: member
    ``i`` lives in ``self.ns[i]`` (named ``<prefix><pid>-<n>-<member><i>``), its interface
    ``ifname`` holding ``<v4net>.<i+1>/24`` and, with ``v6net``, ``<v6net>::<i+1>/64``.
    A context manager: built on enter; the namespaces (and every process still running in
    them) are removed on exit, also after a failure half-way through setup."""

    def __init__(
        self,
        count: int,
        *,
        prefix: str = PREFIX,
        ifname: str = IFNAME,
        v4net: str = "10.78.0",
        v6net: str | None = None,
        member: str = "h",
    ) -> None:
        self.tag = f"{prefix}{os.getpid()}-{next(_serial)}"
        self.ifname = ifname
        self.v4net = v4net
        self.v6net = v6net
        self.member = member
        self.hub = f"{self.tag}-hub"
        self.ns = [f"{self.tag}-{member}{i}" for i in range(count)]
        self.created: list[str] = []

    def v4(self, i: int) -> str:
        """Member ``i``'s IPv4 address."""
        return f"{self.v4net}.{i + 1}"

    def v6(self, i: int) -> str:
        """Member ``i``'s IPv6 address (where the network has one)."""
        return f"{self.v6net}::{i + 1}"

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        self._add(self.hub)
        ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.hub, "link", "set", BRIDGE, "up")
        for i, ns in enumerate(self.ns):
            self._add(ns)
            port = f"hub-{self.member}{i}"
            ip("link", "add", self.ifname, "netns", ns, "type", "veth", "peer", "name", port,
               "netns", self.hub)  # fmt: skip
            ip("-n", self.hub, "link", "set", port, "master", BRIDGE)
            ip("-n", self.hub, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{self.v4(i)}/24", "dev", self.ifname)
            if self.v6net is not None:
                # nodad: usable at once (duplicate address detection would hold it ~2 s)
                ip("-n", ns, "-6", "addr", "add", f"{self.v6(i)}/64", "dev", self.ifname,
                   "nodad")  # fmt: skip
            ip("-n", ns, "link", "set", self.ifname, "up")

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def link_down(self, i: int) -> None:
        """Cut member ``i`` off: its interface goes down (its peers see silence, not a
        reset)."""
        ip("-n", self.ns[i], "link", "set", self.ifname, "down")

    def close(self) -> None:
        """Remove the namespaces (and what runs in them)."""
        for name in reversed(self.created):
            delete_namespace(name)
        self.created.clear()


class Hosts(Namespaces):
    """Namespaces for the hosts of ``host_of`` (rank r on host ``host_of[r]``; hosts
    numbered 0..H-1). A context manager: built on enter, removed on exit."""

    def __init__(self, host_of: Sequence[int]) -> None:
        self.host_of = list(host_of)
        super().__init__(max(self.host_of) + 1)

    def address(self, host: int) -> str:
        """Host ``host``'s IPv4 address."""
        return self.v4(host)

    def hostname(self, host: int) -> str:
        """The hostname the ranks of host ``host`` run under."""
        return f"{self.tag}-host{host}"

    def tx_bytes(self, host: int) -> int:
        """Bytes that left host ``host`` on its interface so far."""
        out = ip("-n", self.ns[host], "-j", "-s", "link", "show", IFNAME).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def env(self, rank: int, extra: Mapping[str, str] = {}) -> dict[str, str]:
        """Rank ``rank``'s environment: this one's, the group's variables, ``extra``."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("AIOCOLLECT_")}
        return {
            **base,
            "AIOCOLLECT_RANK": str(rank),
            "AIOCOLLECT_WORLD_SIZE": str(len(self.host_of)),
            "AIOCOLLECT_STORE": f"tcp://{self.address(self.host_of[0])}:{STORE_PORT}",
            "AIOCOLLECT_IFNAME": IFNAME,
            "AIOCOLLECT_SECRET": SECRET,
            **extra,
        }

    async def start(
        self,
        rank: int,
        module: str,
        args: Sequence[str],
        extra: Mapping[str, str] = {},
    ) -> asyncio.subprocess.Process:
        """Start rank ``rank``: ``python -m module args`` in its host's namespace under
        its host's hostname, stdout and stderr piped."""
        host = self.host_of[rank]
        return await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", self.ns[host],
            "unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh",
            self.hostname(host), sys.executable, "-m", module, *args,
            env=self.env(rank, extra),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    async def run(
        self,
        module: str,
        args: Sequence[str],
        timeout: float,
        extra: Mapping[str, str] = {},
    ) -> list[dict[str, Any]]:
        """Run every rank (:meth:`start`) until all exit; each rank's last stdout line,
        parsed as JSON, in rank order.

        Raises:
            AssertionError: a rank exited non-zero or printed no JSON line (every
                failing rank's stderr in the message), or the ranks ran past
                ``timeout`` seconds (the rest are killed).
        """
        procs = [await self.start(r, module, args, extra) for r in range(len(self.host_of))]
        try:
            async with asyncio.timeout(timeout):
                outs = await asyncio.gather(*(p.communicate() for p in procs))
        except TimeoutError:
            raise AssertionError(f"ranks still running after {timeout} s") from None
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        failed = [
            f"rank {r} (exit {p.returncode}):\n{err.decode(errors='replace')}"
            for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True))
            if p.returncode or not out.strip()
        ]
        if failed:
            raise AssertionError("\n".join(failed))
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
