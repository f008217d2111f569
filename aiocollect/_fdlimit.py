"""The process's limit on open file descriptors: raising the soft limit towards the hard one,
and the message to give when it is reached anyway.

Every peer link and every store connection holds a descriptor, and a common soft limit is
1024 (while the hard limit is often far higher): a store serving thousands of ranks, or a
process running many ranks, needs more. :func:`raise_soft_limit` is called once by
``aiocollect store`` and by ``open_group``.

A TCP link that carries bulk takes a second descriptor for its small-frame lane
(transport/tcp_link.py), but only where one is to spare (:func:`lane_fits`): the lane is
optional, so the checks before linking count one descriptor per link, and a group that
fits with one connection per link is never refused for its lanes.
"""

from __future__ import annotations

import errno
import logging
import os

try:
    import resource
except ImportError:  # not on this platform
    resource = None  # type: ignore[assignment]

log = logging.getLogger("aiocollect.fdlimit")

#: The soft limit asked for when the hard limit is unlimited.
UNLIMITED_TARGET = 1 << 20

_raised = False


def limits() -> tuple[int, int] | None:
    """``(soft, hard)`` RLIMIT_NOFILE of this process (``-1``: unlimited), or None where
    there is no such limit."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def raise_soft_limit() -> int | None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (the first call only;
    later calls just return the limit). Never raises: where the system refuses, the limit
    stays (logged at debug level).

    Returns:
        The soft limit now, or None where there is no such limit.
    """
    global _raised
    now = limits()
    if now is None or _raised:
        return None if now is None else now[0]
    _raised = True
    soft, hard = now
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. above fs.nr_open
            log.debug("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def exhausted(what: str) -> str:
    """The message for running out of file descriptors in ``what``: the limit and what to
    do about it."""
    now = limits()
    shown = "unknown" if now is None else f"soft {now[0]}, hard {now[1]}"
    return (
        f"{what} ran out of file descriptors (RLIMIT_NOFILE: {shown}; one per connection): "
        "raise the hard limit where the process starts (`ulimit -Hn`, `ulimit -n`, "
        "systemd's LimitNOFILE=, /etc/security/limits.conf), or connect fewer clients"
    )


#: The words of every message about running out of descriptors.
EXHAUSTED = "ran out of file descriptors"

#: Descriptors a rank keeps free beyond its links when it checks the limit before
#: linking (store connections, shared-memory segments, the event loop's own).
SPARE = 16


def open_count() -> int | None:
    """How many descriptors this process has open, or None where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


#: The environment variable that sets how many TCP connections a TCP or TLS link may hold:
#: 2 (the default: its connection and, once it carries bulk, its small-frame lane,
#: transport/tcp_link.py) or 1.
LANES_ENV = "AIOCOLLECT_TCP_LANES"


def descriptors_per_link() -> int:
    """Descriptors one link may hold: 2 where a TCP link may take its small-frame lane (the
    default), 1 with ``AIOCOLLECT_TCP_LANES=1``. Any other value than 1 counts as 2."""
    return 1 if os.environ.get(LANES_ENV, "").strip() == "1" else 2


#: Links that ranks of this process are making now (:func:`reserve`): each will hold a
#: descriptor that :func:`open_count` may not count yet.
_reserved = 0


def too_few(links: int) -> str | None:
    """Why this process cannot open ``links`` more links (a descriptor each, plus
    ``SPARE`` and the links reserved by :func:`reserve`) under its soft RLIMIT_NOFILE, or
    None where it can (or cannot tell). A small-frame lane is not counted: one is taken
    only where a descriptor is to spare (:func:`reserve_lane`).

    Args:
        links: the links about to be opened.
    """
    now, lim = open_count(), limits()
    need = _reserved + links
    if now is None or lim is None or lim[0] < 0 or now + need + SPARE <= lim[0]:
        return None
    if _reserved:
        return (
            f"{now} descriptors are open, {_reserved} more links are being made by ranks of "
            f"this process, and {links} links would need one each"
        )
    return f"{now} descriptors are open and {links} links would need one each"


def reserve(links: int) -> str | None:
    """Count ``links`` about to be made by a rank of this process (the ranks of one
    process link at once: each checks the others' links too), or say why they do not
    fit (:func:`too_few`; nothing is then counted). :func:`release` ends the count.

    Args:
        links: the links about to be made.
    """
    global _reserved
    short = too_few(links)
    if short is None:
        _reserved += links
    return short


_lanes_short_said = False


def reserve_lane() -> bool:
    """Count a TCP link's small-frame lane that a rank of this process is about to dial
    (as :func:`reserve` counts a link; :func:`release` ends the count once the dial
    ended), or, where this process has no descriptor to spare for it, say False: the
    link then keeps its one connection (said once per process, at DEBUG). Reads
    ``/proc/self/fd``: called once per link, when it first carries bulk, never per frame."""
    return _lane_room(reserve(1))


def lane_fits() -> bool:
    """Whether this process may keep a small-frame lane it just accepted (its descriptor,
    open already, is counted): ``SPARE`` descriptors are still free. (Links reserved by
    :func:`reserve` are not counted here: a rank of this process dialing a lane to another
    holds a reservation for a socket that is open by now.) Where not, the link keeps its
    one connection (said once per process, at DEBUG)."""
    now, lim = open_count(), limits()
    if now is None or lim is None or lim[0] < 0 or now + SPARE <= lim[0]:
        return True
    return _lane_room(f"{now} descriptors are open, {SPARE} are kept free")


def _lane_room(short: str | None) -> bool:
    global _lanes_short_said
    if short is None:
        return True
    if not _lanes_short_said:
        _lanes_short_said = True
        log.debug("links that carry bulk keep one connection (no small-frame lane): %s", short)
    return False


def release(links: int) -> None:
    """End the count of :func:`reserve` (the links are made, or failed)."""
    global _reserved
    _reserved = max(0, _reserved - links)


def is_exhausted(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is running out of descriptors
    (EMFILE: this process's limit; ENFILE: the system's)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def links_exhausted(rank: int, linked: int, detail: str) -> str:
    """The message for a rank that cannot open the links it needs: the limit, how many
    links it has, and what to do.

    Args:
        rank: the rank (its world rank).
        linked: the links it has open.
        detail: what ran out (``too_few``'s words, or the system's error).
    """
    now = limits()
    shown = "unknown" if now is None else f"soft {now[0]}, hard {now[1]}"
    return (
        f"rank {rank} {EXHAUSTED} with {linked} links open ({detail}; "
        f"RLIMIT_NOFILE: {shown}): raise the limit where the ranks start (`ulimit -n`, "
        "systemd's LimitNOFILE=, /etc/security/limits.conf), or open links on demand "
        "(open_group(links='lazy'), AIOCOLLECT_LINKS=lazy: about 3 log2(world_size) links "
        "per rank), or run fewer ranks per process"
    )
