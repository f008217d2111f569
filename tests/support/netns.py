"""Network namespaces for the multi-host tests: one namespace per rank, each joined by a veth
pair to a bridge in a hub namespace. Every interface and address lives inside namespaces
created here (10.77.0.0/24, fd77::/64); nothing is added to the root namespace.

Names carry a prefix and the creating process id (``acnet-<pid>-<n>-...``), so leftovers
of a crashed session can be recognised and removed (:func:`remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess

from aiocollect.transport.shm_ring import pid_alive

PREFIX = "acnet-"
#: The rank-side interface in every rank namespace (what AIOCOLLECT_IFNAME names).
IFNAME = "veth-x"
BRIDGE = "br0"
_serial = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise with its stderr when it fails and ``check``."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        veth = ip(
            "link",
            "add",
            "p0",
            "netns",
            probe,
            "type",
            "veth",
            "peer",
            "name",
            "p1",
            "netns",
            probe,
            check=False,
        )
        if veth.returncode:
            return f"no veth: {veth.stderr.strip()}"
        bridge = ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode:
            return f"no bridge: {bridge.stderr.strip()}"
    finally:
        delete_namespace(probe)
    return None


def delete_namespace(name: str) -> None:
    """Kill what still runs in namespace ``name`` (processes we started there), delete it."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete namespaces with our prefix whose creating process is gone."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        try:
            owner = int(name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            owner = -1
        if owner == os.getpid() or (owner > 0 and pid_alive(owner)):
            continue
        delete_namespace(name)
        removed.append(name)
    return removed


class Topology:
    """A hub namespace with a bridge and ``n`` rank namespaces wired to it.

    Rank ``r`` lives in ``self.ns[r]`` with interface ``IFNAME`` holding ``10.77.0.<r+1>/24``
    and ``fd77::<r+1>/64``. Use as a context manager: namespaces (and every process still
    running in them) are removed on exit, also after a failure half-way through setup.
    """

    def __init__(self, n: int) -> None:
        tag = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.hub = f"{tag}-hub"
        self.ns = [f"{tag}-r{r}" for r in range(n)]
        self.created: list[str] = []

    def v4(self, rank: int) -> str:
        return f"10.77.0.{rank + 1}"

    def v6(self, rank: int) -> str:
        return f"fd77::{rank + 1}"

    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_namespace(self.hub)
        ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.hub, "link", "set", BRIDGE, "up")
        for rank, ns in enumerate(self.ns):
            self._add_namespace(ns)
            port = f"hub-r{rank}"
            ip(
                "link",
                "add",
                IFNAME,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.hub,
            )
            ip("-n", self.hub, "link", "set", port, "master", BRIDGE)
            ip("-n", self.hub, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{self.v4(rank)}/24", "dev", IFNAME)
            # nodad: usable at once (duplicate address detection would hold it ~2 s)
            ip("-n", ns, "-6", "addr", "add", f"{self.v6(rank)}/64", "dev", IFNAME, "nodad")
            ip("-n", ns, "link", "set", IFNAME, "up")

    def link_down(self, rank: int) -> None:
        """Take rank ``rank``'s interface down (its peers see silence, not a reset)."""
        ip("-n", self.ns[rank], "link", "set", IFNAME, "down")

    def close(self) -> None:
        for name in reversed(self.created):
            delete_namespace(name)
        self.created.clear()
