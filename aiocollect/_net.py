"""Small socket helpers shared by the launcher, the test helpers and the benchmarks."""

from __future__ import annotations

import random
import socket

#: Where the kernel picks ports for ``bind(port 0)`` and outgoing connections (Linux's
#: ``net.ipv4.ip_local_port_range``), and the default where it cannot be read.
PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
EPHEMERAL_DEFAULT = (32768, 60999)
#: The lowest port ``free_port`` draws from, below the ephemeral range.
LOWEST_DRAWN = 10000
#: Ports drawn before ``free_port`` falls back to one the kernel picks.
DRAWS = 32


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(PORT_RANGE_FILE) as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return lo, hi


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago: bound, then closed.

    Only for addresses that must be known before their listener starts (a store URL, a
    launcher's master port); listeners the code opens itself bind port 0 directly. When
    ``host`` is not an address of this machine, the port is free on every interface.

    The port is drawn at random from below the kernel's ephemeral range, where neither a
    ``bind`` to port 0 nor an outgoing connection's source port can take it before its
    listener starts (a port the kernel picked could be handed out again at once); where no
    drawn port binds, the kernel picks one.

    Args:
        host: The address (IPv4, or IPv6 with or without brackets) to find a port on.

    Returns:
        The port number.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:  # not an address of this machine: every interface
            address = ""
    lowest_ephemeral = _ephemeral_range()[0]
    draws = DRAWS if lowest_ephemeral - LOWEST_DRAWN > DRAWS else 0
    for _ in range(draws):
        port = random.randrange(LOWEST_DRAWN, lowest_ephemeral)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
