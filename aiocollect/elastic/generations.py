"""Generations of an elastic group: the settings a member keeps across them, opening its
store, ``regroup()`` and ``join_group``'s work, forming a generation (the protocol:
:mod:`aiocollect.elastic`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiocollect import errors
from aiocollect._deadline import Deadline
from aiocollect.collectives.neighbours import neighbours
from aiocollect.elastic.agreement import DECISION_GRACE, POLL, Retry, decide
from aiocollect.engine.fabric import Fabric
from aiocollect.errors import GroupBrokenError, RendezvousError, RendezvousTimeout, UsageError
from aiocollect.group import Group
from aiocollect.rendezvous import membership
from aiocollect.rendezvous.owner import Owner
from aiocollect.rendezvous.rendezvous import RendezvousConfig, rendezvous
from aiocollect.store import Store, open_store
from aiocollect.tls import TLSConfig
from aiocollect.transport.wire import WORLD_GID

log = logging.getLogger("aiocollect.elastic")

#: Seconds at most to reach a TCP store (it must already run: nobody hosts one).
STORE_CONNECT = 10.0
_ALTERNATIVES = (
    "run a standalone store (`aiocollect store`, then tcp://HOST:PORT), or use "
    "redis://HOST:PORT/DB or file:///shared/dir"
)


@dataclass
class Shared:
    """What every generation of one member shares: the store and who closes it."""

    store: Store
    owned: bool
    current: Group | None = None
    store_closed: bool = False

    async def close_store(self, group: Group) -> None:
        """Close the store if this member opened it and ``group`` is the current
        generation (a closer of every generation; only the last one's closes it).

        Args:
            group: the generation closing.

        Raises:
            StoreError: the store failed while closing.
        """
        if self.owned and self.current is group and not self.store_closed:
            self.store_closed = True
            await self.store.close()


def _nothing() -> None:
    pass


@dataclass
class ElasticState:
    """The settings a member keeps across generations (``group._elastic``)."""

    shared: Shared
    name: str
    transport: str
    secret: bytes | None
    host: str
    tls: TLSConfig | None
    insecure: bool
    chunk_bytes: int
    timeout: float | None
    generation: int = 0
    owners: dict[int, Owner] = field(default_factory=dict)
    #: Ends the old generation (set while a regroup runs; idempotent).
    end_old: Callable[[], None] = _nothing
    #: Whether each generation links its algorithms' neighbours first and the other
    #: peers on demand (``open_group(links="lazy")``), or every pair at once.
    lazy: bool = True

    @property
    def prefix(self) -> str:
        """Where the group's membership records live on the store."""
        return f"aiocollect/{self.name}/elastic"

    async def regroup(self, group: Group, *, min_size: int, timeout: float | None) -> Group:
        """:meth:`Group.regroup` (the group delegates here: it does not import this
        module).

        Args:
            group: the current generation's world group.
            min_size: the fewest members the next generation may have.
            timeout: seconds to wait for the members (None: the group's).

        Returns:
            The next generation's world group.

        Raises:
            UsageError: not the current generation's world group, or bad arguments.
            RendezvousError: fewer than ``min_size`` members, or this rank was left out.
            StoreError: the store failed.
        """
        return await regroup(group, min_size=min_size, timeout=timeout)

    async def joiners(self, group: Group) -> int:
        """:meth:`Group.joiners`.

        Args:
            group: a group of this elastic job.

        Returns:
            How many processes wait in ``join_group``.

        Raises:
            StoreError: the store failed.
        """
        return await joiners(group)


async def open_elastic_store(
    spec: Store | str, *, secret: bytes | None, insecure: bool, timeout: float | None
) -> tuple[Store, bool]:
    """Open the store of an elastic group: one that outlives every member.

    Args:
        spec: a Store, or its URL (``tcp://`` of a standalone store, ``redis://``,
            ``file://``, ``memory://``).
        secret: the shared secret, or None.
        insecure: without a secret, accept a store on another host.
        timeout: the store's default timeout in seconds (None: 300 s); a TCP store must
            answer within ``STORE_CONNECT`` of it.

    Returns:
        The store, and whether this member opened it (and so closes it).

    Raises:
        UsageError: the store is (or would be) embedded in a member; the message names the
            alternatives.
        StoreError: the store could not be reached.
        AuthenticationError: the store refused the secret.
    """
    if isinstance(spec, Store):
        if getattr(spec, "server", None) is not None:
            raise UsageError(
                "elastic groups cannot use a store embedded in a member (it "
                f"dies with that member): {_ALTERNATIVES}"
            )
        return spec, False
    full = 300.0 if timeout is None else timeout
    if isinstance(spec, str) and spec.lower().startswith("tcp://"):
        try:  # rank=1: never host the embedded server
            store, owned = await open_store(
                spec, rank=1, secret=secret, insecure=insecure, timeout=min(STORE_CONNECT, full)
            )
        except errors.StoreTimeout:
            raise UsageError(
                f"elastic groups refuse the embedded store (rank 0 may die) and nothing "
                f"serves {spec}: {_ALTERNATIVES}"
            ) from None
        store.timeout = full
        return store, owned
    return await open_store(spec, rank=1, secret=secret, insecure=insecure, timeout=full)


async def start(group: Group, state: ElasticState) -> Group:
    """Make ``group`` (generation ``state.generation``, just formed) elastic: remember the
    settings and publish who holds each rank (peers use it to tell the dead).

    Args:
        group: the generation's world group.
        state: the member's elastic settings.

    Returns:
        ``group``.

    Raises:
        StoreError: the store failed.
    """
    group.attach_elastic(state)
    state.shared.current = group
    group.add_closer(lambda: state.shared.close_store(group))
    key = f"{state.prefix}/g{state.generation}/owner/{group.rank}"
    await state.shared.store.set(key, Owner.me(b"").pack())
    return group


async def _form(
    state: ElasticState,
    gen: int,
    attempt: int,
    rank: int,
    size: int,
    deadline: Deadline,
    watch: dict[str, Owner],
) -> Group:
    """Rendezvous of one attempt; cancelled (``Retry``) as soon as a participant is seen
    dead."""
    store = state.shared.store
    fabric = Fabric(rank, size, max_frame=state.chunk_bytes)
    cfg = RendezvousConfig(
        name=f"{state.name}/gen/{gen}/a{attempt}",
        rank=rank,
        world_size=size,
        transport=state.transport,
        host=state.host,
        secret=state.secret,
        ssl=state.tls,
        insecure=state.insecure,
        chunk_bytes=state.chunk_bytes,
        deadline=deadline,
        eager=neighbours(size, rank) if state.lazy else None,
    )
    task = asyncio.ensure_future(rendezvous(store, cfg, fabric, max_frame=state.chunk_bytes))
    try:
        while not task.done():
            await asyncio.wait([task], timeout=POLL * 2)
            dead = membership.dead_among(watch)
            if dead and not task.done():
                raise Retry(f"participants {dead} died while generation {gen} formed")
        endpoint, links = task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    fabric.attach(links, endpoint.pulls, endpoint.hosts, endpoint.dialer)
    group = Group(
        fabric,
        WORLD_GID,
        list(range(size)),
        timeout=state.timeout,
        chunk_bytes=state.chunk_bytes,
        name=state.name,
        store=store,
        sync_closers=[endpoint.close],
        closers=[endpoint.release],
    )
    return await start(group, replace(state, generation=gen, owners={}, end_old=_nothing))


async def _generation(
    state: ElasticState,
    gen: int,
    me: str,
    candidates: list[str],
    dead: set[str],
    old: dict[str, str],
    min_size: int,
    timeout: float | None,
    attempt: int = 0,
) -> Group:
    """Agree on generation ``gen`` and form it, retrying with later attempts."""
    last: BaseException | None = None
    for _ in range(len(candidates) + 8):
        deadline = Deadline.after(timeout)
        decision: dict[str, Any] | None = None
        where: dict[str, str] = {}
        try:
            decision, where = await decide(
                state, gen, attempt, me, candidates, dead, old, deadline, min_size
            )
        except Retry as exc:
            last = exc
        else:
            members: list[str] = [str(i) for i in decision["members"]]
            if me not in members:
                raise RendezvousError(
                    f"{_who(me)} was left out of generation {gen} of elastic group "
                    f"{state.name!r} (it called regroup() after the others had formed it, "
                    f"or they took it for dead)"
                )
            if not decision.get("ok"):
                raise RendezvousError(
                    f"generation {gen} of elastic group {state.name!r} would have "
                    f"{len(members)} members ({', '.join(_who(i) for i in members)}), "
                    f"fewer than min_size={min_size}"
                )
            watch = await membership.owners_at(
                state.shared.store, {i: where[i] for i in members if i != me}
            )
            state = replace(
                state, chunk_bytes=int(decision["chunk_bytes"]), timeout=decision["timeout"]
            )
            try:
                return await _form(
                    state,
                    gen,
                    attempt,
                    members.index(me),
                    len(members),
                    Deadline.after(timeout),
                    watch,
                )
            except (Retry, RendezvousError, errors.PeerError, errors.GroupBrokenError) as exc:
                last = exc
        log.info(
            "elastic group %r: attempt %d of generation %d failed (%s); trying again",
            state.name,
            attempt,
            gen,
            last,
        )
        if decision is not None:  # the participants of the failed attempt try again
            old, candidates = where, [str(i) for i in decision["members"]]
        attempt += 1
    raise RendezvousError(
        f"generation {gen} of elastic group {state.name!r} could not form: {last}"
    ) from last


def _who(ident: str) -> str:
    return f"rank {ident[1:]}" if ident.startswith("m") else f"joiner #{ident[1:]}"


async def regroup(group: Group, *, min_size: int = 1, timeout: float | None = None) -> Group:
    """Form the next generation of ``group``'s elastic job (see
    :meth:`aiocollect.Group.regroup`).

    Args:
        group: the current generation's world group (healthy or broken).
        min_size: the fewest members the next generation may have.
        timeout: seconds to wait for the members (None: the group's).

    Returns:
        The next generation's world group.

    Raises:
        UsageError: not an elastic world group, a sub-group, closed, already regrouped,
            or bad ``min_size`` or ``timeout``.
        RendezvousError: fewer than ``min_size`` members, or this rank was left out.
        StoreError: the store failed.
    """
    state: ElasticState | None = group._elastic
    if state is None or group._parent is not None:
        raise UsageError(
            "regroup() needs the world group of open_group(..., elastic=True)"
            if state is None
            else "regroup() is called on the world group, not on a sub-group"
        )
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise UsageError(f"min_size must be an int >= 1, got {min_size!r}")
    if group.closed and group._fabric.failure is None:
        raise UsageError(f"group {state.name!r} is closed (aclose): nothing to regroup")
    if state.shared.current is not group:
        raise UsageError(
            f"generation {state.generation} of group {state.name!r} has "
            "already been regrouped or closed"
        )
    if timeout is None:
        timeout = state.timeout
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
    gen = state.generation + 1
    me = f"m{group.rank}"
    candidates = [f"m{r}" for r in range(group.world_size)]
    failure = group._fabric.failure
    dead = set()
    if isinstance(failure, errors.PeerDisconnected) and failure.rank is not None:
        dead.add(f"m{failure.rank}")
    dead.discard(me)
    old = {
        f"m{r}": f"{state.prefix}/g{state.generation}/owner/{r}" for r in range(group.world_size)
    }
    state.shared.current = None
    store = state.shared.store
    state = replace(
        state, end_old=lambda: group.abort(GroupBrokenError(f"regroup() to generation {gen}"))
    )
    try:
        if failure is not None:
            state.end_old()
        return await _generation(state, gen, me, candidates, dead, old, min_size, timeout)
    except BaseException:
        group.abort(GroupBrokenError(f"regroup() to generation {gen} failed"))
        if state.shared.owned and not state.shared.store_closed:
            state.shared.store_closed = True
            with contextlib.suppress(Exception):
                await store.close()
        raise


async def joiners(group: Group) -> int:
    """How many processes wait in ``join_group`` for ``group``'s elastic job (see
    :meth:`aiocollect.Group.joiners`).

    Args:
        group: a group of the job.

    Returns:
        The number of processes waiting.

    Raises:
        UsageError: not an elastic group.
        StoreError: the store failed.
    """
    state: ElasticState | None = group._elastic
    if state is None:
        raise UsageError("joiners() needs a group of open_group(..., elastic=True)")
    store = state.shared.store
    return max(
        0,
        await membership.counter(store, f"{state.prefix}/tickets")
        - await membership.counter(store, f"{state.prefix}/served"),
    )


async def join(state: ElasticState, timeout: float | None) -> Group:
    """Take a ticket, wait for the regroup that admits it, form that generation
    (``join_group``'s work).

    Args:
        state: the joiner's settings (its store, name, secret, transport).
        timeout: seconds to wait for admission (None: 300 s), then as long again to form.

    Returns:
        The admitting generation's world group.

    Raises:
        RendezvousTimeout: no regroup admitted this process in time.
        RendezvousError: the generation could not form.
        StoreError: the store failed.
    """
    store = state.shared.store
    t = await store.add(f"{state.prefix}/tickets", 1) - 1
    ticket = f"{state.prefix}/ticket/{t}"
    me_owner = Owner.me(b"").pack()
    if state.secret is not None:
        await store.set(
            f"{ticket}/mac", membership.ticket_mac(state.secret, state.name, t, me_owner)
        )
    await store.set(ticket, me_owner)
    try:
        raw = await store.get(
            f"{state.prefix}/admit/{t}", timeout=300.0 if timeout is None else timeout
        )
    except errors.StoreTimeout:
        await store.delete(ticket)
        raise RendezvousTimeout(
            f"no regroup() of elastic group {state.name!r} admitted this process within "
            f"{timeout}s (joiner #{t})",
            [],
        ) from None
    admit = membership.unpack(raw, f"admit/{t}")
    gen, attempt = int(admit[0]), int(admit[1])
    base = f"{state.prefix}/g{gen}/a{attempt}"
    decision = membership.unpack(await store.get(f"{base}/decision", timeout=DECISION_GRACE), base)
    me = f"j{t}"
    members = [str(i) for i in decision["members"]]
    # Admitted: the participants of this attempt are fixed; a retry starts at attempt+1.
    old = {i: f"{base}/member/{i}" for i in members}
    old[me] = ticket
    state = replace(state, chunk_bytes=int(decision["chunk_bytes"]), timeout=decision["timeout"])
    watch = await membership.owners_at(store, {i: old[i] for i in members if i != me})
    try:
        return await _form(
            state, gen, attempt, members.index(me), len(members), Deadline.after(timeout), watch
        )
    except (Retry, RendezvousError, errors.PeerError, errors.GroupBrokenError) as exc:
        log.info("joiner #%d: generation %d attempt %d failed (%s)", t, gen, attempt, exc)
    return await _generation(state, gen, me, members, set(), old, 1, timeout, attempt=attempt + 1)
