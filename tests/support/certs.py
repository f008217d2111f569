"""Test certificates: :func:`aiocollect.testing.certs.make_certs`, skipping the test visibly
where they cannot be made."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiocollect.errors import UsageError
from aiocollect.testing.certs import Certs
from aiocollect.testing.certs import make_certs as _make_certs


def make_certs(d: Path, n: int) -> Certs:
    """Certificates for ``n`` ranks in ``d`` (aiocollect.testing.certs.make_certs); skips
    the calling test visibly when it cannot make them."""
    try:
        return _make_certs(d, n)
    except UsageError as exc:
        pytest.skip(f"TLS tests skipped: {exc}")
