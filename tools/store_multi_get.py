"""What one rank's read of every record costs a standalone store: the seconds an
``aiocollect store`` process takes to answer a ``multi_get`` of 1,024 records of 300 bytes
(one client on this host; median and fastest of 30)::

    PYTHONPATH=. python tools/store_multi_get.py
    PYTHONPATH=. python tools/store_multi_get.py --records 4096 --rounds 10

It starts the store (``aiocollect store`` on a free loopback port), writes the records
once from one client, times ``--rounds`` reads of all of them with one ``multi_get`` each,
prints one line and stops the store. The store's time per record read is what a
rendezvous costs it when every rank reads every record: multiply by the ranks that do.

Not a test: one measurement (docs/design.md, *The rendezvous digest*, quotes it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from aiocollect.store import open_store
from aiocollect.testing.many import start_store, stop_processes

RECORDS = 1024
RECORD_BYTES = 300
ROUNDS = 30


async def _measure(url: str, records: int, rounds: int) -> list[float]:
    store, _ = await open_store(url, rank=1, timeout=30)
    try:
        keys = [f"aiocollect/measure/rank/{r}" for r in range(records)]
        for key in keys:
            await store.set(key, b"x" * RECORD_BYTES)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            await store.multi_get(keys, timeout=10)
            times.append(time.perf_counter() - start)
        return times
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="PYTHONPATH=. python tools/store_multi_get.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--records", type=int, default=RECORDS, help="records per read")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="reads timed")
    ns = parser.parse_args()
    if ns.records < 1 or ns.rounds < 1:
        parser.error("--records and --rounds must be at least 1")
    proc, url = start_store()
    try:
        times = asyncio.run(_measure(url, ns.records, ns.rounds))
    finally:
        stop_processes([proc])
    print(
        f"multi_get of {ns.records:,} records of {RECORD_BYTES} bytes: median "
        f"{statistics.median(times) * 1e3:.1f} ms, fastest {min(times) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
