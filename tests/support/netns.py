"""Network namespaces for the multi-host tests: one namespace per rank, each joined by a veth
pair to a bridge in a hub namespace (built by :class:`aiocollect.testing.hosts.Namespaces`,
which tests/hosts uses with one namespace per host). Every interface and address lives
inside namespaces created here (10.77.0.0/24, fd77::/64); nothing is added to the root
namespace.

Names carry a prefix and the creating process id (``acnet-<pid>-<n>-...``), so leftovers
of a crashed session can be recognised and removed (:func:`remove_leftovers`).
"""

from __future__ import annotations

from aiocollect.testing import hosts

PREFIX = "acnet-"
#: The rank-side interface in every rank namespace (what AIOCOLLECT_IFNAME names).
IFNAME = "veth-x"


def unavailable() -> str | None:
    """Why namespace tests cannot run here (not root, no ``ip``, no namespaces, veths or
    bridges), or None."""
    return hosts.unavailable(uts=False)


def remove_leftovers() -> list[str]:
    """Delete namespaces with our prefix whose creating process is gone."""
    return hosts.remove_leftovers(PREFIX)


class Topology(hosts.Namespaces):
    """A hub namespace with a bridge and ``n`` rank namespaces wired to it.

    Rank ``r`` lives in ``self.ns[r]`` with interface ``IFNAME`` holding ``10.77.0.<r+1>/24``
    and ``fd77::<r+1>/64``. Use as a context manager: namespaces (and every process still
    running in them) are removed on exit, also after a failure half-way through setup.
    """

    def __init__(self, n: int) -> None:
        super().__init__(n, prefix=PREFIX, ifname=IFNAME, v4net="10.77.0", v6net="fd77", member="r")
