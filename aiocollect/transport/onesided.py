"""What a rendezvous record says about one-sided reads: whether the rank's links read
their peers' exposed memory (``Link.read_exposed``), and how far that reaches.

A listener that gives its links one-sided reads publishes :func:`fields` in its record;
rendezvous asks :func:`all_read` of the records (through
:func:`aiocollect.rendezvous.chunking.all_pull`) to predict, alike on every rank, whether
every link of the group will read: that chooses the group's default chunk size and lets
the automatic algorithm choice take the pull algorithms. Nothing above the transport
looks at a record's other fields to decide it.

The prediction is not a promise: a link may still turn out not to read (its check failed),
and the pull algorithms then push to that peer instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from aiocollect.transport import host

#: The record's field: the reach of the rank's one-sided reads (a scope below), or False.
FIELD = "pull"
#: Scope: the rank reads (and exposes to) the ranks on its own host only (shared memory's
#: ``process_vm_readv``); a record of another host predicts no reads.
HOST = "host"
#: Scope: the rank reads every rank its transport links it to (an RDMA network, the
#: in-process example of tests/transport/example_onesided.py).
ANY = "any"


def fields(scope: str | None) -> dict[str, Any]:
    """The record fields of a rank whose links read one-sided within ``scope``
    (:data:`HOST` or :data:`ANY`), or not at all (None)."""
    return {FIELD: scope or False}


def all_read(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether ``records`` (every rank's, this rank's included) predict that every rank
    reads every other one-sided: each declares a scope, and where one declares
    :data:`HOST`, every record comes from this host
    (:func:`~aiocollect.transport.host.same_host`). Anything else (no field, False, a value
    that is not a scope) predicts no reads. The same answer on every rank that evaluates
    the same records: "every record from this host" holds on every rank or on none."""
    scopes = set()
    recs = list(records)
    for rec in recs:
        scope = rec.get(FIELD)
        if scope != HOST and scope != ANY:
            return False
        scopes.add(scope)
    return HOST not in scopes or all(host.same_host(rec) for rec in recs)
