"""Forming a group: address exchange through the store, then one link per peer pair.

Every rank first claims its rank (:mod:`aiocollect.rendezvous.claims`: atomic claims and a
per-job nonce, so two jobs on one store never mix), starts a listener, publishes a record
(address, host identity, settings, job nonce) under ``aiocollect/<name>/rank/<r>``, waits for
every other record of its job, connects to every lower rank and accepts every higher one.
Handshakes check version, group name, ranks, job nonce and the secret.

Transport per link: ``tcp`` and ``tls`` use sockets only; ``shm`` and ``auto`` listen on TCP
too, and a link between two ranks whose records show the same host (hostname and boot id)
is upgraded to shared memory during its handshake (``auto``: when both ranks allow it and
the upgrade works, else it stays on TCP; ``shm``: every link, or the group fails to form).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl as ssl_module
from dataclasses import dataclass, field
from typing import Any

from aiocollect import _protect, errors
from aiocollect._deadline import Deadline
from aiocollect.errors import RendezvousError, RendezvousTimeout
from aiocollect.rendezvous import claims
from aiocollect.rendezvous.handshake import PROTOCOL_VERSION, AcceptorHandshake, ConnectorHandshake
from aiocollect.store.base import Store
from aiocollect.tls import TLSConfig
from aiocollect.transport import memory, shm, shm_ring, tcp
from aiocollect.transport.base import Link, LinkEvents


@dataclass
class RendezvousConfig:
    name: str
    rank: int
    world_size: int
    transport: str
    host: str | None
    secret: bytes | None
    ssl: TLSConfig | None
    chunk_bytes: int
    deadline: Deadline
    #: Without a secret, accept peer links from other hosts too (else: protected mode).
    insecure: bool = False


@dataclass
class Endpoint:
    """What a rank listens on; ``close`` stops accepting."""

    transport: str
    address: str
    port: int
    server: asyncio.Server | None = None
    links: dict[int, Link] = field(default_factory=dict)
    #: Accepted connections still in their handshake (strangers, once rendezvous is over).
    handshaking: set[tcp.TcpLink] = field(default_factory=set)
    #: This rank's claim in the group (released when the group closes).
    claim: claims.Claim | None = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in list(self.handshaking):  # asyncio.Server.close() leaves them open
            link.abort()
        self.handshaking.clear()
        if self.transport == "memory":
            memory.unlisten(self.address)

    async def release(self) -> None:
        """Give back this rank's claim (rank 0 ends the job's epoch on the store); best
        effort, never raises."""
        if self.claim is not None:
            await self.claim.release()


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


async def rendezvous(store: Store, cfg: RendezvousConfig, events: LinkEvents,
                     max_frame: int) -> tuple[Endpoint, dict[int, Link]]:
    """Connect this rank to every other rank of the group.

    Returns:
        The listening endpoint (close it with the group) and the links by world rank.

    Raises:
        RendezvousTimeout: some ranks did not publish or connect in time (named).
        RendezvousError: inconsistent settings, refused handshakes, or this rank is
            claimed by a live process of another job on the same store (pid, host named).
        AuthenticationError: a peer could not prove the secret to us or we to it.
        StoreError: the store failed.
    """
    links: dict[int, Link] = {}
    arrived: asyncio.Event = asyncio.Event()
    expected = cfg.world_size - 1

    def admit(peer: int) -> str | None:
        if peer <= cfg.rank:
            return f"rank {peer} must accept, not connect to, rank {cfg.rank}"
        if peer in links:
            return f"rank {peer} is already connected"
        return None

    def on_link(link: Link) -> None:
        links[link.peer] = link
        if len(links) == expected:
            arrived.set()

    claim = await claims.claim(store, cfg.name, cfg.rank, cfg.world_size, cfg.deadline)

    def acceptor() -> AcceptorHandshake:
        return AcceptorHandshake(cfg.name, cfg.rank, cfg.world_size, cfg.secret, admit,
                                 job=claim.job)

    policy = shm.ShmPolicy()
    try:
        endpoint = await _listen(cfg, events, max_frame, acceptor, on_link, policy)
    except BaseException as exc:
        await claim.release(f"rendezvous failed on rank 0: {exc!r}")
        raise
    endpoint.claim = claim
    try:
        record = {"v": PROTOCOL_VERSION, "rank": cfg.rank, "world_size": cfg.world_size,
                  "transport": cfg_transport_family(cfg.transport), "shm": shm_mode(cfg),
                  "address": endpoint.address,
                  "port": endpoint.port, "hostname": socket.gethostname(),
                  "boot_id": boot_id(), "pid": os.getpid(), "chunk_bytes": cfg.chunk_bytes}
        await claim.publish(record)
        peers = await _read_records(claim, cfg)
        local = sum(1 for rec in peers.values() if same_host(rec))
        policy.spin = shm.spin_budget(local)
        policy.capacity = shm_ring.configured_capacity(local)
        if expected == 0:
            arrived.set()
        connects = [asyncio.ensure_future(_connect(cfg, peers[r], events, max_frame, policy,
                                                   claim.job))
                    for r in range(cfg.rank)]
        try:
            remaining = cfg.deadline.remaining()
            async with asyncio.timeout(remaining):
                for fut in connects:
                    on_link(await fut)
                await arrived.wait()
        except TimeoutError:
            missing = [r for r in range(cfg.world_size) if r != cfg.rank and r not in links]
            raise RendezvousTimeout(
                f"rank {cfg.rank}: no link from ranks {missing} of group {cfg.name!r} "
                f"before the deadline", missing) from None
        finally:
            for fut in connects:
                fut.cancel()
    except BaseException as exc:
        endpoint.close()
        for link in links.values():
            link.abort()
        await claim.release(f"rendezvous failed on rank 0: {exc!r}")
        raise
    endpoint.close()  # every peer is linked: accept nobody else
    return endpoint, links


#: Records are checked one by one as they arrive, in rank order (waits cut in slices of this
#: many seconds to notice a job rank 0 ended), before the wait for all of them: a rank whose
#: settings differ (world size above all) then fails every rank at once, instead of leaving
#: a rank waiting for a rank number that will never come.
EARLY_CHECK_SLICE = 1.0


async def _check_early(claim: claims.Claim, cfg: RendezvousConfig) -> None:
    """Check the other ranks' records as they arrive, lowest rank first. Returns early
    when the job ended (rank 0 gave up) or at the deadline: ``claim.wait_records`` then
    raises saying so."""
    store, keys = claim.store, claim.keys
    for r in range(cfg.world_size):
        if r == cfg.rank:
            continue
        while True:
            remaining = cfg.deadline.remaining()
            if remaining is not None and remaining <= 0:
                return
            slice_ = EARLY_CHECK_SLICE if remaining is None else min(EARLY_CHECK_SLICE,
                                                                      remaining)
            try:
                await store.wait([keys.job(claim.job, "here", r)], timeout=slice_)
                break
            except errors.StoreTimeout:
                if (await store.check([keys.done(claim.epoch)]))[0]:
                    return
        rec = await claim.read_record(r)
        try:
            _check_settings(cfg, r, rec)
        except RendezvousError:
            if cfg.rank == 0:
                # Giving up ends the job for the ranks that claimed; one that claims later
                # waits for a new job instead (a restart): let the others arrive first.
                theirs = rec.get("world_size") if isinstance(rec, dict) else None
                n = max(cfg.world_size, theirs if isinstance(theirs, int) else 0)
                with contextlib.suppress(errors.StoreTimeout):
                    await store.wait([keys.job(claim.job, "here", q) for q in range(n)],
                                     timeout=min(EARLY_CHECK_SLICE * 2,
                                                 cfg.deadline.remaining() or 2.0))
            raise


def _check_settings(cfg: RendezvousConfig, r: int, rec: dict[str, Any]) -> None:
    try:
        bad = [k for k in ("world_size", "chunk_bytes", "v")
               if rec[k] != {"world_size": cfg.world_size, "chunk_bytes": cfg.chunk_bytes,
                             "v": PROTOCOL_VERSION}[k]]
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousError(f"malformed rendezvous record for rank {r}: {exc}") from None
    if bad:
        raise RendezvousError(
            f"rank {r} joined group {cfg.name!r} with "
            + ", ".join(f"{k}={rec[k]!r}" for k in bad)
            + f" but rank {cfg.rank} has world_size={cfg.world_size}, "
            f"chunk_bytes={cfg.chunk_bytes}, protocol {PROTOCOL_VERSION}")


async def _read_records(claim: claims.Claim,
                        cfg: RendezvousConfig) -> dict[int, dict[str, Any]]:
    await _check_early(claim, cfg)
    await claim.wait_records(cfg.deadline)
    peers: dict[int, dict[str, Any]] = {}
    for r in range(cfg.world_size):
        rec = await claim.read_record(r)
        peers[r] = rec
        _check_settings(cfg, r, rec)
        if rec["transport"] != cfg_transport_family(cfg.transport):
            raise RendezvousError(
                f"rank {r} uses transport {rec['transport']!r}, rank {cfg.rank} uses "
                f"{cfg_transport_family(cfg.transport)!r}")
    if cfg.transport == "shm":
        _check_shm_peers(cfg, peers)
    return peers


def cfg_transport_family(transport: str) -> str:
    """What the listener speaks: ``auto`` and ``shm`` links start as TCP connections."""
    return "tcp" if transport in ("auto", "shm") else transport


def shm_mode(cfg: RendezvousConfig) -> str:
    """``force`` (transport shm), ``auto`` (transport auto, shared memory works here) or
    ``off``."""
    if cfg.transport == "shm":
        return "force"
    if cfg.transport == "auto" and shm_ring.unavailable() is None:
        return "auto"
    return "off"


def same_host(rec: dict[str, Any]) -> bool:
    """Whether a rendezvous record comes from this machine (same hostname and boot id)."""
    mine = boot_id()
    return bool(mine) and rec.get("boot_id") == mine and rec.get("hostname") == \
        socket.gethostname()


def _check_shm_peers(cfg: RendezvousConfig, peers: dict[int, dict[str, Any]]) -> None:
    reason = shm_ring.unavailable()
    if reason is not None:
        raise RendezvousError(f"rank {cfg.rank}: transport='shm' is unavailable: {reason}")
    for r, rec in peers.items():
        if r == cfg.rank:
            continue
        if not same_host(rec):
            raise RendezvousError(
                f"transport='shm' needs every rank on one host: rank {r} runs on "
                f"{rec.get('hostname')!r} (boot id {rec.get('boot_id')!r}), rank {cfg.rank} "
                f"on {socket.gethostname()!r} (boot id {boot_id()!r}); use transport='auto'")
        if rec.get("shm", "off") == "off":
            raise RendezvousError(
                f"rank {r} does not use shared memory but rank {cfg.rank} has "
                f"transport='shm'; give every rank the same transport")


async def _listen(cfg: RendezvousConfig, events: LinkEvents, max_frame: int,
                  acceptor: Any, on_link: Any, policy: shm.ShmPolicy) -> Endpoint:
    if cfg.transport == "memory":
        address = memory.listen(
            lambda: memory.MemoryLink(events, max_frame, acceptor()), on_link)
        return Endpoint("memory", address, 0)
    host = cfg.host or "127.0.0.1"
    mode = shm_mode(cfg)

    handshaking: set[tcp.TcpLink] = set()

    def make_link() -> tcp.TcpLink:
        link = (tcp.TcpLink(events, max_frame, acceptor()) if mode == "off" else
                shm.ShmLink(events, max_frame, acceptor(), role="acceptor",
                            required=mode == "force", policy=policy))
        handshaking.add(link)
        link.ready.add_done_callback(lambda _: handshaking.discard(link))
        return link

    server = await tcp.listen(host, 0, make_link, on_link, ssl=_server_ssl(cfg),
                              screen=_protected_screen(cfg))
    port = server.sockets[0].getsockname()[1]
    return Endpoint(cfg.transport, host, port, server, handshaking=handshaking)


def _protected_screen(cfg: RendezvousConfig) -> tcp.Screen | None:
    """Protected mode (:mod:`aiocollect._protect`): with no secret and not ``insecure``,
    a connection from another host is sent a rejection saying how to set a secret."""
    if cfg.secret is not None or cfg.insecure:
        return None
    what = f"rank {cfg.rank} of group {cfg.name!r}"
    log = logging.getLogger("aiocollect.rendezvous")

    def screen(peername: Any, sockname: Any) -> dict[str, Any] | None:
        if _protect.is_local(peername, sockname):
            return None
        _protect.log_refusal(log, what, peername)
        return {"t": "reject", "kind": "protected", "error": _protect.refusal(what, peername)}

    return screen


def _server_ssl(cfg: RendezvousConfig) -> ssl_module.SSLContext | None:
    return cfg.ssl.server if cfg.transport == "tls" and cfg.ssl else None


def _client_ssl(cfg: RendezvousConfig) -> ssl_module.SSLContext | None:
    return cfg.ssl.client if cfg.transport == "tls" and cfg.ssl else None


async def _connect(cfg: RendezvousConfig, rec: dict[str, Any], events: LinkEvents,
                   max_frame: int, policy: shm.ShmPolicy, job: bytes) -> Link:
    peer = int(rec["rank"])
    hs = ConnectorHandshake(cfg.name, cfg.rank, peer, cfg.world_size, cfg.secret, job=job)
    if cfg.transport == "memory":
        return memory.connect(str(rec["address"]), memory.MemoryLink(events, max_frame, hs))
    mode = shm_mode(cfg)
    link: tcp.TcpLink
    if mode != "off" and rec.get("shm", "off") != "off" and same_host(rec):
        link = shm.ShmLink(events, max_frame, hs, role="connector", required=mode == "force",
                           policy=policy)
    else:
        link = tcp.TcpLink(events, max_frame, hs)
    try:
        return await tcp.connect(str(rec["address"]), int(rec["port"]), link,
                                 ssl=_client_ssl(cfg))
    except OSError as exc:
        raise RendezvousError(
            f"rank {cfg.rank} could not connect to rank {peer} at "
            f"{rec['address']}:{rec['port']}: {exc}") from None
    except errors.PeerDisconnected as exc:  # closed before the handshake completed
        hint = (f" (rank {peer} may have rejected this rank's TLS certificate)"
                if cfg.transport == "tls" else "")
        raise RendezvousError(
            f"rank {cfg.rank} could not link to rank {peer} at "
            f"{rec['address']}:{rec['port']}: {exc}{hint}") from None
