"""What ``Group.statistics()`` returns: frozen dataclasses that also read like the dicts
they replace (``stats.links[1].bytes_sent`` and ``stats["links"][1]["bytes_sent"]``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


class _Fields(Mapping[str, Any]):
    """Read-only mapping access to a dataclass's fields, by name, in declaration order."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts all the way down (for JSON, logging)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload, no-any-return]


@dataclass(frozen=True, eq=True)
class LinkStatistics(_Fields):
    """Counters of the link to one peer (world rank), since it connected.

    Attributes:
        bytes_sent: Payload and header bytes this rank sent on the link.
        bytes_received: Payload and header bytes this rank received on the link.
        frames_sent: Frames this rank sent on the link.
        frames_received: Frames this rank received on the link.
    """

    bytes_sent: int
    bytes_received: int
    frames_sent: int
    frames_received: int


@dataclass(frozen=True, eq=True)
class Statistics(_Fields):
    """A snapshot of a group's counters (``Group.statistics()``).

    Attributes:
        rank: This rank in the group.
        world_size: The group's size.
        ops: ``KIND_started`` and ``KIND_completed`` per operation kind
            (``allreduce_started``...).
        in_flight: Operations started and not yet done.
        links: Per peer's world rank, the link's counters (links are shared with
            sub-groups).
        broken: Whether the group is broken (a failure, a timeout or ``abort()``).
        closed: Whether ``aclose()`` or ``abort()`` was called.
        topology: The group's hosts as the rendezvous learnt them (same hostname and
            boot id): ``hosts`` (per host, its group ranks), ``host`` and ``local_rank``
            (this rank's), ``leaders`` (each host's lowest rank), ``two_level`` (whether
            the collectives run in two levels).
        same_host: The counters of ``links`` summed over peers on this rank's host.
        cross_host: The same over peers on other hosts.
    """

    rank: int
    world_size: int
    ops: dict[str, int]
    in_flight: int
    links: dict[int, LinkStatistics]
    broken: bool
    closed: bool
    topology: dict[str, Any] = dataclasses.field(default_factory=dict)
    same_host: LinkStatistics = LinkStatistics(0, 0, 0, 0)
    cross_host: LinkStatistics = LinkStatistics(0, 0, 0, 0)
