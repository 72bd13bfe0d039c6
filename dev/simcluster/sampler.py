"""Print ``<unix time> <tx bytes> <rx bytes>`` of one interface every INTERVAL seconds.

Run inside a node's namespace (``ip netns exec NS python sampler.py VETH 0.02``), where
``/sys/class/net`` shows that namespace's interfaces; stopped by a signal.
"""

from __future__ import annotations

import sys
import time


def main(dev: str, interval: float) -> None:
    base = f"/sys/class/net/{dev}/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        while True:
            tx.seek(0)
            rx.seek(0)
            print(f"{time.time():.4f} {tx.read().strip()} {rx.read().strip()}", flush=True)
            time.sleep(interval)


if __name__ == "__main__":
    try:
        main(sys.argv[1], float(sys.argv[2]))
    except KeyboardInterrupt:
        pass
