"""``python -m aiocollect.store``: the standalone TCP store server (``aiocollect store``)."""

from __future__ import annotations

import sys

from aiocollect.store.tcp_command import store_main

if __name__ == "__main__":
    sys.exit(store_main(sys.argv[1:]))
