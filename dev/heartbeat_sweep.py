#!/usr/bin/env python
"""Time rank 0's heartbeat sweep at simulated world sizes, on a loopback TCPStore.

The watchdog reads every rank's counter once per interval (training/guards/watchdog.py).
This tool fills a store with N counters and times one sweep two ways: one ``check`` and
one ``get`` per rank (the former sweep), one ``multi_get`` of all counters, and
``multi_get`` in batches of 256 keys (the current sweep, the watchdog's own ``_check``).
Prints a table; nothing is written.

    python -m dev.heartbeat_sweep [--ranks 1024 4096 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from megatron.sdp4bit.training.guards import watchdog


def _per_key(store: dist.Store, n: int) -> None:
    for r in range(1, n):
        key = f"{watchdog._PREFIX}{r}"
        if store.check([key]):
            store.get(key)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=3, help="best of this many sweeps")
    args = p.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=60))
    print("ranks  per-key check+get (s)  one multi_get (s)  batched multi_get (s)")
    for n in args.ranks:
        keys = [f"{watchdog._PREFIX}{r}" for r in range(n)]
        client.multi_set(keys, [str(r) for r in range(n)])
        dog = watchdog.Watchdog(client, rank=0, world=n, timeout=3600, interval=1)
        dog._seen.update(range(1, n))  # the counters exist, as after _create_counters
        old = _best(lambda: _per_key(client, n), args.repeats)
        one = _best(lambda: client.multi_get(keys[1:]), args.repeats)
        new = _best(dog._check, args.repeats)
        print(f"{n:5d}  {old:21.3f}  {one:17.3f}  {new:21.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
