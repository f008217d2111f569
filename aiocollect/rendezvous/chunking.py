"""The group's default chunk size, chosen from the rendezvous records.

A chunk is the payload of one frame of a pipelined collective (and the largest frame a
link accepts). Every rank must cut a message into the same frames, so the size may only
depend on what every rank knows alike: the records every rank publishes and reads during
rendezvous. A link's own capabilities (``Link.caps``) will not do: each end evaluates them
on its own, and they change once as a handshake's checks end.

- ``DEFAULT_CHUNK_BYTES`` (1 MiB): any group with a link that copies its bytes through a
  socket. On a byte stream a small frame waits behind the frame being written, so bulk
  frames stay at 1 MiB there (docs/design.md, *Bytes ahead of a small frame*).
- ``PULLED_CHUNK_BYTES`` (2 MiB): a group whose records all predict one-sided reads
  between every two ranks (:func:`aiocollect.transport.onesided.all_read`; shared memory's
  records on one host, where pulls are on). Such a link moves a bulk frame as a reference
  record that the reader pulls in ``PULL_STEP`` pieces, reading its ring between them, so
  a small frame does not wait behind the larger frame; and half as many frames halve the
  per-frame work of the interpreter, which is what four ranks on two cores wait for
  (docs/benchmarks.md: the chunk-size measurements of four ranks on two cores).

The choice is a prediction from the records, not a promise: a link between two ranks of
such a group whose pull check fails still works (its frames go through the ring), and every
rank still cuts alike. An explicit ``chunk_bytes`` always wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiocollect.transport import onesided

#: The chunk size of a group whose links may copy their bytes through a socket.
DEFAULT_CHUNK_BYTES = 1 << 20
#: The chunk size of a group whose every link pulls (see the module docstring).
PULLED_CHUNK_BYTES = 2 << 20
#: The largest frame a link of a group with the default chunk size accepts (it learns
#: which of the two sizes its group uses only once every record is read).
DEFAULT_MAX_FRAME = max(DEFAULT_CHUNK_BYTES, PULLED_CHUNK_BYTES)


def all_pull(records: Mapping[int, Mapping[str, Any]]) -> bool:
    """Whether the records (all of them, this rank's included) predict that every rank
    reads every other rank's memory: two or more ranks whose records declare one-sided
    reads that reach each other (:func:`~aiocollect.transport.onesided.all_read`: the
    transports' own declaration, nothing else of the records; the same answer on every
    rank). It chooses the chunk size (:func:`group_chunk_bytes`) and lets the automatic
    choice take the pull algorithms (collectives/select.py); a link that does not read
    anyway still works under both (ring copies; the pull algorithms' pushes)."""
    return len(records) >= 2 and onesided.all_read(records.values())


def group_chunk_bytes(records: Mapping[int, Mapping[str, Any]]) -> int:
    """The default chunk size of the group whose ranks published ``records`` (all of them,
    this rank's included): ``PULLED_CHUNK_BYTES`` when they predict that every rank pulls
    from every other (:func:`all_pull`, the same on every rank), else
    ``DEFAULT_CHUNK_BYTES``."""
    return PULLED_CHUNK_BYTES if all_pull(records) else DEFAULT_CHUNK_BYTES
