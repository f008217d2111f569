"""free_port draws its ports from below the kernel's ephemeral range, so that no port-0
bind or outgoing connection of another process takes the port before its listener starts."""

from __future__ import annotations

import socket

import pytest

from aiocollect import _net
from aiocollect.testing import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]"])
def test_the_port_is_below_the_ephemeral_range_and_binds(host: str) -> None:
    lowest = _net._ephemeral_range()[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(20):
        port = free_port(host)
        assert _net.LOWEST_DRAWN <= port < lowest
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), port))


def test_an_address_of_another_machine_gets_a_port_free_on_every_interface() -> None:
    port = free_port("192.0.2.1")  # TEST-NET-1: never an address of this machine
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    lowest, highest = _net._ephemeral_range()  # where the kernel picks
    monkeypatch.setattr(_net, "_ephemeral_range", lambda: (_net.LOWEST_DRAWN + 4, highest))
    assert lowest <= free_port() <= highest
