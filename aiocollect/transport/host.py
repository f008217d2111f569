"""Which host a rank runs on, as rendezvous records say: its hostname and the kernel's
boot id (two containers on one machine share the boot id; a rebooted machine does not)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any


def boot_id() -> str:
    """The kernel's boot id, or "" where there is none (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def identity() -> dict[str, str]:
    """This host's fields of a rendezvous record: ``hostname`` and ``boot_id``."""
    return {"hostname": socket.gethostname(), "boot_id": boot_id()}


def same_host(rec: Mapping[str, Any]) -> bool:
    """Whether a rendezvous record comes from this machine (same hostname and boot id)."""
    mine = boot_id()
    return bool(mine) and rec.get("boot_id") == mine and rec.get("hostname") == socket.gethostname()
