"""The transport axis: every registered transport and its modes, for the collective, stress
and failure tests that run one body over all of them.

A :class:`Mode` is one way to link the ranks of a group: a transport registered in
:mod:`aiocollect.transport.registry` and the environment its ranks get. Every registered
transport is a mode under its own name; :data:`VARIANTS` adds the modes a transport has
beyond its default (shared memory without single-copy pulls, and with its sockets on TCP
loopback rather than Unix sockets). A transport registered later (a :func:`register` call
in a plug-in, or one more line in ``registry.BUILTIN``) is on the axis with no edit here.

A test joins the axis by taking the ``axis`` fixture (tests/conftest.py), which gives it an
:class:`Axis`: the mode's environment is set for the test (spawned ranks inherit it), TLS
certificates are made when the transport needs them, and nothing may be left in shared
memory afterwards (tests/support/shm_leaks.py). The ``transports`` mark chooses its cases::

    @pytest.mark.transports(argnames="n", values={"memory": [1, 2, 3]}, default=[3])
    async def test_x(axis: Axis, n: int) -> None:
        await axis.run(n, body)

``argnames`` (comma-separated) are parametrized together with the mode: ``values[name]``
lists the mode's cases, ``default`` those of every mode not in ``values`` (an empty list
leaves a mode out); ``where="processes"`` keeps the modes whose ranks can be processes,
``where="in_process"`` those that link ranks of one process only. Without the mark the test
runs once per mode.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.testing.certs import Certs
from aiocollect.testing.spawn import SpawnedRanks
from aiocollect.transport import cma, registry, unix
from aiocollect.transport.shm_ring import unavailable as _shm_unavailable

#: Modes beyond a transport's default, by transport name: (suffix, environment). The mode is
#: named ``<transport>-<suffix>``.
VARIANTS: Mapping[str, Sequence[tuple[str, Mapping[str, str]]]] = {
    "shm": (
        ("nopull", {cma.ENV: "0"}),  # frames through the ring, never by reference
        ("tcpsocket", {unix.UNIX_ENV: "0"}),  # the link's socket on TCP loopback
    ),
}

#: The marks of a ``transport="shm"`` case of a test parametrized over transports by hand:
#: skipped where shared memory is unavailable.
ON_SHM = (
    pytest.mark.skipif(
        _shm_unavailable() is not None, reason=f"shared memory unavailable: {_shm_unavailable()}"
    ),
)

Where = Literal["any", "processes", "in_process"]

#: The modes ``make test`` runs: the default path (``auto``: on one host its links are the
#: ``shm`` transport's, so ``shm`` by name would repeat it) and the transports off that path.
#: ``AIOCOLLECT_AXIS=extended`` (``make test-axis``, which CI runs too) runs every other mode
#: instead (``shm`` by name, ``tls`` and the shared-memory variants),
#: ``AIOCOLLECT_AXIS=full`` all of them: the whole axis in one run takes ``make test`` past
#: its 15-minute budget on 2 cores.
CORE_MODES = frozenset({"memory", "tcp", "auto"})
AXIS_ENV = "AIOCOLLECT_AXIS"


def selected(name: str) -> bool:
    """Whether this run covers mode ``name`` (:data:`AXIS_ENV`)."""
    scope = os.environ.get(AXIS_ENV, "core")
    if scope == "full":
        return True
    return (name in CORE_MODES) == (scope != "extended")


@dataclass(frozen=True)
class Mode:
    """One transport and the environment of its ranks."""

    #: The test id: the transport's name, or ``<transport>-<variant>``.
    name: str
    #: The registered transport (``open_group(transport=...)``).
    transport: str
    env: Mapping[str, str] = field(default_factory=dict)
    #: Links only ranks of one process (no spawned ranks).
    in_process: bool = False
    #: Needs ``ssl=`` (certificates).
    needs_tls: bool = False

    def unavailable(self) -> str | None:
        """Why this mode cannot run here, or None when it can."""
        found = registry.get(self.transport)
        if found is None:
            return f"transport {self.transport!r} is no longer registered"
        return found.unavailable()


def modes(where: Where = "any") -> list[Mode]:
    """Every registered transport and its :data:`VARIANTS`, in registry order.

    Args:
        where: ``"processes"``: only modes whose ranks can be processes;
            ``"in_process"``: only those that link ranks of one process only.
    """
    out = []
    for t in registry.transports():
        base = Mode(t.name, t.name, {}, t.in_process, t.needs_tls)
        out.append(base)
        for suffix, env in VARIANTS.get(t.name, ()):
            out.append(Mode(f"{t.name}-{suffix}", t.name, env, t.in_process, t.needs_tls))
    if where == "processes":
        return [m for m in out if not m.in_process]
    if where == "in_process":
        return [m for m in out if m.in_process]
    return out


def cases(
    argnames: str | None = None,
    values: Mapping[str, Sequence[Any]] | None = None,
    default: Sequence[Any] | None = None,
    where: Where = "any",
) -> tuple[list[str], list[Any]]:
    """The parametrization of a test on the axis (what the ``transports`` mark asks for):
    the argument names (``axis`` first) and one ``pytest.param`` per case, with ids
    ``<mode>`` or ``<mode>-<values>``.

    Raises:
        ValueError: ``values`` names no mode (a misspelt or unregistered one).
    """
    every = [m for m in modes(where) if selected(m.name)]
    known = {m.name for m in modes()}
    unknown = set(values or ()) - known
    if unknown:
        raise ValueError(f"the axis has no mode {sorted(unknown)} (modes: {sorted(known)})")
    if argnames is None:
        return ["axis"], [pytest.param(m, id=m.name) for m in every]
    names = [a.strip() for a in argnames.split(",")]
    params = []
    for m in every:
        chosen = (values or {}).get(m.name, default if default is not None else [])
        for v in chosen:
            vs = tuple(v) if len(names) > 1 else (v,)
            params.append(pytest.param(m, *vs, id="-".join([m.name, *map(_id, vs)])))
    return ["axis", *names], params


def _id(value: Any) -> str:
    """A case value in a test id (None: ``default``)."""
    return "default" if value is None else str(value)


@dataclass
class Axis:
    """What the ``axis`` fixture gives a test: its mode, and ranks to run on it."""

    mode: Mode
    #: Certificates (for a mode that needs TLS), else None.
    certs: Certs | None = None

    @property
    def name(self) -> str:
        """The mode's name (its test id)."""
        return self.mode.name

    @property
    def transport(self) -> str:
        """The registered transport the mode runs on."""
        return self.mode.transport

    async def run(
        self, n: int, fn: Callable[..., Awaitable[Any]], *args: Any, **options: Any
    ) -> list[Any]:
        """``run_ranks(n, fn, *args, transport=..., **options)`` in this process (with
        ``ssl=`` for a mode that needs TLS: every rank holds rank 0's certificate)."""
        if self.certs is not None:
            options.setdefault("ssl", self.certs.config(0))
        return await run_ranks(n, fn, *args, transport=self.transport, **options)

    def spawn(
        self, n: int, fn: Callable[..., Awaitable[Any]], *args: Any, **options: Any
    ) -> SpawnedRanks:
        """``spawn_ranks(n, fn, *args, transport=..., **options)``. A mode that needs TLS
        runs ``fn`` on a TLS group that each rank opens beside the spawned one (contexts
        cannot be pickled, so each process builds its own from the certificate files), on
        its store, with its deadline (``group_timeout=``) and ``chunk_bytes=``."""
        if self.certs is None:
            return spawn_ranks(n, fn, *args, transport=self.transport, **options)
        inner = {k: options[k] for k in ("group_timeout", "chunk_bytes") if k in options}
        return spawn_ranks(n, beside_tls, self.certs, inner, fn, *args, **options)


async def beside_tls(
    g: ac.Group,
    certs: Certs,
    options: dict[str, Any],
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
) -> Any:
    """Spawned rank body: ``fn(t, *args)`` on a TLS group ``t`` of the same ranks, opened on
    ``g``'s store (``options``: ``group_timeout`` and ``chunk_bytes`` of ``t``)."""
    if "group_timeout" in options:
        options = {**options, "timeout": options["group_timeout"]}
        del options["group_timeout"]
    async with ac.open_group(
        g.rank,
        g.world_size,
        store=g.store,
        transport="tls",
        ssl=certs.config(g.rank % len(certs.ranks)),
        name="beside-tls",
        **options,
    ) as t:
        return await fn(t, *args)
