"""Agreeing through the store on who forms an elastic group's next generation: each
participant registers, waits for the other candidates (registered, known dead, or the
deadline), proposes the registered ones plus the live waiting joiners, and follows the
first proposal written (the protocol: :mod:`aiocollect.elastic`)."""

from __future__ import annotations

import contextlib
import hmac
import logging
from typing import TYPE_CHECKING, Any

from aiocollect import errors
from aiocollect._deadline import Deadline
from aiocollect.errors import RendezvousError
from aiocollect.rendezvous import membership
from aiocollect.rendezvous.owner import Owner

if TYPE_CHECKING:
    from aiocollect.elastic.generations import ElasticState

log = logging.getLogger("aiocollect.elastic")

#: Store waits are cut into slices this long, to look again at who is known dead; longer
#: by one ``POLL`` per ``POLL_RANKS`` participants, up to ``POLL_MAX``: every participant
#: polls, and 255 of them polling every 0.05 s kept the store too busy to serve the
#: registrations they waited for (``tools/regroup_scale.py``).
POLL = 0.05
POLL_RANKS = 16
POLL_MAX = 0.5
#: How long a proposer waits for the record of a ticket already counted.
TICKET_GRACE = 0.5
#: Longest wait for the decision once a proposer has claimed to write it.
DECISION_GRACE = 5.0
#: A healthy old generation is aborted once the decision is known, so that the last
#: operation before a scheduled regroup() completes on every rank; or when a participant is
#: still missing after this many seconds (it may be stuck in an operation of the old
#: generation that its peers will not join). A broken one is aborted at once.
ABORT_GRACE = 2.0


class Retry(Exception):
    """This attempt cannot form; the same participants try the next one."""


async def propose(
    state: ElasticState,
    base: str,
    candidates: list[str],
    dead: set[str],
    old: dict[str, str],
    deadline: Deadline,
    admit_joiners: bool,
) -> dict[str, Any]:
    """Wait for the candidates (registered, known dead, or the deadline), then read the
    joiners and return this participant's proposal.

    Args:
        state: the member's elastic settings.
        base: the attempt's records on the store (``E/g<k>/a<a>``).
        candidates: who may take part (``m<old rank>``, ``j<ticket>``).
        dead: the candidates known dead; those found dead meanwhile are added.
        old: where each candidate's owner record lies (to tell it dead).
        deadline: when to stop waiting for missing candidates.
        admit_joiners: whether to add the live waiting joiners that proved the secret.

    Returns:
        The proposal: ``members``, ``served`` (tickets seen), ``chunk_bytes``, ``timeout``.

    Raises:
        StoreError: the store failed.
    """
    store = state.shared.store
    keys = {i: f"{base}/member/{i}" for i in candidates}
    grace = Deadline.after(ABORT_GRACE)
    owners: dict[str, Owner] = {}  # (an owner record never changes: read once)
    poll = min(POLL * max(1.0, len(candidates) / POLL_RANKS), POLL_MAX)
    while True:
        present = await store.check(list(keys.values()))
        missing = [i for i, ok in zip(keys, present, strict=True) if not ok and i not in dead]
        unread = {i: old[i] for i in missing if i in old and i not in owners}
        if unread:
            owners.update(await membership.owners_at(store, unread))
        dead.update(membership.dead_among({i: owners[i] for i in missing if i in owners}))
        missing = [i for i in missing if i not in dead]
        if not missing or deadline.expired():
            break
        if grace.expired():
            state.end_old()
        remaining = deadline.remaining()
        with contextlib.suppress(errors.StoreTimeout):
            await store.wait(
                [keys[i] for i in missing],
                timeout=poll if remaining is None else min(poll, remaining),
            )
    present = await store.check(list(keys.values()))
    members = [i for i, ok in zip(keys, present, strict=True) if ok]
    served = int(await membership.counter(store, f"{state.prefix}/served"))
    tickets = served
    if admit_joiners:
        tickets = int(await membership.counter(store, f"{state.prefix}/tickets"))
        for t in range(served, tickets):
            key = f"{state.prefix}/ticket/{t}"
            with contextlib.suppress(errors.StoreTimeout):
                await store.wait([key], timeout=TICKET_GRACE)
            owner = await membership.owner_at(store, key)
            if owner is not None and not membership.dead(owner) and await _proven(state, t):
                members.append(f"j{t}")
    return {
        "members": members,
        "served": tickets,
        "chunk_bytes": state.chunk_bytes,
        "timeout": state.timeout,
    }


async def _proven(state: ElasticState, t: int) -> bool:
    """Whether joiner ``t`` proved the group's secret (always, in a group without one): a
    process without it is never admitted."""
    if state.secret is None:
        return True
    store, key = state.shared.store, f"{state.prefix}/ticket/{t}"
    owner = await store.get(key, timeout=0)
    if not (await store.check([f"{key}/mac"]))[0]:
        ok = False
    else:
        mac = await store.get(f"{key}/mac", timeout=0)
        ok = hmac.compare_digest(mac, membership.ticket_mac(state.secret, state.name, t, owner))
    if not ok:
        log.warning(
            "elastic group %r: joiner #%d did not prove the group's secret; not admitted",
            state.name,
            t,
        )
    return ok


async def decide(
    state: ElasticState,
    gen: int,
    attempt: int,
    me: str,
    candidates: list[str],
    dead: set[str],
    old: dict[str, str],
    deadline: Deadline,
    min_size: int,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Register ``me`` in attempt ``attempt`` of generation ``gen`` (if not registered)
    and return the agreed decision, and where each participant's owner record lies.

    Args:
        state: the member's elastic settings.
        gen: the generation being formed.
        attempt: the attempt of it.
        me: this participant (``m<old rank>`` or ``j<ticket>``).
        candidates: who may take part.
        dead: the candidates known dead.
        old: where each candidate's owner record lies.
        deadline: when to stop waiting for missing candidates.
        min_size: the fewest members the generation may have (else ``ok`` is False).

    Returns:
        The decision (``members`` in new-rank order, ``ok``, ``served``, ``chunk_bytes``,
        ``timeout``) and where each member's owner record lies.

    Raises:
        Retry: no decision was written in time; the same participants try the next
            attempt.
        RendezvousError: the decision record is malformed.
        StoreError: the store failed.
    """
    store = state.shared.store
    base = f"{state.prefix}/g{gen}/a{attempt}"
    if me in candidates:
        await store.set(f"{base}/member/{me}", Owner.me(b"").pack())
    decision_key = f"{base}/decision"
    if not (await store.check([decision_key]))[0]:
        proposal = await propose(
            state, base, candidates, dead, old, deadline, admit_joiners=attempt == 0
        )
        proposal["ok"] = len(proposal["members"]) >= min_size
        if not proposal["ok"]:  # joiners stay waiting for a generation that forms
            proposal["members"] = [
                i for i in proposal["members"] if not i.startswith("j") or i in candidates
            ]
        if await store.add(f"{base}/decided", 1) == 1:
            await store.set(decision_key, membership.pack(proposal))
    rem = deadline.remaining()
    try:
        raw = await store.get(decision_key, timeout=DECISION_GRACE + (rem or 0.0))
    except errors.StoreTimeout:
        raise Retry(f"no decision for attempt {attempt} of generation {gen}") from None
    state.end_old()
    decision = membership.unpack(raw, decision_key)
    if not isinstance(decision, dict) or not isinstance(decision.get("members"), list):
        raise RendezvousError(f"malformed elastic record {decision_key!r} in the store")
    where = {i: f"{base}/member/{i}" for i in decision["members"]}
    if decision.get("ok"):
        for i in decision["members"]:  # any participant may write these (same values)
            if i.startswith("j") and i not in candidates:
                where[i] = f"{state.prefix}/ticket/{i[1:]}"
                await store.set(f"{state.prefix}/admit/{i[1:]}", membership.pack([gen, attempt]))
        await store.set(f"{state.prefix}/served", str(int(decision["served"])).encode())
    return decision, where
