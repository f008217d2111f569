"""The group's digest: what every rank needs from all the ranks' records, derived once.

In a group of more than :data:`DIGEST_MIN` ranks, rank 0 reads every rank's record (as
every rank of a smaller group does), runs the checks, and publishes under
``aiocollect/<name>/job/<nonce>/digest`` the outcome (or the error every rank then
raises), the host of every rank (runs of ranks on one host), the fields every record
shares, and what the group derives from all the records (the default chunk size and the
pull prediction: :mod:`aiocollect.rendezvous.chunking`). Every other rank reads the digest
and the records of only the peers it links while the group forms; a peer linked on
demand has its record read at first use (:class:`PeerRecords`). With one rank per
process, N ranks then read about N + N log N records from the store, not N² (docs/design.md,
"The rendezvous digest").

The digest belongs to one job: its key is under the job's nonce and it carries the nonce
(a digest of another job is refused), so it is never stale. A rank waiting for it fails
with RendezvousError when rank 0 ends the job or its process is seen gone (on its host),
and with RendezvousTimeout at its deadline.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from aiocollect._deadline import Deadline
from aiocollect.errors import RendezvousError, RendezvousTimeout
from aiocollect.rendezvous import chunking, records
from aiocollect.rendezvous.hosts import host_indices
from aiocollect.store.base import Store

if TYPE_CHECKING:
    from aiocollect.rendezvous.claims import Claim

#: Largest group whose ranks each read every record (no digest): up to here that costs
#: the store little, and a rank need not wait for rank 0's digest (docs/multinode.md,
#: "Forming large groups", has the measurements).
DIGEST_MIN = 16
#: Ranks of a group on one event loop (reading through stores that share their reads) from
#: which they read every record, once for all of them, rather than the digest: the store
#: then serves each record to at most one in this many ranks.
LOOP_READS_ALL = 32
#: The digest's format (a rank refuses a digest of another format).
FORMAT = 1
#: Record fields a stand-in (:class:`StandIns`) takes from its host, not from the group.
HOST_FIELDS = ("hostname", "boot_id")
#: Waits for the digest are cut into slices (growing from the first to the last) to notice
#: a rank 0 that ended the job or died meanwhile.
SLICES = (0.5, 8.0)


def used(world_size: int) -> bool:
    """Whether rank 0 of a group of ``world_size`` ranks publishes a digest (every rank of
    a job has the same world size, or the job fails before the digest is read)."""
    return world_size > DIGEST_MIN


def read_through(world_size: int, cache: records.RecordCache) -> bool:
    """Whether a rank (not rank 0) of a group of ``world_size`` ranks reads the digest,
    rather than every record: where rank 0 publishes one and fewer than
    :data:`LOOP_READS_ALL` ranks of the group share this rank's event loop and its
    reads (``cache.ranks``, counted once every rank has arrived; each rank's choice is
    its own: both ways give it the same view)."""
    return used(world_size) and cache.ranks < LOOP_READS_ALL


@dataclass(frozen=True)
class Digest:
    """What rank 0 publishes: ``error`` (the settings check failed: every rank raises it)
    or the group's host runs, shared fields and derived values."""

    job: bytes
    world_size: int
    error: str | None = None
    #: (first rank, host index) for each run of consecutive ranks on one host.
    hosts: tuple[tuple[int, int], ...] = ()
    #: The record fields (and their values) that every rank's record has alike.
    common: dict[str, Any] = field(default_factory=dict)
    #: The default chunk size the records choose, and whether they predict pulls.
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES
    pulls: bool = False

    def pack(self) -> bytes:
        """The digest's stored bytes."""
        return bytes(
            msgpack.packb(
                {
                    "format": FORMAT,
                    "job": self.job,
                    "world_size": self.world_size,
                    "error": self.error,
                    "hosts": [list(run) for run in self.hosts],
                    "common": self.common,
                    "chunk_bytes": self.chunk_bytes,
                    "pulls": self.pulls,
                },
                use_bin_type=True,
            )
        )

    @classmethod
    def unpack(cls, raw: bytes, name: str, job: bytes, world_size: int) -> Digest:
        """The digest of job ``job`` (``world_size`` ranks) from its stored bytes.

        Raises:
            RendezvousError: malformed, of another format, or of another job.
        """
        try:
            d = msgpack.unpackb(raw, raw=False)
            if d["format"] != FORMAT or d["job"] != job or d["world_size"] != world_size:
                raise RendezvousError(
                    f"the rendezvous digest of group {name!r} belongs to another job or "
                    f"format (format {d['format']!r}, world size {d['world_size']!r}): "
                    "another job on the same store?"
                )
            hosts = tuple((int(first), int(h)) for first, h in d["hosts"])
            if d["error"] is None and (not hosts or hosts[0][0] != 0):
                raise ValueError("no host runs")
            return cls(
                job,
                world_size,
                None if d["error"] is None else str(d["error"]),
                hosts,
                dict(d["common"]),
                int(d["chunk_bytes"]),
                bool(d["pulls"]),
            )
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise RendezvousError(
                f"malformed rendezvous digest of group {name!r}: {exc!r}"
            ) from None

    def host_indices(self) -> list[int]:
        """Per world rank, the index of its host (as :func:`hosts.host_indices`)."""
        out: list[int] = []
        for i, (first, h) in enumerate(self.hosts):
            end = self.hosts[i + 1][0] if i + 1 < len(self.hosts) else self.world_size
            out.extend([h] * (end - first))
        return out


def make(job: bytes, peers: records.Records, world_size: int) -> Digest:
    """The digest of the records ``peers`` (every rank's, checked)."""
    hosts = peers.derived("hosts", lambda: host_indices(peers, world_size))
    runs = tuple((r, h) for r, h in enumerate(hosts) if r == 0 or hosts[r - 1] != h)
    return Digest(
        job,
        world_size,
        hosts=runs,
        common=peers.derived("common", lambda: _common(peers.values())),
        chunk_bytes=peers.derived("chunk_bytes", lambda: chunking.group_chunk_bytes(peers)),
        pulls=peers.derived("pulls", lambda: chunking.all_pull(peers)),
    )


def _common(recs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The fields that every record of ``recs`` has, with the same value."""
    it = iter(recs)
    shared = dict(next(it, {}))
    for rec in it:
        for k in [k for k, v in shared.items() if k not in rec or rec[k] != v]:
            del shared[k]
        if not shared:
            break
    return shared


async def publish(claim: Claim, digest: Digest) -> None:
    """(Rank 0) Publish ``digest`` for the job's other ranks."""
    await claim.store.set(claim.keys.job_wide(claim.job, "digest"), digest.pack())


async def read(claim: Claim, deadline: Deadline) -> Digest:
    """(Ranks >= 1) The job's digest, waiting for rank 0 to publish it (it does once every
    rank has arrived, so it comes right after the job's ``ready`` key).

    Raises:
        RendezvousError: the digest is malformed or of another job, or rank 0 ended the
            job (its reason quoted) or exited (seen on its host) before publishing it.
        RendezvousTimeout: it did not come before ``deadline`` (naming rank 0).
    """
    store, k = claim.store, claim.keys
    who = f"rank 0 of group {claim.name!r} ({claim.holder.describe()})"

    async def between() -> None:
        if (await store.check([k.done(claim.epoch)]))[0]:
            why = (await store.get(k.done(claim.epoch), timeout=0)).decode(errors="replace")
            raise RendezvousError(
                f"rank {claim.rank}: {who} ended the job before publishing the group's "
                f"digest: {why}"
            )
        if claim.holder.alive() is False:
            raise RendezvousError(
                f"rank {claim.rank}: {who} exited before publishing the group's digest "
                "(every rank's record, checked): the group cannot form"
            )
        if deadline.expired():
            raise RendezvousTimeout(
                f"rank {claim.rank}: {who} did not publish the group's digest (every rank's "
                "record, checked) before the deadline, though every rank had arrived",
                [0],
            )

    key = k.job_wide(claim.job, "digest")
    raw = await records.get_in_slices(store, key, deadline, SLICES, between)
    return Digest.unpack(raw, claim.name, claim.job, claim.world_size)


@dataclass
class View:
    """What a rank knows of its group from the records, read in full or through the
    digest: the records it may look up (:class:`records.Known`), the group's derived
    values, the host index of every rank, and every rank's record or its stand-in (for
    ``Listener.prepare``)."""

    records: records.Known
    chunk_bytes: int
    pulls: bool
    hosts: list[int]
    stand_ins: Mapping[int, dict[str, Any]]


def of_records(peers: records.Records, world_size: int) -> View:
    """The view of a rank that read every record (``peers``, checked)."""
    return View(
        peers,
        peers.derived("chunk_bytes", lambda: chunking.group_chunk_bytes(peers)),
        peers.derived("pulls", lambda: chunking.all_pull(peers)),
        list(peers.derived("hosts", lambda: host_indices(peers, world_size))),
        peers,
    )


def of_digest(digest: Digest, known: PeerRecords) -> View:
    """The view of a rank that read ``digest`` and reads records through ``known``."""
    hosts = digest.host_indices()
    return View(
        known,
        digest.chunk_bytes,
        digest.pulls,
        hosts,
        StandIns(known, digest.common, hosts),
    )


class PeerRecords:
    """The records rank ``rank`` (whose record is ``mine``) has read, from the event
    loop's ``cache`` (:class:`records.Known`): its own, and its peers' once fetched."""

    def __init__(
        self, store: Store, cache: records.RecordCache, rank: int, mine: dict[str, Any]
    ) -> None:
        self.store, self.cache, self.rank, self.mine = store, cache, rank, mine

    def __contains__(self, rank: object) -> bool:
        return rank == self.rank or rank in self.cache.records

    def __getitem__(self, rank: int) -> dict[str, Any]:
        return self.mine if rank == self.rank else self.cache.records[rank]

    async def fetch(self, ranks: Iterable[int]) -> None:
        """Read the records of ``ranks`` not read yet (see :class:`records.Known`)."""
        await self.cache.fetch(self.store, (r for r in ranks if r != self.rank))


class StandIns(Mapping[int, dict[str, Any]]):
    """Every rank's record as a rank that read the digest knows it: the record itself
    where it was read, else a stand-in with the fields every record shares and its
    host's identity (this rank's for the ranks on its host; none for the others)."""

    def __init__(self, known: PeerRecords, common: dict[str, Any], hosts: list[int]) -> None:
        self.known, self.hosts = known, hosts
        mine = known.mine
        self.here = {**common, **{f: mine.get(f) for f in HOST_FIELDS}}
        self.elsewhere = {
            **{k: v for k, v in common.items() if k not in HOST_FIELDS},
            "boot_id": "",
        }

    def __getitem__(self, rank: int) -> dict[str, Any]:
        if rank in self.known:
            return self.known[rank]
        if not 0 <= rank < len(self.hosts):
            raise KeyError(rank)
        return self.here if self.hosts[rank] == self.hosts[self.known.rank] else self.elsewhere

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.hosts)))

    def __len__(self) -> int:
        return len(self.hosts)
