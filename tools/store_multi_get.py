"""What one rank's read of every record costs a standalone store: the seconds an
``aiocollect store`` process takes to answer a ``multi_get`` of 1,024 records of 300 bytes
(one client on this host; median and fastest of 30)::

    PYTHONPATH=. python tools/store_multi_get.py

Not a test: one measurement (docs/design.md, *The rendezvous digest*, quotes it).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from aiocollect.store import open_store
from aiocollect.testing.many import start_store, stop_processes

RECORDS = 1024
RECORD_BYTES = 300
ROUNDS = 30


async def _measure(url: str) -> list[float]:
    store, _ = await open_store(url, rank=1, timeout=30)
    try:
        keys = [f"aiocollect/measure/rank/{r}" for r in range(RECORDS)]
        for key in keys:
            await store.set(key, b"x" * RECORD_BYTES)
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            await store.multi_get(keys, timeout=10)
            times.append(time.perf_counter() - start)
        return times
    finally:
        await store.close()


def main() -> None:
    proc, url = start_store()
    try:
        times = asyncio.run(_measure(url))
    finally:
        stop_processes([proc])
    print(
        f"multi_get of {RECORDS:,} records of {RECORD_BYTES} bytes: median "
        f"{statistics.median(times) * 1e3:.1f} ms, fastest {min(times) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
