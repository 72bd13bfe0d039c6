"""Measured throughput of the link: one TCP stream from node 0 to node 1.

Run by ``simcluster`` inside the namespaces; standalone use:

    python probe.py serve ADDRESS PORT          # node 1: prints "<bytes> <seconds>"
    python probe.py send ADDRESS PORT SECONDS    # node 0: sends zeros for SECONDS

The receiver times from its first to its last byte, so connection setup is left out.
"""

from __future__ import annotations

import socket
import sys
import time

CHUNK = 1 << 20


def serve(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            first = last = None
            total = 0
            buf = bytearray(CHUNK)
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                last = time.perf_counter()
                if first is None:
                    first, n = last, 0  # the first chunk starts the clock
                total += n
    seconds = (last - first) if first is not None and last is not None else 0.0
    print(f"{total} {seconds:.6f}", flush=True)


def send(address: str, port: int, seconds: float) -> None:
    payload = bytes(CHUNK)
    deadline = time.perf_counter() + seconds
    for _ in range(100):  # the server may still be starting
        try:
            conn = socket.create_connection((address, port), timeout=10)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"probe: cannot connect to {address}:{port}")
    with conn:
        while time.perf_counter() < deadline:
            conn.sendall(payload)


if __name__ == "__main__":
    mode, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "serve":
        serve(address, port)
    else:
        send(address, port, float(sys.argv[4]))
