"""The peer-link handshake (sans-IO).

::

    acceptor -> connector   {t: "challenge", v, nonce_a}
    connector -> acceptor   {t: "hello", v, group, rank, peer, world, job, nonce_c, mac_c,
                             lane}
    acceptor -> connector   {t: "welcome", rank, mac_a}   or   {t: "reject", kind, error}
    connector -> acceptor   {t: "attached"}                 (a lane's only)

``mac_c = HMAC(secret, "connector" | nonce_c | nonce_a | context)`` and
``mac_a = HMAC(secret, "acceptor" | nonce_a | nonce_c | context)`` with the context binding
the group name, both ranks, the world size and the job nonce. Without a secret the MACs are
empty and not checked; with one, nothing but the handshake is read before both proofs pass.

``lane`` (optional, default false) says the connection is the small-frame lane of the
pair's link, which the connector made just before (transport/tcp_link.py): the acceptor
admits it with ``admit_lane`` instead of ``admit``, and it is bound into the MACs' context
(a lane's proof cannot pass for a link's, nor the reverse). A lane's handshake ends, on
the acceptor, with a fourth message: ``attached``, which the connector sends once it has
made the connection its link's lane (``tcp_link.LANE_ATTACHED``). Until then the connector
may still give the lane up (its connect timed out, its link ended) without the acceptor
having taken it: a lane the acceptor took is one its peer sends on.

``job`` is the group's job nonce (:mod:`aiocollect.rendezvous.claims`): a connection from a
rank of another job on the same store, with the same name, ranks and world size, is
refused with ``kind: "job"`` (that connection only; the acceptor's group is unaffected).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiocollect import _auth
from aiocollect.errors import AuthenticationError, ProtocolError, RendezvousError
from aiocollect.transport.base import Rejection
from aiocollect.transport.tcp_link import LANE_ATTACHED

PROTOCOL_VERSION = 1


def _context(
    group: str, connector: int, acceptor: int, world: int, job: bytes, lane: bool = False
) -> bytes:
    head = f"{group}|{connector}->{acceptor}|{world}|v{PROTOCOL_VERSION}|"
    return (head + "lane|" if lane else head).encode() + job


def _field(msg: dict[str, Any], name: str, kind: type) -> Any:
    value = msg.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ProtocolError(f"handshake field {name!r} missing or not {kind.__name__}")
    return value


class AcceptorHandshake:
    """The listening side. ``admit(rank)`` returns an error string (or the error itself)
    to refuse a rank (e.g. a duplicate connection), or None; ``admit_lane(rank)`` the same
    for the small-frame lane of the rank's link (None: lanes are refused). ``job`` is this
    group's job nonce. ``lane`` is True once a lane's hello was admitted: the handshake then
    ends when the connector's ``attached`` message arrives (module docstring)."""

    def __init__(
        self,
        group: str,
        rank: int,
        world_size: int,
        secret: bytes | None,
        admit: Callable[[int], str | RendezvousError | None],
        *,
        job: bytes = b"",
        admit_lane: Callable[[int], str | RendezvousError | None] | None = None,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.secret = secret
        self.admit = admit
        self.admit_lane = admit_lane
        self.job = job
        self.nonce = _auth.new_nonce()
        self.lane = False
        self._peer = -1  # (the lane's connector, once admitted)

    def start(self) -> list[dict[str, Any]]:
        return [{"t": "challenge", "v": PROTOCOL_VERSION, "nonce": self.nonce}]

    def _reject(self, kind: str, error: Exception) -> Rejection:
        return Rejection({"t": "reject", "kind": kind, "error": str(error)}, error)

    def on_message(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        if self.lane:
            if msg.get("t") != LANE_ATTACHED:
                raise ProtocolError(f"expected an {LANE_ATTACHED} message, got {msg.get('t')!r}")
            return [], self._peer
        if msg.get("t") != "hello":
            raise ProtocolError(f"expected a hello message, got {msg.get('t')!r}")
        nonce = _field(msg, "nonce", bytes)
        mac = _field(msg, "mac", bytes)
        peer = _field(msg, "rank", int)
        world = _field(msg, "world", int)
        job = msg.get("job", b"")
        if not isinstance(job, bytes):
            raise ProtocolError("handshake field 'job' is not bytes")
        lane = msg.get("lane", False)
        if not isinstance(lane, bool):
            raise ProtocolError("handshake field 'lane' is not a bool")
        ctx = _context(str(msg.get("group")), peer, self.rank, world, job, lane)
        if self.secret is not None and not _auth.check(
            self.secret, mac, b"connector", nonce, self.nonce, ctx
        ):
            raise self._reject(
                "auth", AuthenticationError("peer failed to prove the shared secret")
            )
        if msg.get("v") != PROTOCOL_VERSION:
            raise self._reject(
                "version",
                RendezvousError(f"protocol version {msg.get('v')!r} != {PROTOCOL_VERSION}"),
            )
        if msg.get("group") != self.group:
            raise self._reject(
                "group",
                RendezvousError(
                    f"group {msg.get('group')!r} does not match this group {self.group!r}"
                ),
            )
        if world != self.world_size:
            raise self._reject("group", RendezvousError(f"world size {world} != {self.world_size}"))
        if msg.get("peer") != self.rank:
            raise self._reject(
                "group",
                RendezvousError(
                    f"connection meant for rank {msg.get('peer')!r} reached rank {self.rank}"
                ),
            )
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise self._reject("group", RendezvousError(f"invalid peer rank {peer}"))
        if job != self.job:
            raise self._reject(
                "job",
                RendezvousError(
                    f"rank {peer} belongs to another job (job {job.hex()[:12] or 'none'}, this "
                    f"group's is {self.job.hex()[:12] or 'none'}): another job on the same store "
                    f"with group name {self.group!r}?"
                ),
            )
        admit = self.admit_lane if lane else self.admit
        refusal = "this rank takes no small-frame lanes" if admit is None else admit(peer)
        if refusal is not None:
            error = refusal if isinstance(refusal, RendezvousError) else RendezvousError(refusal)
            raise self._reject("group", error)
        self.lane = lane
        reply = {"t": "welcome", "rank": self.rank, "mac": b""}
        if self.secret is not None:
            reply["mac"] = _auth.proof(self.secret, b"acceptor", self.nonce, nonce, ctx)
        if lane:
            self._peer = peer
            return [reply], None  # (over once the connector says it attached the lane)
        return [reply], peer


class ConnectorHandshake:
    """The connecting side: rank ``rank`` connecting to rank ``peer`` (``lane``: the small-
    frame lane of the link it made just before)."""

    def __init__(
        self,
        group: str,
        rank: int,
        peer: int,
        world_size: int,
        secret: bytes | None,
        *,
        job: bytes = b"",
        lane: bool = False,
    ) -> None:
        self.group, self.rank, self.peer, self.world_size = group, rank, peer, world_size
        self.secret = secret
        self.job = job
        self.lane = lane
        self.nonce = _auth.new_nonce()
        self.peer_nonce: bytes | None = None
        self.ctx = _context(group, rank, peer, world_size, job, lane)

    def start(self) -> list[dict[str, Any]]:
        return []

    def on_message(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        kind = msg.get("t")
        if kind == "challenge" and self.peer_nonce is None:
            if msg.get("v") != PROTOCOL_VERSION:
                raise RendezvousError(
                    f"rank {self.peer} speaks protocol {msg.get('v')!r}, we speak "
                    f"{PROTOCOL_VERSION}"
                )
            self.peer_nonce = _field(msg, "nonce", bytes)
            mac = b""
            if self.secret is not None:
                mac = _auth.proof(self.secret, b"connector", self.nonce, self.peer_nonce, self.ctx)
            hello = {
                "t": "hello",
                "v": PROTOCOL_VERSION,
                "group": self.group,
                "rank": self.rank,
                "peer": self.peer,
                "world": self.world_size,
                "job": self.job,
                "nonce": self.nonce,
                "mac": mac,
            }
            if self.lane:
                hello["lane"] = True
            return [hello], None
        if kind == "reject":
            text = f"rank {self.peer} refused the link: {msg.get('error')}"
            if msg.get("kind") == "auth":
                raise AuthenticationError(text)
            raise RendezvousError(text)
        if kind == "welcome" and self.peer_nonce is not None:
            if msg.get("rank") != self.peer:
                raise RendezvousError(f"expected rank {self.peer}, reached {msg.get('rank')!r}")
            if self.secret is not None and not _auth.check(
                self.secret,
                _field(msg, "mac", bytes),
                b"acceptor",
                self.peer_nonce,
                self.nonce,
                self.ctx,
            ):
                raise AuthenticationError(f"rank {self.peer} failed to prove the shared secret")
            return [], self.peer
        raise ProtocolError(f"unexpected handshake message {kind!r}")
