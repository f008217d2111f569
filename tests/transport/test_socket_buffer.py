"""TCP links size the kernel's socket buffers (transport/sockets.py, :func:`socket_buffer`):
what lies there is ahead of every small frame, so plain TCP links to this host ask for
``LOCAL_SOCKET_BUFFER``, TLS links and links to other hosts for ``SOCKET_BUFFER``, and
``AIOCOLLECT_SOCKET_BUFFER`` overrides both. Checked on real loopback connections by
reading the sockets back (Linux reports twice what was asked, up to its own limits, so
every expectation is what a fresh socket reports for the same request)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from aiocollect.testing.certs import make_certs
from aiocollect.testing.link_suite import Recorder, tcp_pair
from aiocollect.transport import sockets, tcp

pytestmark = pytest.mark.timeout(60)


def _granted(size: int) -> tuple[int, int]:
    """(SO_SNDBUF, SO_RCVBUF) the kernel reports for a TCP socket asked for ``size``."""
    with socket.socket() as probe:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            probe.setsockopt(socket.SOL_SOCKET, opt, size)
        return (
            probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        )


def _buffers(link: object) -> tuple[int, int]:
    assert isinstance(link, tcp.StreamLink)
    assert link.transport is not None
    sock = link.transport.get_extra_info("socket")
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
    )


def test_the_policy_by_locality_and_override(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sockets, "_WARNED", set())
    assert sockets.socket_buffer(True, env={}) == sockets.LOCAL_SOCKET_BUFFER
    assert sockets.socket_buffer(True, tls=True, env={}) == sockets.SOCKET_BUFFER
    assert sockets.socket_buffer(False, env={}) == sockets.SOCKET_BUFFER
    assert sockets.socket_buffer(None, env={}) == sockets.SOCKET_BUFFER
    assert sockets.LOCAL_SOCKET_BUFFER < sockets.SOCKET_BUFFER
    env = {sockets.SOCKET_BUFFER_ENV: "262144"}
    assert sockets.socket_buffer(True, env=env) == sockets.socket_buffer(False, env=env) == 262144
    assert sockets.socket_buffer(True, tls=True, env=env) == 262144
    assert sockets.socket_buffer(True, env={sockets.SOCKET_BUFFER_ENV: "0"}) == 0
    with caplog.at_level(logging.WARNING, logger="aiocollect.transport.tcp"):
        for bad in ("lots", "-5", "1.5", "lots"):  # each link asks: one warning per value
            assert sockets.socket_buffer(True, env={sockets.SOCKET_BUFFER_ENV: bad}) == (
                sockets.LOCAL_SOCKET_BUFFER
            )
    assert caplog.text.count(sockets.SOCKET_BUFFER_ENV) == 3, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aiocollect.transport.tcp"):
        for small in ("4096", "65535", "4096"):  # below the minimum: raised, one warning each
            assert sockets.socket_buffer(True, env={sockets.SOCKET_BUFFER_ENV: small}) == (
                sockets.MIN_SOCKET_BUFFER
            )
        env = {sockets.SOCKET_BUFFER_ENV: str(sockets.MIN_SOCKET_BUFFER)}
        assert sockets.socket_buffer(False, env=env) == sockets.MIN_SOCKET_BUFFER
    assert caplog.text.count("raised to") == 2, caplog.text


#: A size below Linux's default cap on what a socket may ask for (``net.core.wmem_max`` and
#: ``rmem_max``, 208 KiB unless raised), so that what a socket reports tells it apart from
#: ``SOCKET_BUFFER`` on any host, not only on one whose caps were raised.
_SMALL = 96 * 1024


async def test_a_loopback_link_gets_the_local_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sockets.SOCKET_BUFFER_ENV, raising=False)
    async with tcp_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert a.caps.local
        assert b.caps.local
        assert _buffers(a) == _buffers(b) == _granted(sockets.LOCAL_SOCKET_BUFFER)
    # The local size is the one that decides (a host with default caps grants 1 MiB and
    # 4 MiB requests alike: a size under the cap tells them apart).
    monkeypatch.setattr(sockets, "LOCAL_SOCKET_BUFFER", _SMALL)
    assert _granted(_SMALL) != _granted(sockets.SOCKET_BUFFER), "the host caps buffers below 96 KiB"
    async with tcp_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert _buffers(a) == _buffers(b) == _granted(_SMALL)


async def test_the_environment_overrides_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sockets.SOCKET_BUFFER_ENV, str(2 * _SMALL))
    assert _granted(2 * _SMALL) != _granted(sockets.LOCAL_SOCKET_BUFFER)
    async with tcp_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert _buffers(a) == _buffers(b) == _granted(2 * _SMALL)


async def test_a_loopback_tls_link_keeps_the_larger_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(sockets.SOCKET_BUFFER_ENV, raising=False)
    monkeypatch.setattr(sockets, "LOCAL_SOCKET_BUFFER", _SMALL)  # (told apart on any host)
    certs = make_certs(tmp_path, 2)
    server, client = certs.config(1).server, certs.config(0).client
    async with tcp_pair(server, client)(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert a.caps.local
        assert _buffers(a) == _buffers(b) == _granted(sockets.SOCKET_BUFFER)
        assert _buffers(a) != _granted(_SMALL)
