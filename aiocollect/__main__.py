"""``python -m aiocollect ...``: the same as the ``aiocollect`` command."""

from __future__ import annotations

import sys

from aiocollect.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
