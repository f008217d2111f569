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
    """Counters of the link to one peer (world rank), since it connected."""

    bytes_sent: int
    bytes_received: int
    frames_sent: int
    frames_received: int


@dataclass(frozen=True, eq=True)
class Statistics(_Fields):
    """A snapshot of a group's counters (``Group.statistics()``)."""

    rank: int
    world_size: int
    #: ``KIND_started`` and ``KIND_completed`` per operation kind (``allreduce_started``...).
    ops: dict[str, int]
    #: Operations started and not yet done.
    in_flight: int
    #: Per peer's world rank, the link's counters (links are shared with sub-groups).
    links: dict[int, LinkStatistics]
    broken: bool
    closed: bool
