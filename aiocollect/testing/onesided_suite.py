"""Conformance checks of one-sided reads, for every link that declares them
(``caps.reads`` and ``caps.exposes``: :meth:`~aiocollect.transport.base.Link.expose`,
``read_exposed`` and ``unexpose``).

A transport is checked by one call, ``await check_one_sided(make_pair)``, with the pair
factories of :mod:`aiocollect.testing.link_suite` (``transport_pair`` of a registered
transport). :data:`ONE_SIDED_CHECKS` lists the checks for a test that parametrizes over
them, and :func:`one_sided_support` says whether one applies to a pair's links. What is
checked is the seam's contract (transport/base.py): ``expose`` / ``read_exposed`` round
trips at any offset, in both directions; a read past the exposure, at a negative offset or
with a malformed token is a ProtocolError that breaks the link and writes nothing; where
the kind can tell (``Link.exposure_end_checked``), so is a read after ``unexpose``.

Each check raises AssertionError (with what went wrong) on a violation; every wait is
bounded by :data:`~aiocollect.testing.link_suite.WAIT` seconds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiocollect.errors import ProtocolError
from aiocollect.testing.link_suite import MAX_FRAME, PairFactory, Recorder, payload, within
from aiocollect.transport.base import TOKEN_MAX

Check = Callable[[PairFactory], Awaitable[None]]


async def check_expose_read(make_pair: PairFactory) -> None:
    """In both directions: a buffer exposed (read-only bytes) is read whole, in pieces at
    odd offsets and with an empty read at its end, exactly; two exposures at once stay
    apart; tokens fit ``TOKEN_MAX``; ``unexpose`` twice is harmless."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        for x, y, salt in ((a, b, 1), (b, a, 2)):
            data = payload((3 << 20) + 5, salt)
            other = bytearray(payload(1000, salt + 7))
            token = x.expose(memoryview(data))
            token2 = x.expose(memoryview(other))
            for t in (token, token2):
                assert isinstance(t, bytes), f"token {t!r}"
                assert len(t) <= TOKEN_MAX, f"a token of {len(t)} bytes"
            n = len(data)
            for offset, size in ((0, n), (0, 1), (1, 4096), (n // 2 + 3, 1 << 20), (n - 7, 7)):
                into = bytearray(size)
                y.read_exposed(token, offset, memoryview(into))
                assert into == data[offset : offset + size], f"bytes {offset}+{size} differ"
            y.read_exposed(token, n, memoryview(bytearray(0)))
            piece = bytearray(10)
            y.read_exposed(token2, 990, memoryview(piece))
            assert piece == other[990:], "the second exposure's bytes differ"
            for t in (token, token2, token):
                x.unexpose(t)
        assert not ra.errors, ra.errors
        assert not rb.errors, rb.errors


async def check_bad_tokens(make_pair: PairFactory) -> None:
    """A read past the end of an exposure, at a negative offset, or with a malformed
    (truncated) token raises ProtocolError, reports it (the link breaks: the peer sees it
    close) and writes nothing into the destination."""
    for how in ("past the end", "at a negative offset", "with a truncated token"):
        await _bad_read(make_pair, how)


async def _bad_read(make_pair: PairFactory, how: str) -> None:
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        data = payload(4096, 3)
        token = a.expose(memoryview(data))
        offset, size, bad = {
            "past the end": (4090, 7, token),
            "at a negative offset": (-1, 2, token),
            "with a truncated token": (0, 1, token[:-1]),
        }[how]
        into = bytearray(size)
        try:
            b.read_exposed(bad, offset, memoryview(into))
        except ProtocolError:
            pass
        else:
            raise AssertionError(f"a read {how} did not raise ProtocolError")
        assert into == bytes(size), f"a read {how} wrote into its destination"
        await rb.until(f"the read {how} to be reported", lambda: bool(rb.errors))
        assert isinstance(rb.errors[0], ProtocolError), repr(rb.errors[0])
        await within("the peer to see the broken link close", ra.lost.wait())
        a.unexpose(token)


async def check_read_after_unexpose(make_pair: PairFactory) -> None:
    """Where the kind can tell (``exposure_end_checked``): a token read before
    ``unexpose`` is refused after it with ProtocolError, reported (the link breaks)."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        data = payload(5000, 4)
        token = a.expose(memoryview(data))
        into = bytearray(len(data))
        b.read_exposed(token, 0, memoryview(into))
        assert into == data
        a.unexpose(token)
        try:
            b.read_exposed(token, 0, memoryview(bytearray(10)))
        except ProtocolError:
            pass
        else:
            raise AssertionError("a read after unexpose() did not raise ProtocolError")
        await rb.until("the read after unexpose() to be reported", lambda: bool(rb.errors))


#: The checks of one-sided reads, for links that declare them (:func:`one_sided_support`).
ONE_SIDED_CHECKS: tuple[Check, ...] = (
    check_expose_read,
    check_bad_tokens,
    check_read_after_unexpose,
)


async def one_sided_support(make_pair: PairFactory, check: Check) -> str | None:
    """Why ``check`` (one of :data:`ONE_SIDED_CHECKS`) does not apply to the links
    ``make_pair`` makes, or None when it does: both links must declare ``caps.exposes``
    and ``caps.reads`` (after their handshake), and :func:`check_read_after_unexpose`
    needs a kind that can tell that an exposure ended."""
    async with make_pair(Recorder(), Recorder(), MAX_FRAME) as (a, b):
        if not all(link.caps.reads and link.caps.exposes for link in (a, b)):
            return "the links do not declare one-sided reads (caps.reads, caps.exposes)"
        if check is check_read_after_unexpose and not b.exposure_end_checked:
            return "the link kind cannot tell that an exposure ended (exposure_end_checked)"
    return None


async def check_one_sided(make_pair: PairFactory) -> None:
    """Run every check of :data:`ONE_SIDED_CHECKS` that applies to the links of
    ``make_pair`` (:func:`one_sided_support`), each on a fresh pair.

    Raises:
        AssertionError: the first check the transport fails, naming what went wrong.
    """
    for check in ONE_SIDED_CHECKS:
        if await one_sided_support(make_pair, check) is None:
            await check(make_pair)


__all__ = [
    "ONE_SIDED_CHECKS",
    "check_bad_tokens",
    "check_expose_read",
    "check_one_sided",
    "check_read_after_unexpose",
    "one_sided_support",
]
