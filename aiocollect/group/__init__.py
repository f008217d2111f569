"""The group layer: :class:`Group`, a set of ranks that run collectives together.

- ``core.py``: sequence numbers, handles in flight, close and abort (``GroupCore``)
- ``p2p.py``: ``send`` and ``recv``
- ``collectives.py``: ``barrier``, ``broadcast``, ``allreduce``, ``reduce``
- ``blocks.py``: ``allgather``, ``gather``, ``scatter``, ``reduce_scatter``, ``alltoall``,
  ``allgatherv``, ``alltoallv``
- ``objects.py``: ``broadcast_object``, ``allgather_object``, ``gather_object``
- ``group.py``: ``Group`` itself, ``split`` and the elastic generation
"""

from aiocollect.group.group import Group

__all__ = ["Group"]
