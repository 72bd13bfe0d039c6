"""Two network namespaces joined by a shaped veth pair: two "nodes" on one machine.

    node 0: namespace <prefix>-n0, veth <prefix>a, 10.213.<k>.1/24
    node 1: namespace <prefix>-n1, veth <prefix>b, 10.213.<k>.2/24

Processes started in a namespace (``ip netns exec``) reach the other node only through the
veth pair, whose two ends are shaped with a token bucket filter (``tc tbf``) at the link
rate; ranks of one node talk to each other through the namespace's local routing, at memory
speed, as the GPUs of a node do over NVLink. The addresses are private and live only inside
the namespaces this module creates; :meth:`Cluster.remove` deletes the namespaces, and with
them the veth pair, the routes and the qdiscs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float | None:
    """``'100mbit'`` -> 1e8 bits/s; ``'none'`` -> None (unshaped)."""
    text = text.strip().lower()
    if text == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text)
    if not match:
        raise ValueError(f"link rate {text!r}: use none or a number with kbit, mbit or gbit "
                         "(e.g. 1gbit, 300mbit)")
    return float(match[1]) * UNITS[match[2]]


def missing_requirements() -> str | None:
    """One line naming what this machine lacks to build the cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc): run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2 ('{tool}' not found): apt-get install iproute2"
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Node:
    namespace: str
    veth: str
    address: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def link_bytes(self) -> tuple[int, int]:
        """(tx, rx) bytes of this node's end of the link so far."""
        out = json.loads(_run("ip", "-n", self.namespace, "-j", "-s", "link", "show",
                              "dev", self.veth))
        stats = out[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


class Cluster:
    """Create with :meth:`create`; always :meth:`remove` (use it as a context manager)."""

    def __init__(self, prefix: str, subnet: int) -> None:
        self.prefix = prefix
        self.nodes = [Node(f"{prefix}-n0", f"{prefix}a", f"10.213.{subnet}.1"),
                      Node(f"{prefix}-n1", f"{prefix}b", f"10.213.{subnet}.2")]
        self._created: list[str] = []

    def __enter__(self) -> "Cluster":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def create(self) -> None:
        for node in self.nodes:
            _run("ip", "netns", "add", node.namespace)
            self._created.append(node.namespace)
            _run("ip", "-n", node.namespace, "link", "set", "lo", "up")
        a, b = self.nodes
        _run("ip", "link", "add", a.veth, "netns", a.namespace, "type", "veth", "peer",
             "name", b.veth, "netns", b.namespace)
        for node in self.nodes:
            _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev",
                 node.veth)
            _run("ip", "-n", node.namespace, "link", "set", node.veth, "up")

    def shape(self, rate_bits: float | None) -> None:
        """Shape both directions of the link at ``rate_bits`` per second (None: unshaped)."""
        for node in self.nodes:
            subprocess.run(["tc", "-n", node.namespace, "qdisc", "del", "dev", node.veth,
                            "root"], capture_output=True)  # absent the first time: fine
            if rate_bits is None:
                continue
            # A bucket of 4 ms of traffic (at least 64 KiB) and 100 ms of queue: TCP keeps
            # the link busy without drops from a too-short queue.
            burst = max(64 * 1024, int(rate_bits / 8 * 0.004))
            _run("tc", "-n", node.namespace, "qdisc", "add", "dev", node.veth, "root", "tbf",
                 "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms")

    def remove(self) -> None:
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._created = []
