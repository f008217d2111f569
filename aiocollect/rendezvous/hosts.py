"""Host identity of the ranks, from their rendezvous records: which world ranks share a
host (same hostname and boot id, the fields ``transport.host.identity`` publishes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def host_indices(records: Mapping[int, Mapping[str, Any]], world_size: int) -> list[int]:
    """Per world rank, the index of its host: hosts numbered by their lowest rank, ranks
    whose records carry the same ``hostname`` and ``boot_id`` on one host. A rank whose
    record is missing or names no host counts as a host of its own (the same answer on
    every rank, since every rank reads the same records)."""
    seen: dict[tuple[Any, Any], int] = {}
    out: list[int] = []
    for r in range(world_size):
        rec = records.get(r) or {}
        name, boot = rec.get("hostname"), rec.get("boot_id")
        key: tuple[Any, Any] = (name, boot) if name else ("", r)
        out.append(seen.setdefault(key, len(seen)))
    return out
