"""Small socket helpers shared by the launcher, the test helpers and the benchmarks."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago: bound to port 0, then closed.

    Only for addresses that must be known before their listener starts (a store URL, a
    launcher's master port); listeners the code opens itself bind port 0 directly. When
    ``host`` is not an address of this machine, the port is free on every interface.

    Args:
        host: The address (IPv4, or IPv6 with or without brackets) to find a port on.

    Returns:
        The port number.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])
