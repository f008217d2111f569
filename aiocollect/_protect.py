"""Protected mode, shared by the TCP store server and the peer listeners.

Without a secret nothing a connection sends can be trusted, so a server with no secret
accepts only connections that come from this host (like Redis's protected mode): the peer
address is loopback (127.0.0.0/8, ::1), or it is the very address the connection arrived
at (the kernel picks that source address only for connections made on this host, and
drops packets from outside that claim one of its own addresses). Everything else is
answered with :func:`refusal` and closed, unless the user opted out explicitly
(``insecure=True``, ``AIOCOLLECT_INSECURE=1``, ``--insecure``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping

INSECURE_ENV = "AIOCOLLECT_INSECURE"
_TRUE = ("1", "true", "yes", "on")
#: Distinct peer addresses whose refusal is logged as a warning (later ones: debug), so
#: that a stranger knocking from many addresses cannot flood the log.
_LOGGED_MAX = 32
_logged: set[str] = set()


def insecure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``AIOCOLLECT_INSECURE`` (in ``environ``, default ours) asks to accept remote
    connections without a secret (``1``, ``true``, ``yes`` or ``on``, any case)."""
    env = os.environ if environ is None else environ
    return env.get(INSECURE_ENV, "").strip().lower() in _TRUE


def _address(sockaddr: object) -> str | None:
    if isinstance(sockaddr, tuple) and sockaddr and isinstance(sockaddr[0], str):
        return sockaddr[0].split("%", 1)[0]  # drop an IPv6 zone index
    return None


def _ip(sockaddr: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address of a socket address (IPv4-mapped IPv6 as IPv4), or None."""
    text = _address(sockaddr)
    if text is None:
        return None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_local(peername: object, sockname: object) -> bool:
    """Whether a connection from ``peername`` that arrived at ``sockname`` (socket
    addresses as asyncio reports them) comes from this host. Non-IP sockets (Unix) count
    as local."""
    if _address(peername) is None:
        return not isinstance(peername, tuple)
    ip = _ip(peername)
    if ip is None:
        return False
    if ip.is_loopback:
        return True
    here = _ip(sockname)
    return here is not None and ip == here and not ip.is_unspecified


def refusal(what: str, peername: object) -> str:
    """The message a refused connection gets: why, and how to set a secret or opt out."""
    peer = _address(peername) or str(peername)
    return (
        f"{what} is in protected mode: it has no secret, so it accepts connections from "
        f"its own host only, and {peer} is not on it. Give the store and every rank the "
        "same secret (export AIOCOLLECT_SECRET=<random string> on every node, or pass "
        "secret=...; `aiocollect store` prints one to export, `aiocollect run --secret` "
        "passes one to its ranks), or, on a network you trust, opt out with "
        "AIOCOLLECT_INSECURE=1 (insecure=True, --insecure)."
    )


def log_refusal(log: logging.Logger, what: str, peername: object) -> None:
    """Log that a connection from ``peername`` was refused: a warning the first time for
    each of the first few addresses, debug afterwards."""
    peer = _address(peername) or str(peername)
    if peer not in _logged and len(_logged) < _LOGGED_MAX:
        _logged.add(peer)
        log.warning(
            "%s refused a connection from %s: no secret is set, so only this host "
            "may connect (set AIOCOLLECT_SECRET on every rank, or "
            "AIOCOLLECT_INSECURE=1 to accept anyone)",
            what,
            peer,
        )
    else:
        log.debug("%s refused a connection from %s (protected mode)", what, peer)
