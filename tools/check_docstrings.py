"""Check the public API's docstrings: every public name has one, and every parameter is in it.

The public API is every name in the ``__all__`` of the modules listed in ``MODULES`` (the
ones the reference pages under docs/reference/ render), with the public methods and
properties of the public classes among them. For each of those the check fails on:

- a missing docstring;
- a parameter of the function, method or constructor that its docstring's ``Args:``
  section does not name (a constructor's parameters may be in the class docstring or in
  ``__init__``'s; a dataclass's fields may also be in an ``Attributes:`` section or carry
  a docstring of their own; a method that overrides one of an aiocollect base class may
  leave out the parameters that the base method's ``Args:`` documents);
- a name in an ``Args:`` section that is no parameter of the signature;
- a public name that no page under docs/reference/ renders (``::: module.name``, or
  ``::: module`` with the name in its ``members:`` list or no such list).

The source is read statically with griffe (what mkdocstrings renders), so torch need not be
installed. ``make docs`` runs it before building the site::

    python tools/check_docstrings.py            # exit status 1 and one line per problem
    python tools/check_docstrings.py aiocollect.store   # only these modules
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"

#: The modules whose ``__all__`` is the public API (docs/reference/ has a page for each).
MODULES = (
    "aiocollect",
    "aiocollect.testing",
    "aiocollect.torch",
    "aiocollect.store",
    "aiocollect.tls",
)

_ARGS = (griffe.DocstringSectionKind.parameters, griffe.DocstringSectionKind.other_parameters)
_SKIPPED_PARAMETERS = {"self", "cls"}


def _sections(obj: griffe.Object) -> list[griffe.DocstringSection]:
    if obj.docstring is None:
        return []
    return obj.docstring.parse("google")


def _documented(obj: griffe.Object, kinds: tuple[griffe.DocstringSectionKind, ...]) -> set[str]:
    names: set[str] = set()
    for section in _sections(obj):
        if section.kind in kinds:
            names.update(item.name.lstrip("*") for item in section.value)
    return names


def _parameters(func: griffe.Function) -> list[str]:
    names = [p.name for p in func.parameters]
    if (
        func.parent is not None
        and func.parent.is_class
        and names
        and "staticmethod" not in (func.labels)
    ):
        names = names[1:]  # self or cls, whatever it is called
    return [n for n in names if n not in _SKIPPED_PARAMETERS]


def _inherited(func: griffe.Function) -> set[str]:
    """The parameters documented by the methods ``func`` overrides (aiocollect's own)."""
    parent = func.parent
    if not isinstance(parent, griffe.Class):
        return set()
    names: set[str] = set()
    for base in parent.mro():
        overridden = base.members.get(func.name)
        if isinstance(overridden, griffe.Function):
            names |= _documented(overridden, _ARGS)
    return names


def _check_function(func: griffe.Function, label: str) -> Iterator[str]:
    if not func.docstring:
        yield f"{label}: no docstring"
        return
    wanted = _parameters(func)
    own = _documented(func, _ARGS)
    documented = own | _inherited(func)
    for name in wanted:
        if name not in documented:
            yield f"{label}: parameter {name!r} is not in its docstring's Args section"
    for name in sorted(own - set(wanted)):
        yield f"{label}: Args names {name!r}, which is not a parameter"


def _check_class(cls: griffe.Class, label: str) -> Iterator[str]:
    if not cls.docstring:
        yield f"{label}: no docstring"
    init = cls.members.get("__init__")
    dataclass = "dataclass" in cls.labels
    if isinstance(init, griffe.Function) or dataclass:
        documented = _documented(cls, _ARGS)
        if isinstance(init, griffe.Function) and not init.is_alias:
            documented |= _documented(init, _ARGS)
            wanted = _parameters(init)
        else:
            wanted = [p.name for p in cls.parameters if p.name not in _SKIPPED_PARAMETERS]
        if dataclass:
            documented |= _documented(cls, (griffe.DocstringSectionKind.attributes,))
            documented |= {
                name
                for name, member in cls.members.items()
                if isinstance(member, griffe.Attribute) and member.docstring
            }
        for name in wanted:
            if name not in documented:
                yield f"{label}: constructor parameter {name!r} is not documented"
    for name, member in cls.members.items():
        if name.startswith("_") or member.is_alias:
            continue
        if isinstance(member, griffe.Function):
            yield from _check_function(member, f"{label}.{name}")
        elif (
            isinstance(member, griffe.Attribute)
            and "property" in member.labels
            and not member.docstring
        ):
            yield f"{label}.{name}: no docstring (property)"


def blocks(pages: Path = REFERENCE) -> dict[str, set[str] | None]:
    """The ``::: identifier`` blocks of the reference pages.

    Args:
        pages: the folder of reference pages (Markdown).

    Returns:
        Each block's identifier, with its ``members:`` option (None when it has none: every
        public member is rendered).
    """
    found: dict[str, set[str] | None] = {}
    for page in sorted(pages.glob("*.md")):
        current = None
        in_members = False
        for line in page.read_text().splitlines():
            block = re.match(r"^::: *([\w.]+)", line)
            if block:
                current = block.group(1)
                found.setdefault(current, None)
                in_members = False
            elif current and re.match(r"^\s+members:\s*$", line):
                in_members = True
                found[current] = set()
            elif current and in_members and re.match(r"^\s+- ", line):
                listed = found[current]
                assert listed is not None
                listed.add(line.strip()[2:].strip())
            elif line.strip() and not line.startswith(" "):
                current, in_members = None, False
    return found


def _get(package: griffe.Module, path: str) -> griffe.Object:
    """The object at a dotted ``path`` under ``package``, aliases followed."""
    obj = package if path == package.path else package[path.removeprefix(package.path + ".")]
    return obj.final_target if obj.is_alias else obj


def _rendered(package: griffe.Module) -> set[str]:
    """The paths of the objects (aliases followed) that the reference pages render."""
    paths: set[str] = set()
    for ident, members in blocks().items():
        obj = _get(package, ident)
        paths.add(obj.path)
        if isinstance(obj, griffe.Module):
            names = obj.exports or [
                n for n, m in obj.members.items() if not n.startswith("_") and not m.is_alias
            ]
            for name in names:
                if members is None or name in members:
                    paths.add(_get(package, f"{obj.path}.{name}").path)
    return paths


def problems(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Every problem in the public API of ``modules``, one line each, sorted.

    Args:
        modules: dotted names of the modules whose ``__all__`` is checked.

    Returns:
        Lines ``"public.name: what is wrong"``; empty when every docstring is complete.
    """
    logging.getLogger("griffe").setLevel(logging.ERROR)
    package = griffe.load("aiocollect", search_paths=[str(ROOT)], docstring_parser="google")
    rendered = _rendered(package)
    found: set[str] = set()
    seen: set[str] = set()
    for modname in modules:
        module = package if modname == "aiocollect" else package[modname.split(".", 1)[1]]
        for name in module.exports or ():
            member = module[name]
            target = member.final_target if member.is_alias else member
            if target.path not in rendered:
                found.add(f"{modname}.{name}: no page under docs/reference/ renders it")
            if target.path in seen:
                continue
            seen.add(target.path)
            label = f"{modname}.{name}"
            if isinstance(target, griffe.Class):
                found.update(_check_class(target, label))
            elif isinstance(target, griffe.Function):
                found.update(_check_function(target, label))
            elif not target.docstring:
                found.add(f"{label}: no docstring")
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    """Print every problem; exit status 1 if there is any, else 0.

    Args:
        argv: the command line without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="tools/check_docstrings.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("modules", nargs="*", help=f"modules to check (default: {MODULES})")
    ns = parser.parse_args(argv)
    found = problems(tuple(ns.modules) or MODULES)
    for line in found:
        print(line)
    if found:
        print(f"check_docstrings: {len(found)} problem(s)", file=sys.stderr)
        return 1
    print("check_docstrings: every public name is documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
