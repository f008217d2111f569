"""Rank claims and the job nonce: one job at a time per group name on a store.

Two jobs started on the same store with the same group name (two ``aiocollect run`` on one
``--master-port``, a reused file store) would otherwise overwrite each other's records and
form mixed groups. Every rank therefore claims its rank atomically with the store's ``add``
(the caller whose ``add`` returns 1 holds the claim; every backend has it), and every record
and peer handshake carries the job's random nonce.

Keys, under ``P = aiocollect/<name>``::

    P/epoch                 hint: the latest epoch (ASCII decimal; readers also scan forward)
    P/claim/<e>             counter: rank 0's claim of epoch e (one epoch per job)
    P/owner/<e>             who holds epoch e: job nonce, pid, host identity (msgpack)
    P/done/<e>              epoch e is over (its rank 0 closed, or failed, or died)
    P/conflict/<e>          a rank without a job id found its rank of epoch e taken
    P/job/<nonce>/claim/<r> counter: rank r's claim in that job (r >= 1)
    P/job/<nonce>/owner/<r> who holds it
    P/job/<nonce>/here/<r>  rank r's record ``P/rank/<r>`` is published for that job
    P/job/<nonce>/arrived   counter: ranks that published their record in that job
    P/job/<nonce>/ready     set by the rank whose ``add`` made ``arrived`` the world size
                            (empty), or by a rank whose settings differ from rank 0's (why)
    P/job/<nonce>/digest    (groups of more than 16 ranks) rank 0's digest of the records
                            (:mod:`aiocollect.rendezvous.digest`)
    P/rank/<r>              rank r's rendezvous record (written once per job, read in
                            batches with ``multi_get`` once ``ready`` is set)

Store requests per rank do not grow with the world size: a rank writes its record, its
``here`` marker and one ``add``, waits for one key, and reads the records in batches of
:data:`~aiocollect.rendezvous.records.RECORD_BATCH`, or (groups of more than 16) the digest
and its peers' records (rank 0 deletes three keys per rank at close).

Rules:

- Rank 0 claims the latest epoch; if it is held, it moves to the next epoch when the holder
  is done (``P/done/<e>``) or is a dead process on this host (same hostname, boot id and pid
  namespace: the pid is gone or belongs to a newer process); else it fails with
  :class:`RendezvousError` naming the holder's pid and host.
- Ranks r >= 1 wait for the latest epoch that is not done, take its nonce and claim their
  rank within that job; a live holder of the same rank is another job: RendezvousError.
- At close (or when its rendezvous fails) rank 0 writes ``P/done/<e>`` and deletes the
  job's ``P/job/<nonce>/...`` keys; the three epoch keys stay (a store reused by many jobs
  grows by three small keys per job). A job whose rank 0 was killed leaves its epoch open:
  the next rank 0 on the same host takes it over; from another host it cannot tell a dead
  process from a live one and refuses (use another group name, or a fresh store).

What claims and nonce guarantee: a group holds one process per rank; a rank never reads a
record or opens a link of another epoch (stale records of an earlier or crashed job
included); a job that arrives while a live group holds the name fails with RendezvousError
naming the holder.

Job ids. Claims alone cannot tell which job a rank belongs to: of two jobs started
together, rank 1 of the second may join the first job's rank 0, and after that group is
done, the first job's rank 1 may form a group with the second job's rank 0 (both "succeed"
with mixed data). So every rank also carries the job id its launcher gave it, when there is
one: ``AIOCOLLECT_JOB_ID`` (``aiocollect run`` sets a fresh one per single-node launch;
set the same value on every node of a multi-node job), else torchrun's
``TORCHELASTIC_RUN_ID`` (unless it is ``none``). Rank 0 records it; a rank whose job id
differs from the one of the rank 0 holding the group refuses to join (RendezvousError).
Without a job id, the claims still make every collision that they see fail, but ranks of
two jobs started at the same moment can form groups that contain both. To make that loud,
a rank without a job id whose claim fails because its rank is taken writes
``P/conflict/<e>`` (who it is, who holds the rank), and every rank of a group whose rank 0
has no job id checks that key once its links are up (:meth:`Claim.check_conflict`): a
group the other job's ranks may have joined then fails with RendezvousError on the ranks
that see it, instead of returning a mixed result. The marker can come too late (after a
rank's check); then that rank's group may still hold ranks of both jobs.

The embedded TCP store (rank 0 hosts it; it lives as long as that rank's group) belongs to
the hosting rank's job: that rank records itself under ``aiocollect/store-host``, and a
rank with another job id refuses to use the store (RendezvousError) instead of forming a
group on a store that is about to vanish. A claim that a rank of another job made in that
store before the host could claim is taken over by the host (that job could not outlive the
store anyway); the other job's ranks then fail with RendezvousError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import msgpack

from aiocollect import errors
from aiocollect._deadline import Deadline
from aiocollect.errors import RendezvousError, RendezvousTimeout
from aiocollect.rendezvous import records
from aiocollect.rendezvous.owner import JOB_ID_ENV, Owner, job_id
from aiocollect.rendezvous.records import Keys
from aiocollect.store.base import Store

__all__ = ["JOB_ID_ENV", "Claim", "Owner", "claim", "job_id"]

log = logging.getLogger(__name__)

JOB_BYTES = 16
#: Longest wait for a claim holder's owner record (written right after its ``add``).
OWNER_GRACE = 10.0
#: Waits for peers' records are cut into slices (growing from the first to the last) to
#: notice a job that ended meanwhile.
SLICES = (1.0, 16.0)
#: Bound on the store calls of a release (it runs while closing, maybe during an abort).
RELEASE_TIMEOUT = 5.0
#: Longest wait of a rank 0 giving up for the job's other ranks (:meth:`Claim.linger`).
REFUSAL_GRACE = 2.0
#: Where the rank 0 that hosts the embedded TCP store records itself (an Owner).
HOST_KEY = "aiocollect/store-host"


def _hosts(store: Store) -> bool:
    """Whether this process hosts ``store`` (the embedded TCP store server)."""
    return getattr(store, "server", None) is not None


async def _check_host(store: Store, mine: str) -> None:
    """Raises: RendezvousError: the store is embedded in a rank of another job."""
    if not mine or _hosts(store) or not await _exists(store, HOST_KEY):
        return
    host = Owner.unpack(await store.get(HOST_KEY, timeout=0), HOST_KEY)
    if host.job_id != mine:
        raise RendezvousError(
            f"the store {store!r} is hosted by rank 0 of another job ({host.describe()}), "
            f"not by this rank's job (job id {mine!r}): another job on the same store? "
            "(give each job its own store or port)"
        )


@dataclass
class Claim:
    """This rank's claim in group ``name``: ``job`` is the nonce every record and handshake
    of the group carries; ``holder`` is rank 0's owner record."""

    store: Store
    name: str
    rank: int
    world_size: int
    epoch: int
    job: bytes
    holder: Owner
    released: bool = False
    #: Rank 0's record, once read (:meth:`first_record`).
    first: dict[str, Any] | None = None

    @property
    def keys(self) -> Keys:
        return Keys(self.name)

    async def publish(self, record: dict[str, Any], deadline: Deadline | None = None) -> None:
        """Publish this rank's rendezvous record (with the job nonce), mark it present and
        count it; the rank that makes the count the world size sets ``ready``, unless rank
        0's record (read by a rank >= 1, waiting up to ``deadline``) has another world size:
        then the ranks that disagree refuse the job instead."""
        k = self.keys
        await self.store.set(
            k.record(self.rank),
            bytes(msgpack.packb({**record, "job": self.job}, use_bin_type=True)),
        )
        await self.store.set(k.job(self.job, "here", self.rank), b"1")
        if await self.store.add(k.job_wide(self.job, "arrived"), 1) == self.world_size and (
            self.rank == 0
            or (await self.first_record(deadline or Deadline.after(None))).get("world_size")
            in (None, self.world_size)
        ):
            await self.store.set(k.job_wide(self.job, "ready"), b"")

    async def refuse(self, why: str) -> None:
        """End the wait of every rank of this job with RendezvousError(``why``): this rank's
        settings differ from rank 0's, and the job cannot form."""
        await self.store.set(self.keys.job_wide(self.job, "ready"), why.encode())

    async def fail(self, why: str) -> None:
        """Report that this rank could not link to its peers (``why``): the ranks waiting
        in :meth:`failed` get it."""
        await self.store.set(self.keys.job_wide(self.job, "failed"), why.encode())

    async def failed(self, deadline: Deadline) -> str:
        """Wait until a rank of this job reports (:meth:`fail`) that it could not link;
        returns its reason.

        Raises:
            StoreTimeout: none did before ``deadline``.
        """
        why = await self.store.get(
            self.keys.job_wide(self.job, "failed"), timeout=deadline.remaining()
        )
        return why.decode(errors="replace")

    async def first_record(self, deadline: Deadline) -> dict[str, Any]:
        """Rank 0's record of this job, waiting for it.

        Raises:
            RendezvousTimeout: it was not published in time, or rank 0 ended the job.
            RendezvousError: malformed, or (ranks >= 1) rank 0 ended the job before the
                group formed.
        """
        if self.first is None:
            await self._await(self.keys.job(self.job, "here", 0), deadline)
            self.first = await self.read_record(0)
        return self.first

    async def wait_records(self, deadline: Deadline) -> None:
        """Wait until every rank of this job has published its record (``ready``).

        Raises:
            RendezvousTimeout: some ranks did not publish in time (``missing`` names them).
            RendezvousError: a rank's settings differ from rank 0's (its message), or
                (ranks >= 1) rank 0 ended the job before the group formed.
        """
        why = await self._await(self.keys.job_wide(self.job, "ready"), deadline)
        if why:
            if self.rank == 0:
                await self.linger(deadline)
            raise RendezvousError(why.decode(errors="replace"))

    async def linger(self, deadline: Deadline, world_size: int | None = None) -> None:
        """(Rank 0, giving up because a rank's settings differ) Let the job's other ranks
        arrive, up to REFUSAL_GRACE, before the job ends: they then fail with the reason,
        where one that claimed later would wait for a new job (a restart) instead.

        Args:
            deadline: the rendezvous's deadline (the wait ends at it, if sooner).
            world_size: how many ranks to wait for, where a record said a larger world size
                than this rank's (those ranks arrive too); default this rank's.
        """
        ranks = max(self.world_size, world_size or 0)
        keys = [self.keys.job(self.job, "here", r) for r in range(ranks)]
        grace = Deadline.after(min(REFUSAL_GRACE, deadline.remaining() or REFUSAL_GRACE))
        with contextlib.suppress(errors.StoreTimeout):
            for i in range(0, len(keys), records.RECORD_BATCH):
                batch = keys[i : i + records.RECORD_BATCH]
                await self.store.wait(batch, timeout=grace.remaining())

    async def _await(self, key: str, deadline: Deadline) -> bytes:
        """The value of the job's ``key``, waiting in slices (growing from the first to the
        last of SLICES) to notice a job that ended meanwhile.

        Raises:
            RendezvousTimeout, RendezvousError: as :meth:`wait_records`.
        """

        async def between() -> None:
            ended = await _exists(self.store, self.keys.done(self.epoch))
            if not ended and not deadline.expired():
                await _check_host(self.store, job_id())
                return
            raise await self._never_formed(ended)

        return await records.get_in_slices(self.store, key, deadline, SLICES, between)

    async def _never_formed(self, ended: bool) -> RendezvousTimeout:
        """The error of a wait that ended: the ranks missing (from their ``here``
        markers), and why the job ended when rank 0 ended it.

        Raises:
            RendezvousError: (rank 0) its own claim was ended by another rank 0.
        """
        k = self.keys
        world_size = self.world_size
        keys = [k.job(self.job, "here", r) for r in range(world_size)]
        present = [
            ok
            for i in range(0, world_size, records.RECORD_BATCH)
            for ok in await self.store.check(keys[i : i + records.RECORD_BATCH])
        ]
        present[self.rank] = True
        if ended:  # rank 0 was there; at its deadline (ours too) it deleted the keys
            present[0] = True
        missing = [r for r, ok in enumerate(present) if not ok]
        msg = (
            f"rank {self.rank}: ranks {missing} of group {self.name!r} never arrived "
            f"(world size {world_size})"
        )
        if ended:
            why = (await self.store.get(k.done(self.epoch), timeout=0)).decode(errors="replace")
            if self.rank == 0:
                raise RendezvousError(
                    f"rank 0 of group {self.name!r}: its claim was "
                    f"ended before the group formed: {why}"
                )
            msg += (
                f"; rank 0 ({self.holder.describe()}) ended the job before the group formed: {why}"
            )
        return RendezvousTimeout(msg, missing)

    async def check_conflict(self) -> None:
        """At the end of rendezvous: fail if a rank of another job found its rank of this
        epoch taken (``P/conflict/<e>``), when this group has no job id to tell jobs apart.

        Raises:
            RendezvousError: such a marker is in the store (it is quoted).
        """
        key = self.keys.conflict(self.epoch)
        if self.holder.job_id or not await _exists(self.store, key):
            return
        what = (await self.store.get(key, timeout=0)).decode(errors="replace")
        raise RendezvousError(
            f"another job is using group {self.name!r} on this store ({what}): without a "
            f"job id the ranks of two jobs cannot be told apart, and this group may hold "
            f"ranks of both. Set AIOCOLLECT_JOB_ID to one value on every rank of a job (a "
            f"new one per job, e.g. $SLURM_JOB_ID), or give each job its own store, port "
            f"or group name"
        )

    async def read_record(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s record of this job.

        Raises:
            RendezvousError: malformed, missing, or it belongs to another job (the store's
                key was overwritten by a rank of another job).
        """
        return await records.read_one(self.store, self.keys, self.name, self.job, rank)

    async def read_records(self, deadline: Deadline) -> records.Records:
        """Every rank's record of this job (after :meth:`wait_records`), read in batches
        (read-only: shared by this event loop's ranks, :func:`records.read_all`).

        Raises:
            RendezvousError: a record is malformed, belongs to another job, or is not
                there before the deadline.
        """
        return await records.read_all(
            self.store, self.keys, self.name, self.job, self.world_size, deadline
        )

    async def release(self, reason: str = "closed") -> None:
        """Give the claim back (rank 0: mark the epoch done with ``reason`` and delete the
        job's keys; other ranks hold nothing to release). Best effort and idempotent: store
        failures are logged, never raised; bounded by RELEASE_TIMEOUT."""
        if self.released or self.rank != 0:
            self.released = True
            return
        self.released = True
        k = self.keys
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT):
                await self.store.set(k.done(self.epoch), reason.encode(errors="replace"))
                await self._delete_job_keys()
        except (errors.AiocollectError, TimeoutError, OSError) as exc:
            log.debug("group %r: could not release rank 0's claim: %s", self.name, exc)

    async def _delete_job_keys(self) -> None:
        k = self.keys
        await asyncio.gather(
            *(
                self.store.delete(k.job(self.job, what, r))
                for r in range(self.world_size)
                for what in ("claim", "owner", "here")
            ),
            *(self.store.delete(k.job_wide(self.job, w)) for w in ("arrived", "ready", "digest")),
        )


async def _exists(store: Store, key: str) -> bool:
    return (await store.check([key]))[0]


async def _latest(store: Store, k: Keys) -> int:
    """The latest epoch that has a claim (0 when none has)."""
    e = 0
    if await _exists(store, k.epoch):
        with contextlib.suppress(ValueError, errors.StoreTimeout):
            e = max(0, int(await store.get(k.epoch, timeout=0)))
    while await _exists(store, k.claim(e + 1)):
        e += 1
    return e


async def _owner(store: Store, key: str, deadline: Deadline, name: str, what: str) -> Owner:
    """The owner record at ``key`` (written right after its claim), waiting up to
    OWNER_GRACE.

    Raises:
        RendezvousError: it never appeared (the claimant died between claim and record).
    """
    remaining = deadline.remaining()
    grace = OWNER_GRACE if remaining is None else min(OWNER_GRACE, max(remaining, 0.1))
    try:
        raw = await store.get(key, timeout=grace)
    except errors.StoreTimeout:
        raise RendezvousError(
            f"{what} of group {name!r} is claimed, but its claimant never said who it is "
            f"(it may have died while claiming): delete the store's keys "
            f"'aiocollect/{name}/...' or use another group name"
        ) from None
    return Owner.unpack(raw, key)


async def _wait_key(
    store: Store, key: str, deadline: Deadline, rank: int, name: str, why: str = ""
) -> None:
    try:
        await store.wait([key], timeout=deadline.remaining())
    except errors.StoreTimeout:
        raise RendezvousTimeout(
            f"rank {rank}: rank 0 of group {name!r} never arrived (it claims rank 0 first; "
            f"the other ranks wait for it){why}",
            [0],
        ) from None


async def _mark_conflict(store: Store, k: Keys, e: int, rank: int, holder: Owner) -> None:
    """Without a job id, rank ``rank`` of epoch ``e`` found taken means ranks of another
    job may be joining that epoch's group: write the marker that fails it (best effort).
    A taken rank 0 is marked too: that loser is usually the first to know (its claim is the
    first), while the rank >= 1 that lost to a rank of the other job may come too late."""
    if job_id():
        return
    mark = (
        f"rank {rank}, {Owner.me(b'').describe()}, found rank {rank} of its epoch "
        f"taken by {holder.describe()}"
    )
    with contextlib.suppress(errors.AiocollectError, TimeoutError, OSError):
        async with asyncio.timeout(RELEASE_TIMEOUT):
            await store.set(k.conflict(e), mark.encode())


def _conflict(rank: int, name: str, holder: Owner) -> RendezvousError:
    return RendezvousError(
        f"rank {rank} of group {name!r} is already claimed by {holder.describe()}: another "
        f"job on the same store? (give each job its own store or port, or another group "
        f"name; if that process is gone, a claim from another host is not taken over: "
        f"use another group name or a fresh store)"
    )


async def claim(store: Store, name: str, rank: int, world_size: int, deadline: Deadline) -> Claim:
    """Claim ``rank`` of group ``name`` on ``store`` for this process (see the module
    docstring for the rules).

    Returns:
        The claim; ``release()`` it when the group closes or fails.

    Raises:
        RendezvousError: the rank is held by a live process of another job (pid and host
            named), or a claim record is malformed.
        RendezvousTimeout: (ranks >= 1) rank 0 never claimed before the deadline.
        StoreError: the store failed.

    Cancellation may leave a claim taken; it stays until its pid is seen dead.
    """
    k = Keys(name)
    if rank == 0 and _hosts(store):
        await store.set(HOST_KEY, Owner.me(b"").pack())
    await _check_host(store, job_id())
    if rank == 0:
        return await _claim_first(store, k, name, world_size, deadline)
    e = -1
    while True:
        e, holder = await _current_job(store, k, name, rank, deadline, after=e)
        me = Owner.me(holder.job)
        if me.job_id and holder.job_id != me.job_id:
            raise RendezvousError(
                f"rank 0 of group {name!r} is held by {holder.describe()}, not by this "
                f"rank's job (job id {me.job_id!r}): another job on the same store? (give "
                f"each job its own store or port, or another group name)"
            )
        n = await store.add(k.job(holder.job, "claim", rank), 1)
        if n == 1:
            await store.set(k.job(holder.job, "owner", rank), me.pack())
            if not await _exists(store, k.done(e)):
                return Claim(store, name, rank, world_size, e, holder.job, holder)
            # That job ended (and cleaned up) before we claimed: our claim is an orphan.
            for what in ("claim", "owner"):
                await store.delete(k.job(holder.job, what, rank))
            continue
        other = await _owner(
            store, k.job(holder.job, "owner", rank), deadline, name, f"rank {rank}"
        )
        if await _exists(store, k.done(e)):
            continue  # that job is over; wait for the next one
        if other.alive() is False:
            # That job lost its rank `rank`; it cannot form. Its rank 0 (or a successor that
            # takes over) ends the epoch; then look again.
            log.warning(
                "group %r: rank %d was claimed by %s, which has exited; waiting for "
                "rank 0 of its job (%s) to end it",
                name,
                rank,
                other.describe(),
                holder.describe(),
            )
            await _wait_key(
                store,
                k.claim(e + 1),
                deadline,
                rank,
                name,
                f"; the last job's rank {rank} ({other.describe()}) has exited "
                f"but its rank 0 ({holder.describe()}) did not end that job",
            )
            continue
        await _mark_conflict(store, k, e, rank, other)
        raise _conflict(rank, name, other)


async def _claim_first(
    store: Store, k: Keys, name: str, world_size: int, deadline: Deadline
) -> Claim:
    me = Owner.me(os.urandom(JOB_BYTES))
    e = await _latest(store, k)
    while True:
        if await store.add(k.claim(e), 1) == 1:
            await store.set(k.owner(e), me.pack())
            await store.set(k.epoch, str(e).encode("ascii"))
            return Claim(store, name, 0, world_size, e, me.job, me)
        holder = await _owner(store, k.owner(e), deadline, name, "rank 0")
        if await _exists(store, k.done(e)):
            e += 1
            continue
        if holder.alive() is False:
            log.warning(
                "group %r: taking over rank 0 from %s, which has exited", name, holder.describe()
            )
            await store.set(k.done(e), b"taken over by " + me.describe().encode())
            e += 1
            continue
        if _hosts(store) and me.job_id and holder.job_id != me.job_id:
            log.warning(
                "group %r: taking over rank 0 from %s of another job, in the store this rank hosts",
                name,
                holder.describe(),
            )
            await store.set(
                k.done(e),
                (
                    f"taken over by the host of this store, "
                    f"{me.describe()}: another job on the same store?"
                ).encode(),
            )
            e += 1
            continue
        await _mark_conflict(store, k, e, 0, holder)
        raise _conflict(0, name, holder)


async def _current_job(
    store: Store, k: Keys, name: str, rank: int, deadline: Deadline, after: int
) -> tuple[int, Owner]:
    """The latest epoch after ``after`` that is not done, and its holder; waits for rank 0
    to claim one.

    Raises:
        RendezvousError: the store went away while waiting, after the rank 0 that hosted
            it had ended its job (the reason it wrote is quoted): a rank that arrived after
            rank 0 gave up learns why, rather than getting ``StoreError``.
        RendezvousTimeout: no rank 0 claimed before the deadline.
        StoreError: the store failed otherwise.
    """
    ended: list[str] = []  # why the last job ended, when its rank 0 hosted the store
    try:
        return await _next_job(store, k, name, rank, deadline, after, ended)
    except errors.StoreError as exc:
        if not ended or isinstance(exc, errors.StoreTimeout):
            raise
        raise RendezvousError(ended[-1]) from exc


async def _next_job(
    store: Store, k: Keys, name: str, rank: int, deadline: Deadline, after: int, ended: list[str]
) -> tuple[int, Owner]:
    e = max(await _latest(store, k), after + 1)
    mine = job_id()
    while True:
        await _wait_key(store, k.claim(e), deadline, rank, name)
        await _check_host(store, mine)
        while await _exists(store, k.claim(e + 1)):
            e += 1
        holder = await _owner(store, k.owner(e), deadline, name, "rank 0")
        if await _exists(store, k.done(e)):
            if await _hosted_by(store, holder):
                why = (await store.get(k.done(e), timeout=0)).decode(errors="replace")
                ended.append(
                    f"rank {rank}: rank 0 of group {name!r} ({holder.describe()}), which "
                    f"hosted the store, ended its job before this rank arrived ({why}); "
                    "then its store closed (this rank started too late, or belongs to "
                    "another job on the same store?)"
                )
            e += 1
            continue
        if holder.alive() is False:
            e += 1
            continue
        return e, holder


async def _hosted_by(store: Store, owner: Owner) -> bool:
    """Whether the store is embedded in ``owner``'s process (its HOST_KEY record)."""
    if not await _exists(store, HOST_KEY):
        return False
    host = Owner.unpack(await store.get(HOST_KEY, timeout=0), HOST_KEY)
    return (host.pid, host.hostname, host.boot_id, host.pidns, host.start) == (
        owner.pid,
        owner.hostname,
        owner.boot_id,
        owner.pidns,
        owner.start,
    )
