"""The shared-memory upgrade of a link's handshake (sans-IO apart from creating, opening
and mapping the segment).

::

    connector -> acceptor   hello   + {shm: true}                 (after the challenge)
    acceptor -> connector   welcome + {shm: {pid, fd, token, capacity, addr}}  (created)
                         or welcome + {shm_error: "..."}          (auto: stay on TCP)
    connector -> acceptor   {t: "shm-ok", pid, addr}   segment opened, checked and mapped
                         or {t: "shm-fail", error}   (auto: both stay on TCP)

The segment is a sealed memfd (:mod:`aiocollect.transport.shm_ring`): the acceptor keeps
its descriptor ``fd`` open until ``shm-ok`` or ``shm-fail``, and the connector opens it as
``/proc/<pid>/fd/<fd>`` (a process of the same user may; the kernel's seals travel with the
file, so the connector checks them, the size and the ``token`` that the acceptor wrote into
the header and sent in the (authenticated) welcome). The segment never has a name in a
file system, so nothing can be left behind by a rank killed at any point.

``pid`` and ``addr`` (where that process maps the segment) also let each side probe
whether it can read the other's memory (:func:`aiocollect.transport.cma.probe`, reading the
segment header there); a side whose probe works marks the ring it reads as *pulls* enabled,
and the peer then sends large payloads by reference (see
:mod:`aiocollect.transport.shm_ring`). A failed probe only means ring copies: it is logged,
never fatal.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from aiocollect.errors import ProtocolError, RendezvousError
from aiocollect.transport import cma
from aiocollect.transport.base import Handshaker, Rejection
from aiocollect.transport.shm_ring import Segment

log = logging.getLogger("aiocollect.transport.shm")


class ShmSetup:
    """Wraps the peer handshake: the connector's hello asks for shared memory, the
    acceptor's welcome offers a segment, the connector answers ``shm-ok`` or ``shm-fail``.
    The link is ready (``on_message`` returns the peer) once both sides know the outcome."""

    def __init__(
        self,
        inner: Handshaker,
        activate: Callable[[Segment, int, int], None],
        role: str,
        required: bool,
        capacity: Callable[[], int],
    ) -> None:
        if role not in ("connector", "acceptor"):
            raise ValueError(f"role must be connector or acceptor, not {role!r}")
        self.inner = inner
        self.activate = activate
        self.role = role
        self.required = required
        self.capacity = capacity
        self.segment: Segment | None = None  # created, not yet handed to the link
        self.peer: int | None = None

    def start(self) -> list[dict[str, Any]]:
        return self.inner.start()

    def on_message(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        if self.role == "connector":
            return self._connector(msg)
        return self._acceptor(msg)

    def discard(self) -> None:
        """Close a segment that was created but never handed over (setup failed)."""
        segment, self.segment = self.segment, None
        if segment is not None:
            segment.close()

    def _connector(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        replies, peer = self.inner.on_message(msg)
        if msg.get("t") == "challenge":
            return [dict(r, shm=True) if r.get("t") == "hello" else r for r in replies], peer
        if peer is None:
            return replies, peer
        offer = msg.get("shm")
        if not isinstance(offer, dict):  # the acceptor is already on TCP: nothing to answer
            why = f"rank {peer} offered no shared memory" + (
                f": {msg['shm_error']}" if "shm_error" in msg else ""
            )
            if self.required:
                raise RendezvousError(why)
            log.info("link to rank %d stays on TCP: %s", peer, why)
            return replies, peer
        try:
            pid, fd, capacity, token = (offer.get(k) for k in ("pid", "fd", "capacity", "token"))
            if not (
                isinstance(pid, int)
                and isinstance(fd, int)
                and isinstance(capacity, int)
                and isinstance(token, bytes)
            ):
                raise ProtocolError(f"malformed shared-memory offer from rank {peer}")
            segment = Segment.attach(pid, fd, capacity, token)
        except (OSError, ProtocolError) as exc:
            if self.required:
                raise RendezvousError(f"no shared-memory link to rank {peer}: {exc}") from None
            log.info("link to rank %d stays on TCP: %s", peer, exc)
            return [*replies, {"t": "shm-fail", "error": str(exc)}], peer
        pid = _enable_pulls(segment, 0, offer, peer)
        self.activate(segment, 0, pid)
        return [*replies, {"t": "shm-ok", "pid": os.getpid(), "addr": segment.address}], peer

    def _acceptor(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        if self.peer is None:
            replies, peer = self.inner.on_message(msg)
            if peer is None:
                return replies, peer
            if not msg.get("shm"):
                if self.required:
                    raise _refuse(
                        RendezvousError(
                            f"rank {peer} did not ask for shared memory, which this rank "
                            "requires (transport='shm')"
                        )
                    )
                return replies, peer
            extra: dict[str, Any]
            try:
                size = self.capacity()
                self.segment = Segment.create(size)
            except OSError as exc:
                if self.required:
                    raise _refuse(
                        RendezvousError(f"cannot create a shared-memory segment: {exc}")
                    ) from None
                log.warning("cannot create a shared-memory segment: %s", exc)
                extra = {"shm_error": str(exc)}
            else:
                extra = {
                    "shm": {
                        "pid": os.getpid(),
                        "fd": self.segment.fd,
                        "token": self.segment.token,
                        "capacity": size,
                        "addr": self.segment.address,
                    }
                }
            replies = [dict(r, **extra) if r.get("t") == "welcome" else r for r in replies]
            if self.segment is None:
                return replies, peer
            self.peer = peer
            return replies, None
        kind = msg.get("t")
        segment = self.segment
        if segment is None or kind not in ("shm-ok", "shm-fail"):
            raise ProtocolError(f"expected shm-ok or shm-fail, got {kind!r}")
        self.segment = None
        if kind == "shm-ok":
            segment.handed_over()  # the connector has its own mapping now
            pid = _enable_pulls(segment, 1, msg, self.peer)
            self.activate(segment, 1, pid)
            return [], self.peer
        segment.close()
        if self.required:
            raise RendezvousError(
                f"rank {self.peer} could not map shared memory: {msg.get('error')}"
            )
        log.info("link to rank %d stays on TCP: %s", self.peer, msg.get("error"))
        return [], self.peer


def _enable_pulls(segment: Segment, rx: int, msg: dict[str, Any], peer: int | None) -> int:
    """Probe the peer's memory where it says it maps the segment; if that works, mark the
    ring this side reads (``rx``) as pulls enabled. Returns the peer's pid (0: unknown)."""
    pid, addr = msg.get("pid"), msg.get("addr")
    if not isinstance(pid, int) or not isinstance(addr, int) or pid <= 0 or addr <= 0:
        log.info("link to rank %s copies through the ring: no pid/address announced", peer)
        return 0
    why = cma.probe(pid, addr, segment.probe_bytes())
    if why is None:
        segment.rings[rx].enable_pulls()
    else:
        log.info("link to rank %s copies through the ring: %s", peer, why)
    return pid


def _refuse(error: RendezvousError) -> Rejection:
    """Refuse the connection, telling the connecting rank why."""
    return Rejection({"t": "reject", "kind": "shm", "error": str(error)}, error)
