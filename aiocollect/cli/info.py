"""``aiocollect info``: what this installation can do, for bug reports and setup checks.

Reports the aiocollect and Python versions, whether the one-frame path runs compiled (and
which modules, or why not), the event loops available, the versions of the required
libraries, which transports are available, which optional extras are installed and
which RDMA devices the kernel exposes. Nothing heavy is imported: extras are looked up in the
installed package metadata, not imported.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from aiocollect import __version__, _compiled
from aiocollect.transport import host, registry
from aiocollect.transport.interface import Transport

EXTRAS = ("torch", "redis", "ml_dtypes", "matplotlib", "pyverbs")
RDMA_SYSFS = Path("/sys/class/infiniband")


def package_version(name: str) -> str | None:
    """The installed version of distribution/module ``name``; ``"installed (version
    unknown)"`` for a module without package metadata; None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    return "installed (version unknown)" if found else None


def _default_loop() -> str:
    loop = asyncio.new_event_loop()
    try:
        cls = type(loop)
        return f"{cls.__module__}.{cls.__qualname__}"
    finally:
        loop.close()


def _transport_status(transport: Transport) -> str:
    why = transport.unavailable()
    if why is not None:
        return f"not available: {why}"
    details = transport.details()
    return f"available ({details})" if details else "available"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def rdma_devices(root: Path = RDMA_SYSFS) -> list[dict[str, Any]]:
    """The RDMA devices under ``root`` with each port's state and link layer."""
    if not root.is_dir():
        return []
    devices = []
    for device in sorted(root.iterdir()):
        ports_dir = device / "ports"
        ports = {}
        if ports_dir.is_dir():
            for port in sorted(ports_dir.iterdir()):
                ports[port.name] = {
                    "state": _read(port / "state"),
                    "link_layer": _read(port / "link_layer"),
                }
        devices.append({"name": device.name, "ports": ports})
    return devices


def core_info() -> dict[str, Any]:
    """Whether this process runs the compiled core: ``path`` (``"compiled"`` or
    ``"pure"``), ``why`` (for the pure path) and each compiled module's state."""
    modules = _compiled.status()
    compiled = all(state == "compiled" for state in modules.values())
    return {
        "path": "compiled" if compiled else "pure",
        "why": _compiled.PURE_REASON,
        "modules": modules,
    }


def collect_info() -> dict[str, Any]:
    """Everything ``aiocollect info`` reports, as JSON-serializable data."""
    return {
        "aiocollect": __version__,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "core": core_info(),
        # what the rendezvous compares to group ranks by host (two-level collectives)
        "host": host.identity(),
        "event_loop": {"asyncio_default": _default_loop(), "uvloop": package_version("uvloop")},
        "numpy": package_version("numpy"),
        "msgpack": package_version("msgpack"),
        "transports": {t.name: _transport_status(t) for t in registry.transports()},
        "extras": {name: package_version(name) for name in EXTRAS},
        "rdma_devices": rdma_devices(),
    }


def format_info(info: dict[str, Any]) -> str:
    """The human-readable report for :func:`collect_info`'s data."""
    py = info["python"]
    loop = info["event_loop"]
    uvloop = (
        f"uvloop {loop['uvloop']} installed (uvloop.run(main()) to use it)"
        if loop["uvloop"]
        else "uvloop not installed"
    )
    lines = [
        f"aiocollect   {info['aiocollect']}",
        f"python       {py['version']} ({py['implementation']}) {py['executable']}",
        f"platform     {info['platform']}",
        _core_line(info["core"]),
        f"host         {info['host']['hostname']} (boot id {info['host']['boot_id'] or 'none'}:"
        " ranks with both equal share a host)",
        f"event loop   asyncio default: {loop['asyncio_default']}; {uvloop}",
        f"numpy        {info['numpy'] or 'not installed'}",
        f"msgpack      {info['msgpack'] or 'not installed'}",
    ]
    lines += _block("transports", {k: v for k, v in info["transports"].items()})
    lines += _block("extras", {k: v or "not installed" for k, v in info["extras"].items()})
    devices = info["rdma_devices"]
    if not devices:
        lines.append("rdma devices none")
    for i, device in enumerate(devices):
        ports = (
            ", ".join(
                f"port {p}: {s['state']} ({s['link_layer']})" for p, s in device["ports"].items()
            )
            or "no ports"
        )
        lines.append(
            f"{'rdma devices' if i == 0 else ''}{' ' * (13 if i else 1)}{device['name']}: {ports}"
        )
    return "\n".join(lines)


def _core_line(core: dict[str, Any]) -> str:
    if core["path"] == "compiled":
        names = ", ".join(m.removeprefix("aiocollect.") for m in core["modules"])
        return f"core         compiled (mypyc): {names}; {_compiled.PURE_ENV}=1 turns it off"
    return f"core         pure Python: {core['why'] or 'modules not compiled'}"


def _block(title: str, entries: dict[str, str]) -> list[str]:
    width = max(len(k) for k in entries)
    return [
        f"{title if i == 0 else '':<12} {k + ':':<{width + 1}} {v}"
        for i, (k, v) in enumerate(entries.items())
    ]


def info_main(argv: Sequence[str]) -> int:
    """``aiocollect info [--json]``: print the report; returns 0.

    Raises:
        SystemExit: status 2 on bad arguments.
    """
    parser = argparse.ArgumentParser(
        prog="aiocollect info",
        description="Show what this aiocollect installation can do: versions, transports, devices.",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    ns = parser.parse_args(list(argv))
    info = collect_info()
    print(json.dumps(info, indent=2) if ns.json else format_info(info))
    return 0
