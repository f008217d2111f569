"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``).

The docstrings name other objects with Sphinx roles (``:class:`Store```,
``:func:`~aiocollect.store.open_store```), which mkdocstrings leaves as they are; this
hook shows each as plain code, the name only where the role says ``~``.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):<code>(~?)([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """Replace every ``:role:`name``` left in a page's HTML by ``name`` as code.

    Args:
        html: the page's HTML, after Markdown and mkdocstrings rendered it.
        **kwargs: what MkDocs passes besides (page, config, files), unused.

    Returns:
        The HTML without the roles.
    """
    return _ROLE.sub(_code, html)
