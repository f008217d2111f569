"""Where a group's rendezvous keys live on the store, and reading the ranks' records (the
key layout and its rules: :mod:`aiocollect.rendezvous.claims`)."""

from __future__ import annotations

from typing import Any

import msgpack

from aiocollect import errors
from aiocollect._deadline import Deadline
from aiocollect.errors import RendezvousError
from aiocollect.store.base import Store

#: Most records one ``multi_get`` reads. A record is about 300 bytes, so a batch is about
#: 300 KiB, far below a TCP store frame (64 MiB).
RECORD_BATCH = 1024
#: How long a read waits for a record whose marker says it is there: an answer from a
#: store busy with thousands of ranks may take seconds, and a read with no wait at all
#: would then report the record missing.
RECORD_GRACE = 10.0


class Keys:
    """The store keys of group ``name``, all under ``aiocollect/<name>``."""

    def __init__(self, name: str) -> None:
        self.prefix = f"aiocollect/{name}"
        self.epoch = f"{self.prefix}/epoch"

    def claim(self, e: int) -> str:
        return f"{self.prefix}/claim/{e}"

    def owner(self, e: int) -> str:
        return f"{self.prefix}/owner/{e}"

    def done(self, e: int) -> str:
        return f"{self.prefix}/done/{e}"

    def conflict(self, e: int) -> str:
        return f"{self.prefix}/conflict/{e}"

    def job(self, job: bytes, what: str, rank: int) -> str:
        return f"{self.prefix}/job/{job.hex()}/{what}/{rank}"

    def job_wide(self, job: bytes, what: str) -> str:
        return f"{self.prefix}/job/{job.hex()}/{what}"

    def record(self, rank: int) -> str:
        return f"{self.prefix}/rank/{rank}"


async def read_one(store: Store, keys: Keys, name: str, job: bytes, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s record of job ``job``, which must be there (waiting up to
    RECORD_GRACE for it).

    Raises:
        RendezvousError: malformed, missing, or of another job.
    """
    try:
        raw = await store.get(keys.record(rank), timeout=RECORD_GRACE)
    except errors.StoreTimeout:
        raise _disappeared(name, rank) from None
    return parse(name, job, rank, raw)


async def read_all(
    store: Store, keys: Keys, name: str, job: bytes, world_size: int, deadline: Deadline
) -> dict[int, dict[str, Any]]:
    """Every rank's record of job ``job``, read with ``multi_get`` in batches of
    :data:`RECORD_BATCH`.

    Raises:
        RendezvousError: a record is malformed, of another job, or not there before the
            deadline.
    """
    records: dict[int, dict[str, Any]] = {}
    for first in range(0, world_size, RECORD_BATCH):
        ranks = range(first, min(first + RECORD_BATCH, world_size))
        try:
            raws = await store.multi_get(
                [keys.record(r) for r in ranks], timeout=deadline.remaining()
            )
        except errors.StoreTimeout as exc:
            gone = [int(k.rsplit("/", 1)[1]) for k in exc.keys if k.rsplit("/", 1)[1].isdigit()]
            raise _disappeared(name, min(gone, default=first)) from None
        for r, raw in zip(ranks, raws, strict=True):
            records[r] = parse(name, job, r, raw)
    return records


def parse(name: str, job: bytes, rank: int, raw: bytes) -> dict[str, Any]:
    """Rank ``rank``'s record from its stored bytes.

    Raises:
        RendezvousError: not a record, or a record of another job than ``job`` (the
            store's key was overwritten by a rank of another job).
    """
    try:
        rec = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RendezvousError(f"malformed rendezvous record for rank {rank}: {exc}") from None
    if not isinstance(rec, dict):
        raise RendezvousError(f"malformed rendezvous record for rank {rank}")
    if rec.get("job") != job:
        raise RendezvousError(
            f"the rendezvous record of rank {rank} of group {name!r} belongs to "
            f"another job (pid {rec.get('pid')} on host {rec.get('hostname')}): "
            "another job on the same store?"
        )
    return rec


def _disappeared(name: str, rank: int) -> RendezvousError:
    return RendezvousError(
        f"the rendezvous record of rank {rank} of group {name!r} disappeared from the store"
    )
