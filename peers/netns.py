"""Hosts on one machine: network namespaces on a bridge, with addresses from 198.18.0.0/15.

Used by the cross-host test (``tests/test_namespaces.py``) and the WAN benchmark (``benchmarks/wan.py``),
which also limits each host's link with ``tc`` tbf (:meth:`Hosts.limit`): bandwidth only, since the
netem qdisc (latency) is not available on every kernel.

198.18.0.0/15 is the range set aside for network benchmarks (RFC 2544); go-multiaddr calls it
unroutable, so libp2p's own routing keeps no addresses of it, exactly as for hosts on the internet
that it cannot classify. Every name carries a random tag, so concurrent runs do not collide, and
:meth:`Hosts.close` removes everything :meth:`Hosts.create` made (and nothing else).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from typing import List, Sequence

__all__ = ["Hosts", "NamespacesUnavailable", "namespaces_unavailable", "TBF_BURST_BYTES"]

TBF_BURST_BYTES = 64 * 1024  # tbf bucket: a few packets' worth above the rate, as a home router allows


class NamespacesUnavailable(RuntimeError):
    """This process cannot make network namespaces (not root, no ``ip``, or the kernel refused)."""


def namespaces_unavailable() -> str:
    """Why namespaces cannot be made here, or "" if they probably can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return ""


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        raise NamespacesUnavailable(f"{' '.join(command)}: {result.stderr.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


@dataclass
class Hosts:
    """``count`` namespaces, each one host with one address, joined by a bridge in the root namespace,
    which has an address of the same /24 too (so the test process is a host of that network)."""

    count: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    subnet: str = field(default_factory=lambda: f"198.{random.choice((18, 19))}.{random.randrange(256)}")
    namespaces: List[str] = field(default_factory=list)
    links: List[str] = field(default_factory=list)  # the bridge-side ends of the veth pairs
    _bridge_made: bool = False

    @property
    def bridge(self) -> str:
        return f"sw{self.tag}br"

    @property
    def root_address(self) -> str:
        return f"{self.subnet}.1"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{10 + host}"

    def prefix(self, host: int) -> Sequence[str]:
        """The command prefix that runs a process on ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def inside(self, host: int) -> str:
        """The name of ``host``'s interface, inside its namespace."""
        return f"sw{self.tag}h{host}"

    def limit(self, host: int, mbit: float) -> None:
        """Limit ``host``'s link to ``mbit`` Mbit/s each way: tbf on its own interface (upload) and on the
        bridge's end of its veth (download)."""
        rate = ["rate", f"{mbit}mbit", "burst", str(TBF_BURST_BYTES), "latency", "200ms"]
        _run(["ip", "netns", "exec", self.namespaces[host], "tc", "qdisc", "replace", "dev", self.inside(host),
              "root", "tbf", *rate])
        _run(["tc", "qdisc", "replace", "dev", self.links[host], "root", "tbf", *rate])

    def tx_bytes(self, host: int) -> int:
        """Bytes ``host`` has sent on its link so far."""
        result = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "cat",
                                 f"/sys/class/net/{self.inside(host)}/statistics/tx_bytes"],
                                capture_output=True, text=True, timeout=10)
        return int(result.stdout.strip() or 0)

    def create(self) -> "Hosts":
        reason = namespaces_unavailable()
        if reason:
            raise NamespacesUnavailable(reason)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in range(self.count):
                self._add_host(host)
        except Exception:
            self.close()
            raise
        return self

    def _add_host(self, host: int) -> None:
        namespace, inside, outside = f"sw{self.tag}n{host}", f"sw{self.tag}h{host}", f"sw{self.tag}p{host}"
        _ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        self.links.append(outside)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("link", "set", inside, "netns", namespace)
        _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")

    def close(self) -> None:
        """Remove the veth pairs, the namespaces and the bridge (each step ignores what is already gone)."""
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        self.links = []
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        self.namespaces = []
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)
            self._bridge_made = False
