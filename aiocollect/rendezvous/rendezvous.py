"""Forming a group: address exchange through the store, then one link per peer pair.

Every rank first claims its rank (:mod:`aiocollect.rendezvous.claims`: atomic claims and a
per-job nonce, so two jobs on one store never mix), starts a listener, publishes a record
(address, host identity, settings, job nonce) under ``aiocollect/<name>/rank/<r>``, compares
its settings with rank 0's record, waits until every rank of its job has published (one
key, set by the last to arrive), reads the records in batches with ``multi_get`` (in a
group of more than 16 ranks, rank 0 publishes a digest of them that the others read with
the records of the peers they link: :mod:`aiocollect.rendezvous.digest`), connects to the
lower ranks it links and accepts the higher ones. Handshakes check version, group name,
ranks, job nonce and the secret. A rank makes a fixed number of store requests however
large the group (docs/multinode.md, "Forming large groups").

Rendezvous never names a transport: ``cfg.transport`` is looked up in
:mod:`aiocollect.transport.registry`, whose listener publishes its part of the record
(opaque here, but for its ``"transport"`` field: ranks whose listeners speak different
things cannot link) and makes the links (docs/design.md, "Transports").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from aiocollect import _fdlimit, _protect
from aiocollect._deadline import Deadline
from aiocollect.errors import RendezvousError, RendezvousTimeout
from aiocollect.rendezvous import chunking, claims, digest, records
from aiocollect.rendezvous.handshake import PROTOCOL_VERSION, AcceptorHandshake
from aiocollect.rendezvous.ondemand import Dialer
from aiocollect.store.base import Store
from aiocollect.tls import TLSConfig
from aiocollect.transport import host, registry
from aiocollect.transport.base import Link, LinkEvents
from aiocollect.transport.interface import LinkSetup, Listener, Record, Screen

#: Seconds a rank waits for its links before it also watches for another rank's report
#: that linking failed (one store request, made only by groups slower than this).
WATCH_AFTER = 1.0
#: Most ranks a rank 0 that gives up waits for when a record names a larger world size (a
#: record is another process's word: it bounds the wait, not the memory it may take).
MAX_LINGER_RANKS = 1 << 16


@dataclass
class RendezvousConfig:
    name: str
    rank: int
    world_size: int
    transport: str
    host: str | None
    secret: bytes | None
    ssl: TLSConfig | None
    #: The chunk size this rank was given, or 0 for the default (chosen from every
    #: rank's record: :mod:`aiocollect.rendezvous.chunking`).
    chunk_bytes: int
    deadline: Deadline
    #: Without a secret, accept peer links from other hosts too (else: protected mode).
    insecure: bool = False
    #: The world ranks to link while the group forms (the others link on demand), or None
    #: for every rank (the full mesh).
    eager: frozenset[int] | None = None

    @property
    def links(self) -> str:
        """``"eager"`` (every pair linked as the group forms) or ``"lazy"``: every rank of
        a group must link the same way (checked against rank 0's record)."""
        return "eager" if self.eager is None else "lazy"


@dataclass
class Endpoint:
    """What a rank listens on; ``close`` stops accepting."""

    listener: Listener
    links: dict[int, Link] = field(default_factory=dict)
    #: This rank's claim in the group (released when the group closes).
    claim: claims.Claim | None = None
    #: The group's chunk size (the configured one, or the default the records chose).
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES
    #: Whether the records predict that every rank reads every other's memory
    #: (:func:`~aiocollect.rendezvous.chunking.all_pull`).
    pulls: bool = False
    #: Per world rank, the index of its host (:func:`~aiocollect.rendezvous.hosts.host_indices`).
    hosts: list[int] = field(default_factory=list)
    #: This rank's links, made and to make (None until the rendezvous made it).
    dialer: Dialer | None = None

    def close(self) -> None:
        """Stop accepting and connecting."""
        if self.dialer is not None:
            self.dialer.refuse("the group is closed")
        self.listener.close()

    def close_once_linked(self) -> None:
        """Every peer is linked: :meth:`close`, unless the links may take small-frame lanes
        (``"lanes": 2`` in the listener's record): those are dialed through the listener
        whenever a link first carries bulk, so it stays open with the group."""
        if self.listener.record.get("lanes") != 2:
            self.close()

    async def release(self) -> None:
        """Give back this rank's claim (rank 0 ends the job's epoch on the store); best
        effort, never raises."""
        if self.claim is not None:
            await self.claim.release()


async def rendezvous(
    store: Store, cfg: RendezvousConfig, events: LinkEvents, max_frame: int
) -> tuple[Endpoint, dict[int, Link]]:
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
    transport = registry.get(cfg.transport)
    if transport is None:
        raise RendezvousError(
            f"no transport named {cfg.transport!r} is registered "
            f"(registered: {', '.join(registry.names())})"
        )
    others = set(range(cfg.world_size)) - {cfg.rank}
    # In-process links cost no descriptor: those groups link every pair at once.
    wanted = others if cfg.eager is None or transport.in_process else set(cfg.eager) & others
    formed: set[int] = set()

    def deliver(link: Link) -> None:
        links[link.peer] = link
        if link.peer in wanted:
            formed.add(link.peer)
            if len(formed) == len(wanted):
                arrived.set()

    claim = await claims.claim(store, cfg.name, cfg.rank, cfg.world_size, cfg.deadline)
    reserved = 0  # links counted by _fdlimit.reserve until they are made
    dialer = Dialer(cfg.rank, cfg.world_size, cfg.name, cfg.secret, claim.job, deliver)

    def acceptor() -> AcceptorHandshake:
        return AcceptorHandshake(
            cfg.name,
            cfg.rank,
            cfg.world_size,
            cfg.secret,
            dialer.admit,
            job=claim.job,
            admit_lane=dialer.admit_lane,
        )

    setup = LinkSetup(
        rank=cfg.rank,
        events=events,
        max_frame=max_frame,
        host=cfg.host or "127.0.0.1",
        acceptor=acceptor,
        on_link=dialer.on_link,
        tls=cfg.ssl,
        screen=_protected_screen(cfg),
        backlog=max(100, cfg.world_size),
    )
    try:
        endpoint = Endpoint(await transport.listen(setup))
    except BaseException as exc:
        await claim.release(f"rendezvous failed on rank 0: {exc!r}")
        raise
    endpoint.claim = claim
    endpoint.dialer = dialer
    try:
        record = {
            "v": PROTOCOL_VERSION,
            "rank": cfg.rank,
            "world_size": cfg.world_size,
            **endpoint.listener.record,
            **host.identity(),
            "pid": os.getpid(),
            "chunk_bytes": cfg.chunk_bytes,
            "links": cfg.links,
        }
        # (the ranks of one process form at once: each counts the others' links too)
        # (in-process links hold no descriptor)
        linking = 0 if transport.in_process else len(wanted)
        short = _fdlimit.reserve(linking)  # (a lane only where one is to spare)
        if short is not None:  # every rank of the job learns it (not only this one)
            why = _fdlimit.links_exhausted(cfg.rank, 0, short)
            await claim.refuse(why)
            raise RendezvousError(why)
        reserved = linking
        await claim.publish(record, cfg.deadline)
        view = await _read_records(claim, cfg, record, endpoint.listener, wanted)
        endpoint.chunk_bytes = cfg.chunk_bytes or view.chunk_bytes
        endpoint.pulls, endpoint.hosts = view.pulls, view.hosts
        dialer.listener, dialer.records = endpoint.listener, view.records
        if len(formed) == len(wanted):
            arrived.set()
        # the higher rank of a pair connects (the lower one accepts), as on demand
        connects = [dialer.start(r, cfg.deadline) for r in sorted(wanted) if r < cfg.rank]
        try:
            await _linked(claim, cfg, connects, arrived)
        except TimeoutError:
            missing = sorted(wanted - formed)
            raise RendezvousTimeout(
                f"rank {cfg.rank}: no link from ranks {missing} of group {cfg.name!r} "
                f"before the deadline",
                missing,
            ) from None
        except RendezvousError as exc:
            # out of descriptors: tell every rank of the job (the others wait for a peer
            # that cannot link, else until the deadline)
            if _fdlimit.EXHAUSTED in str(exc) and not getattr(exc, "from_store", False):
                with contextlib.suppress(Exception):
                    await claim.fail(str(exc))
            raise
        _fdlimit.release(reserved)
        reserved = 0
        await claim.check_conflict()  # another job's rank lost its claim to ours?
    except BaseException as exc:
        _fdlimit.release(reserved)
        dialer.refuse(f"the rendezvous failed: {exc!r}")
        endpoint.close()
        for link in links.values():
            link.abort()
        await claim.release(f"rendezvous failed on rank 0: {exc!r}")
        raise
    if wanted == others:
        # every peer is linked: accept nobody else (but lanes, where links take them)
        endpoint.close_once_linked()
    return endpoint, links


async def _linked(
    claim: claims.Claim,
    cfg: RendezvousConfig,
    connects: list[asyncio.Future[Link]],
    arrived: asyncio.Event,
) -> None:
    """Wait until this rank's connects are done and every link it wants has arrived.
    After ``WATCH_AFTER`` seconds, also wait for a rank of the job to report that it
    failed to link (``claim.fail``): each rank then fails within moments of the first,
    instead of at the deadline.

    Raises:
        TimeoutError: the deadline passed first.
        RendezvousError: a connect failed, or a rank reported its failure (the error then
            has ``from_store`` set).
    """

    async def links() -> None:
        for fut in connects:
            await fut
        await arrived.wait()

    async with asyncio.timeout(cfg.deadline.remaining()):
        done = asyncio.ensure_future(links())
        try:
            await asyncio.wait([done], timeout=WATCH_AFTER)
            if not done.done():
                watch = asyncio.ensure_future(claim.failed(cfg.deadline))
                try:
                    await asyncio.wait([done, watch], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                if not done.done() and not watch.cancelled() and watch.exception() is None:
                    err = RendezvousError(watch.result())
                    err.from_store = True  # type: ignore[attr-defined]
                    raise err
            await done
        finally:
            done.cancel()


async def _check_first(claim: claims.Claim, cfg: RendezvousConfig, mine: Record) -> None:
    """(Ranks >= 1) Compare this rank's settings with rank 0's record, before the wait for
    every record: a rank whose settings differ (world size above all) then fails every rank
    of the job at once (``claim.refuse``), instead of leaving ranks waiting for a rank that
    will never come.

    Raises:
        RendezvousError: the settings differ (also raised on every rank waiting in
            ``claim.wait_records``), or rank 0's record is malformed.
        RendezvousTimeout: rank 0's record never came.
    """
    first = await claim.first_record(cfg.deadline)
    try:
        _check_settings(cfg, 0, first)
        _check_transport(cfg, 0, first, mine)
    except RendezvousError as exc:
        theirs = first.get("world_size")
        if isinstance(theirs, int) and cfg.rank < theirs:  # rank 0's group waits for us
            await claim.refuse(f"rank {cfg.rank} of group {cfg.name!r} refused to join: {exc}")
        raise


def _check_all(cfg: RendezvousConfig, peers: dict[int, Record], mine: Record) -> bool:
    """Check every rank's record against this rank's settings; True.

    Raises:
        RendezvousError: a rank's settings or transport differ, or a record is malformed.
    """
    for r, rec in peers.items():
        _check_settings(cfg, r, rec)
        _check_transport(cfg, r, rec, mine)
    return True


def _check_settings(cfg: RendezvousConfig, r: int, rec: dict[str, Any]) -> None:
    try:
        bad = [
            k
            for k in ("world_size", "chunk_bytes", "v", "links")
            if (rec[k] if k != "links" else rec.get(k, cfg.links))  # (absent: as ours)
            != {
                "world_size": cfg.world_size,
                "chunk_bytes": cfg.chunk_bytes,
                "v": PROTOCOL_VERSION,
                "links": cfg.links,
            }[k]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousError(f"malformed rendezvous record for rank {r}: {exc}") from None
    if bad:
        raise RendezvousError(
            f"rank {r} joined group {cfg.name!r} with "
            + ", ".join(f"{k}={_shown(k, rec[k])}" for k in bad)
            + f" but rank {cfg.rank} has world_size={cfg.world_size}, "
            f"chunk_bytes={_shown('chunk_bytes', cfg.chunk_bytes)}, links={cfg.links!r}, "
            f"protocol {PROTOCOL_VERSION}"
        )


def _shown(key: str, value: Any) -> str:
    """A setting as an error message shows it (chunk_bytes 0: the default)."""
    return "default" if key == "chunk_bytes" and value == 0 else repr(value)


async def _read_records(
    claim: claims.Claim, cfg: RendezvousConfig, mine: Record, listener: Listener, wanted: set[int]
) -> digest.View:
    """What this rank learns from the records, once all are published: every rank's
    record, checked against this rank's settings and given to ``listener.prepare``; or,
    where the group forms through a digest (ranks >= 1 of a group larger than
    ``digest.DIGEST_MIN``, with fewer than ``digest.LOOP_READS_ALL`` of its ranks on this
    event loop), rank 0's digest and the records of the ``wanted`` peers.

    Raises:
        RendezvousTimeout: some ranks never published (named), or rank 0's digest never
            came.
        RendezvousError: a rank's settings differ, a record is malformed or of another
            job, or the listener cannot link to a rank (rank 0 publishes this error in
            the digest: every rank of the group raises it).
    """
    if cfg.rank != 0:
        await _check_first(claim, cfg, mine)
    cache = records.cache_for(claim.store, claim.keys, cfg.name, claim.job, cfg.world_size)
    cache.ranks += 1
    await claim.wait_records(cfg.deadline)
    through_digest = digest.used(cfg.world_size)
    if cfg.rank != 0 and digest.read_through(cfg.world_size, cache):
        found = await digest.read(claim, cfg.deadline)
        if found.error is not None:
            raise RendezvousError(found.error)
        view = digest.of_digest(found, digest.PeerRecords(claim.store, cache, cfg.rank, mine))
        listener.prepare(view.stand_ins)
        await view.records.fetch(sorted(wanted))
        return view
    peers = await claim.read_records(cfg.deadline)
    # (the ranks of one event loop share the records: those with the same settings check
    # them once)
    settings = ("checked", cfg.world_size, cfg.chunk_bytes, cfg.links, mine["transport"])
    try:
        peers.derived(settings, lambda: _check_all(cfg, peers, mine))
    except RendezvousError as exc:
        if cfg.rank == 0:
            if through_digest:
                await _publish_failure(claim, cfg, exc)
            # ranks started with a larger world size come too: wait for them
            sizes = [rec.get("world_size") for rec in peers.values()]
            larger = max((n for n in sizes if isinstance(n, int)), default=cfg.world_size)
            await claim.linger(cfg.deadline, min(larger, MAX_LINGER_RANKS))
        raise
    if cfg.rank == 0 and through_digest:
        try:
            listener.prepare(peers)
        except RendezvousError as exc:
            await _publish_failure(claim, cfg, exc)
            raise
        await digest.publish(claim, digest.make(claim.job, peers, cfg.world_size))
    else:
        listener.prepare(peers)
    return digest.of_records(peers, cfg.world_size)


async def _publish_failure(
    claim: claims.Claim, cfg: RendezvousConfig, exc: RendezvousError
) -> None:
    """(Rank 0) Publish the digest that makes every rank of the group raise ``exc``'s
    message."""
    await digest.publish(claim, digest.Digest(claim.job, cfg.world_size, error=str(exc)))


def _check_transport(cfg: RendezvousConfig, r: int, rec: Record, mine: Record) -> None:
    """Raises: RendezvousError: rank ``r`` listens with another transport."""
    if rec.get("transport") != mine["transport"]:
        raise RendezvousError(
            f"rank {r} uses transport {rec.get('transport')!r}, rank {cfg.rank} uses "
            f"{mine['transport']!r}"
        )


def _protected_screen(cfg: RendezvousConfig) -> Screen | None:
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
