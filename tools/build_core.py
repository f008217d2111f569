"""Build the compiled core: the modules in ``aiocollect._compiled.MODULES``, with mypyc.

    python tools/build_core.py            # build unless the stamp says it is current
    python tools/build_core.py --force    # build anyway
    python tools/build_core.py --clean    # remove the built modules: the pure path
    python tools/build_core.py --strict   # exits 1 unless the compiled modules load

``make compiled`` runs it (``make install`` does not: docs/benchmarks.md, *The compiled
core*, has the figures). It writes an extension module
beside each compiled source and one shared library, ``aiocollect/_core__mypyc*.so`` (all
ignored by git, so neither the sdist nor the wheel carries them: an installed wheel runs
the pure path). Python imports them instead of the sources; ``AIOCOLLECT_PURE=1`` turns them
off, and a source edited after the build turns them all off until the next build
(``aiocollect/_compiled.py``). ``aiocollect info`` says which path a process takes.

A build takes minutes of CPU (mypy analyses what the modules import, then a C compiler
compiles the generated C): about 4 minutes of CPU here. So it is skipped when
``build/mypyc/stamp`` holds the hash of the sources, the Python and mypy versions and the
build's options, and every built module is there. Without a C compiler, mypyc or setuptools it
prints why and exits 0 (the pure path stays), as it does when mypyc rejects a module or
the compiler fails; ``--strict`` exits 1 then, and also when a fresh Python process does
not load the built modules (``make test-compiled``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "mypyc"
STAMP = BUILD / "stamp"


def _load_compiled() -> ModuleType:
    """``aiocollect/_compiled.py`` on its own (not the package, whose import would load the
    modules this script replaces)."""
    spec = importlib.util.spec_from_file_location(
        "_aiocollect_compiled", ROOT / "aiocollect" / "_compiled.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(sources: list[Path]) -> str:
    import mypy.version

    h = hashlib.sha256()
    h.update(sys.version.encode())
    h.update(mypy.version.__version__.encode())
    h.update(_SETUP.encode())
    for path in sources:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _built(compiled: ModuleType) -> list[Path]:
    """Every extension module a build made that is there now."""
    paths = [compiled.extension_path(m) for m in (*compiled.MODULES, compiled.SHARED_LIB)]
    return [p for p in paths if p is not None]


def clean(compiled: ModuleType) -> None:
    """Remove the built extension modules and the stamp."""
    for path in _built(compiled):
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    STAMP.unlink(missing_ok=True)


def missing_tools() -> str | None:
    """Why this machine cannot build (None: it can)."""
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (it comes with mypy: the lint extra)"
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) on PATH"
    return None


#: The build, run in a child process (setuptools' command line); part of the stamp's hash.
_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
sys.argv[1:] = ["build_ext", "--inplace", "--build-temp", {temp!r}, "--build-lib", {lib!r}]
setup(
    name="aiocollect-core",
    ext_modules=mypycify(
        ["--cache-dir", {cache!r}, *{sources!r}],
        opt_level="3", debug_level="0", group_name="aiocollect._core", target_dir={c!r},
    ),
)
"""


def build(compiled: ModuleType) -> bool:
    """Compile :data:`MODULES` in place. Returns whether every module was built."""
    sources = [compiled.source_path(m).relative_to(ROOT).as_posix() for m in compiled.MODULES]
    script = _SETUP.format(
        temp=str(BUILD / "temp"),
        lib=str(BUILD / "lib"),
        cache=str(BUILD / "mypy-cache"),
        sources=sources,
        c=str(BUILD / "c"),
    )
    BUILD.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        print(result.stdout[-4000:] + result.stderr[-4000:])
        return False
    return len(_built(compiled)) == len(compiled.MODULES) + 1


def verify() -> str | None:
    """Why a fresh Python process here would not run the compiled modules (None: it
    would)."""
    probe = "import aiocollect._compiled as c; print(c.PURE_REASON or '')"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        return result.stderr.strip()[-2000:]
    return result.stdout.strip() or None


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/build_core.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--force", action="store_true", help="build even if the stamp matches")
    parser.add_argument("--clean", action="store_true", help="remove the built modules")
    parser.add_argument("--strict", action="store_true", help="exit 1 where it cannot build")
    ns = parser.parse_args()
    compiled = _load_compiled()
    if ns.clean:
        clean(compiled)
        return 0
    why = missing_tools()
    if why is not None:
        print(f"compiled core skipped: {why}; the pure-Python path is used")
        return 1 if ns.strict else 0
    sources = [compiled.source_path(m) for m in compiled.MODULES]
    digest = _digest(sources)
    current = STAMP.exists() and STAMP.read_text() == digest
    built = _built(compiled)
    if current and not ns.force and len(built) == len(sources) + 1:
        # The sources hash as built (a checkout or an edit that was undone may have made
        # them newer than the library): mark the library current for aiocollect/_compiled.py.
        os.utime(built[-1])
        print("compiled core is current (build/mypyc/stamp)")
        return _verified(ns.strict)
    clean(compiled)
    print(f"compiling {', '.join(compiled.MODULES)} with mypyc (minutes)")
    start = time.monotonic()
    if not build(compiled):
        clean(compiled)
        print("compiled core: the build failed (above); the pure-Python path is used")
        return 1 if ns.strict else 0
    STAMP.write_text(digest)
    print(f"compiled core built in {time.monotonic() - start:.0f} s")
    return _verified(ns.strict)


def _verified(strict: bool) -> int:
    if not strict:
        return 0
    why = verify()
    if why is not None:
        print(f"compiled core not in use: {why}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
