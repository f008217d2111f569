"""The shared-memory link's classes keep to declared interfaces (docs/design.md,
"Stream links and the shared-memory link"): its receiving half (:class:`RingReader` and
:class:`DoorbellReader`) and its sending half (:class:`RingWriter` and :class:`ShmLink`)
each read and write only underscored members the half defines itself, plus Link's
protected transport interface (``base.TRANSPORT_HOOKS``); what they use of ``StreamLink``
and of each other is public and documented."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from aiocollect.transport import shm, shm_doorbell, shm_reader, shm_writer, tcp, tcp_link
from aiocollect.transport.base import TRANSPORT_HOOKS


def _class_node(cls: type) -> ast.ClassDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    return node


def _own(node: ast.ClassDef) -> set[str]:
    """Underscored names the class defines: its methods and the attributes its
    ``__init__`` assigns (assigning one elsewhere does not make it the class's own)."""
    methods = [f for f in node.body if isinstance(f, ast.FunctionDef)]
    names = {f.name for f in methods}
    init = next(f for f in methods if f.name == "__init__")
    for sub in ast.walk(init):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and _is_self(el.value):
                    names.add(el.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _is_self(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id == "self"
    return (  # super()
        isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "super"
    )


def _used(node: ast.ClassDef) -> set[str]:
    """Underscored members the class reads, writes or calls on ``self`` or ``super()``."""
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute)
        and _is_self(sub.value)
        and sub.attr.startswith("_")
        and not sub.attr.startswith("__")
    }


@pytest.mark.parametrize(
    "half",
    [
        (shm_reader.RingReader, shm_doorbell.DoorbellReader),
        (shm_writer.RingWriter, shm.ShmLink),
    ],
    ids=["receiving", "sending"],
)
def test_uses_no_other_class_private_state(half: tuple[type, ...]) -> None:
    nodes = [_class_node(cls) for cls in half]
    own = set().union(*(_own(node) for node in nodes))
    for cls, node in zip(half, nodes, strict=True):
        foreign = _used(node) - own - TRANSPORT_HOOKS
        assert not foreign, f"{cls.__name__} uses another half's private members: {foreign}"


def test_shm_link_is_not_a_tcp_link() -> None:
    """Both are stream links; neither is the other (``isinstance(link, TcpLink)`` means a
    plain TCP link)."""
    assert issubclass(shm.ShmLink, tcp.StreamLink)
    assert not issubclass(shm.ShmLink, tcp_link.TcpLink)
