"""Where a group's rendezvous keys live on the store, and reading the ranks' records: all
of them at once (:func:`read_all`) or those a rank needs, when it needs them
(:class:`RecordCache`). The key layout and its rules: :mod:`aiocollect.rendezvous.claims`."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Protocol, TypeVar

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
#: Record sets of recent jobs each event loop keeps for its other ranks (:func:`read_all`).
SHARED_JOBS = 4

T = TypeVar("T")


class Known(Protocol):
    """The records a rank has read (its links' dials look them up), and how it reads the
    ones it lacks."""

    def __contains__(self, rank: object) -> bool: ...

    def __getitem__(self, rank: int) -> dict[str, Any]: ...

    async def fetch(self, ranks: Iterable[int]) -> None:
        """Read the records of ``ranks`` that are not read yet.

        Raises:
            RendezvousError: a record is malformed, of another job, or not there.
            StoreError: the store failed.
        """


class Records(dict[int, dict[str, Any]]):
    """Every rank's record of one job, by rank: read-only, shared by the ranks of one
    event loop (:func:`read_all`), with what they derive from it (:meth:`derived`)."""

    def __init__(self, records: dict[int, dict[str, Any]]) -> None:
        super().__init__(records)
        self._derived: dict[Any, Any] = {}

    def derived(self, key: Any, make: Callable[[], T]) -> T:
        """``make()``, computed once for these records per ``key`` (which must name every
        input of ``make`` besides the records). ``make`` may raise; nothing is kept then."""
        if key not in self._derived:
            self._derived[key] = make()
        value: T = self._derived[key]
        return value

    async def fetch(self, ranks: Iterable[int]) -> None:
        """Nothing to read: every rank's record is here (:class:`Known`)."""


#: Per event loop: the record sets read lately, by (store data, group name, job, world size).
_shared: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[Hashable, str, bytes, int], asyncio.Task[Records]]
] = weakref.WeakKeyDictionary()


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


async def get_in_slices(
    store: Store,
    key: str,
    deadline: Deadline,
    slices: tuple[float, float],
    between: Callable[[], Awaitable[None]],
) -> bytes:
    """The value at ``key``, waited for in slices (doubling from ``slices[0]`` to
    ``slices[1]``, cut at ``deadline``); after each slice that ends without it,
    ``between()`` runs, and raises to end the wait (a job that ended, a deadline passed).

    Raises:
        Whatever ``between`` raises; StoreError: the store failed.
    """
    step = slices[0]
    while True:
        remaining = deadline.remaining()
        slice_ = step if remaining is None else min(step, max(remaining, 0.0))
        step = min(2 * step, slices[1])
        try:
            return await store.get(key, timeout=slice_)
        except errors.StoreTimeout:
            pass
        await between()


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
) -> Records:
    """Every rank's record of job ``job`` (once every rank has published: records never
    change then), read with ``multi_get`` in batches of :data:`RECORD_BATCH` by the first
    rank of this event loop that asks, and shared with its other ranks of the job whose
    stores read the same data (``Store.shared_reads``; a process hosting R ranks of an
    N-rank group reads N records, not R x N; the last ``SHARED_JOBS`` jobs are kept). A
    rank whose shared read failed reads on its own.

    Raises:
        RendezvousError: a record is malformed, of another job, or not there before the
            deadline.
    """
    shared = store.shared_reads
    if shared is None:  # (a view of its own: a fault proxy's rewritten records)
        return await _read_all(store, keys, name, job, world_size, deadline)
    loop = asyncio.get_running_loop()
    jobs = _shared.setdefault(loop, {})
    key = (shared, name, job, world_size)
    task = jobs.get(key)
    if task is None:
        task = jobs[key] = loop.create_task(_read_all(store, keys, name, job, world_size, deadline))
        while len(jobs) > SHARED_JOBS:
            del jobs[next(iter(jobs))]
    try:
        read = await asyncio.shield(task)
        cache_for(store, keys, name, job, world_size).records.update(read)
        return read
    except (RendezvousError, errors.StoreError):
        if jobs.get(key) is task:
            del jobs[key]  # (another rank's deadline or store: not necessarily this one's)
        if task.done() and not task.cancelled():
            return await _read_all(store, keys, name, job, world_size, deadline)
        raise


async def _read_all(
    store: Store, keys: Keys, name: str, job: bytes, world_size: int, deadline: Deadline
) -> Records:
    """:func:`read_all`'s read, by this rank alone."""
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
    return Records(records)


class RecordCache:
    """The records of one job that the ranks of one event loop have read, each read once
    (ranks whose stores read the same data, ``Store.shared_reads``, share one cache): a
    rank asks for those it needs (:meth:`fetch`), and every record asked for in one turn
    of the event loop, by any of its ranks, is read in one ``multi_get`` (per
    :data:`RECORD_BATCH`), so the peers of one ``alltoall`` cost one request, not one each.
    """

    def __init__(self, keys: Keys, name: str, job: bytes) -> None:
        self.keys, self.name, self.job = keys, name, job
        #: Ranks of the job on this event loop that came to read (:func:`cache_for`'s
        #: callers count themselves in).
        self.ranks = 0
        #: The records read, by rank.
        self.records: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._batch: list[int] = []
        self._store: Store | None = None  # (the store of the batch's first asker)
        self._reads: set[asyncio.Task[None]] = set()

    async def fetch(self, store: Store, ranks: Iterable[int]) -> None:
        """Read the records of ``ranks`` not read yet (through ``store`` when this call
        starts the turn's batch), waiting for those under way.

        Raises:
            RendezvousError: a record is malformed, of another job, or not there within
                ``RECORD_GRACE`` (the ranks' ``ready`` key says they all are).
            StoreError: the store failed.
        """
        waits: list[asyncio.Future[dict[str, Any]]] = []
        for r in ranks:
            if r in self.records:
                continue
            fut = self._pending.get(r)
            if fut is None:
                fut = self._pending[r] = asyncio.get_running_loop().create_future()
                fut.add_done_callback(_retrieve)
                if not self._batch:
                    self._store = store
                    asyncio.get_running_loop().call_soon(self._read_batch)
                self._batch.append(r)
            waits.append(fut)
        if waits:
            await asyncio.wait(waits)
            for fut in waits:
                exc = fut.exception()
                if exc is not None:
                    raise exc

    def _read_batch(self) -> None:
        batch, store = self._batch, self._store
        self._batch, self._store = [], None
        assert store is not None
        task = asyncio.get_running_loop().create_task(self._read(store, batch))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def _read(self, store: Store, ranks: list[int]) -> None:
        for first in range(0, len(ranks), RECORD_BATCH):
            part = ranks[first : first + RECORD_BATCH]
            try:
                raws = await store.multi_get(
                    [self.keys.record(r) for r in part], timeout=RECORD_GRACE
                )
                found = [
                    parse(self.name, self.job, r, raw) for r, raw in zip(part, raws, strict=True)
                ]
            except errors.StoreTimeout as exc:
                gone = [int(k.rsplit("/", 1)[1]) for k in exc.keys if k.rsplit("/", 1)[1].isdigit()]
                self._fail(ranks[first:], _disappeared(self.name, min(gone, default=part[0])))
                return
            except BaseException as exc:  # (a rank whose record is asked again reads again)
                self._fail(ranks[first:], exc)
                if not isinstance(exc, Exception):
                    raise
                return
            for r, rec in zip(part, found, strict=True):
                self.records[r] = rec
                fut = self._pending.pop(r)
                if not fut.done():
                    fut.set_result(rec)

    def _fail(self, ranks: list[int], exc: BaseException) -> None:
        for r in ranks:
            fut = self._pending.pop(r, None)
            if fut is not None and not fut.done():
                fut.set_exception(
                    exc if isinstance(exc, Exception) else errors.StoreError(repr(exc))
                )


#: Per event loop: the record caches of recent jobs, keyed as ``_shared``.
_caches: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[Hashable, str, bytes, int], RecordCache]
] = weakref.WeakKeyDictionary()


def cache_for(store: Store, keys: Keys, name: str, job: bytes, world_size: int) -> RecordCache:
    """The record cache of job ``job`` that this event loop's ranks reading through
    ``store`` share (the last ``SHARED_JOBS`` jobs are kept), or a cache of its own for a
    store whose reads are its own (``shared_reads`` None)."""
    shared = store.shared_reads
    if shared is None:
        return RecordCache(keys, name, job)
    jobs = _caches.setdefault(asyncio.get_running_loop(), {})
    key = (shared, name, job, world_size)
    cache = jobs.get(key)
    if cache is None:
        cache = jobs[key] = RecordCache(keys, name, job)
        while len(jobs) > SHARED_JOBS:
            del jobs[next(iter(jobs))]
    return cache


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


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
