"""Open MPI as a baseline of ``aiocollect bench`` (``--baseline mpi``): whether it can
run here, and the ``mpirun`` command and environment of one round.

An MPI round is ``mpirun -n N … python -m aiocollect.bench.mpi_rank ARGS``, once over
shared memory (``--mca btl self,vader``) and once over TCP on the loopback interface
(``--mca btl self,tcp --mca btl_tcp_if_include lo``), both with the ``ob1`` messaging
layer so that the named transport is the one used, and ``--bind-to none`` so that its
ranks are scheduled like aiocollect's (unpinned). The ranks run the same timing method
as aiocollect's and gloo's (:mod:`aiocollect.bench.sweep`) through mpi4py
(:mod:`aiocollect.bench.mpi_rank`). The environment lets a root user run ``mpirun``
(``OMPI_ALLOW_RUN_AS_ROOT``) and more ranks than cores
(``OMPI_MCA_rmaps_base_oversubscribe``); a variable the user set already is kept.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

#: The MPI legs of a round: their key in the round entry (and JSON row), the table's label
#: and Open MPI's byte-transfer layers.
LEGS: dict[str, tuple[str, str]] = {
    "mpi_shm": ("mpi shm", "self,vader"),
    "mpi_tcp": ("mpi tcp", "self,tcp"),
}
#: The environment of ``mpirun`` (and so of its ranks), over what the runner gives.
ENVIRONMENT = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl_tcp_if_include": "lo",
}


def missing() -> str | None:
    """Why the MPI baseline cannot run here (no ``mpirun`` on PATH, or no mpi4py for this
    interpreter), or None when it can."""
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (install Open MPI, e.g. apt-get install openmpi-bin)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py, or pip install 'aiocollect[mpi]')"
    return None


def command(leg: str, world_size: int, args: list[str]) -> list[str]:
    """The ``mpirun`` command of one MPI round: ``world_size`` ranks of
    ``aiocollect.bench.mpi_rank`` with ``args`` over ``leg``'s byte-transfer layers.

    Raises:
        KeyError: ``leg`` is not one of :data:`LEGS`.
    """
    btl = LEGS[leg][1]
    head = ["mpirun", "-n", str(world_size), "--bind-to", "none", "--mca", "btl", btl]
    return [*head, sys.executable, "-m", "aiocollect.bench.mpi_rank", *args]


def environment(base: dict[str, str]) -> dict[str, str]:
    """``base`` with :data:`ENVIRONMENT` (a variable already set in ``base`` wins)."""
    return {**ENVIRONMENT, **base}
