"""Which modules of the one-frame path run compiled, and the switch back to pure Python.

``make compiled`` (run by ``make install`` where a C compiler is present;
``tools/build_core.py``) compiles the modules in :data:`MODULES` with mypyc into extension
modules beside their sources, and one shared library (``aiocollect/_core__mypyc*.so``) that
holds their code. Python imports an extension module before a source file of the same
name, so a built tree runs compiled with nothing else to do. This module, imported first by
``aiocollect/__init__.py``, decides once per process, before any of those modules is
imported, whether they load compiled or from their sources:

- pure when ``AIOCOLLECT_PURE`` is set to anything but ``""`` or ``"0"`` (tests and A/B
  timings of both paths in one tree);
- pure when a source is newer than the shared library (a stale build: the edited source
  runs, never old compiled code), or when an extension module is missing;
- compiled otherwise.

It is all or nothing: compiled modules reach each other's classes directly, so one of them
compiled beside another loaded from its source would not work. :func:`status` says which
path this process took and why (``aiocollect info``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

#: The modules ``make compiled`` compiles (every one builds with mypyc and passes the
#: suites compiled). What subclasses asyncio's types stays Python (the one-frame handle,
#: engine/handle.py, and the links), and so does what Python classes subclass
#: (``engine.op.Op``, which ``engine.phase.Phase`` extends; the links' ``Mailbox``).
MODULES = (
    "aiocollect.engine.small",
    "aiocollect.engine.op_registry",
    "aiocollect.transport.wire",
)
#: The environment variable that forces the pure-Python path.
PURE_ENV = "AIOCOLLECT_PURE"
#: The mypyc group's shared library, a module of the package.
SHARED_LIB = "aiocollect._core__mypyc"

_PACKAGE_DIR = Path(__file__).parent


def source_path(module: str) -> Path:
    """The source file of ``module`` (one of :data:`MODULES`)."""
    return _PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")


def extension_path(module: str) -> Path | None:
    """The extension module built for ``module`` beside its source, if there is one."""
    base = _PACKAGE_DIR.joinpath(*module.split(".")[1:])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = base.with_name(base.name + suffix)
        if path.exists():
            return path
    return None


def _pure_reason(environ: Mapping[str, str]) -> str | None:
    """Why this process runs the pure path (None: it runs compiled)."""
    if environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV} is set"
    built = [extension_path(m) for m in (*MODULES, SHARED_LIB)]
    if all(path is None for path in built):
        return "not built (make compiled)"
    missing = [m for m, path in zip((*MODULES, SHARED_LIB), built, strict=True) if path is None]
    if missing:
        return f"incomplete build, missing {', '.join(missing)} (make compiled)"
    # The code is in the shared library, linked by every build that changed a module (a
    # module's own extension is a stub that the build leaves alone).
    lib = built[-1]
    assert lib is not None
    linked = lib.stat().st_mtime
    stale = [m for m in MODULES if source_path(m).stat().st_mtime > linked]
    if stale:
        return f"stale build: {', '.join(stale)} changed since (make compiled)"
    return None


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds :data:`MODULES` at their source files, ahead of the extension modules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


#: Why this process runs the pure path, or None where it runs compiled (decided on import).
PURE_REASON = _pure_reason(os.environ)
if PURE_REASON is not None and not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceFinder())


def status() -> dict[str, str]:
    """Each module of :data:`MODULES` with ``"compiled"`` or ``"pure"`` as this process
    loaded it (importing those not imported yet)."""
    out = {}
    for name in MODULES:
        module = importlib.import_module(name)
        loader = getattr(module.__spec__, "loader", None)
        compiled = isinstance(loader, importlib.machinery.ExtensionFileLoader)
        out[name] = "compiled" if compiled else "pure"
    return out
