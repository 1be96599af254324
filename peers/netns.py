"""Hosts on one machine: network namespaces on a bridge, with addresses from 198.18.0.0/15.

Used by the cross-host tests (``tests/test_namespaces.py``, ``tests/test_reachability_live.py``) and the
WAN benchmark (``benchmarks/wan.py``), which also limits each host's link with ``tc`` tbf
(:meth:`Hosts.limit`): bandwidth only, since the netem qdisc (latency) is not available on every kernel.

The bridge lives in a namespace of its own (the "switch"), not in the root namespace: traffic between
hosts then never passes the root namespace's firewall, which on a machine running Docker drops
forwarded and bridged packets (its FORWARD policy is drop and bridged frames go through it). The root
namespace joins the bridge through one more veth pair, with an address of the same /24, so the test
process is a host of that network too.

198.18.0.0/15 is the range set aside for network benchmarks (RFC 2544); go-multiaddr calls it
unroutable, so libp2p's own routing keeps no addresses of it, exactly as for hosts on the internet
that it cannot classify. Every name carries a random tag, so concurrent runs do not collide, and
:meth:`Hosts.close` removes everything :meth:`Hosts.create` made (and nothing else).

The kernel keeps one ARP table for all namespaces, and by default it refuses new entries past 1,024
(``gc_thresh3``): 33 hosts that all talk to each other need more, and a host that cannot add its neighbour
gets "No route to host". So :meth:`Hosts.create` raises the table's limits to what its hosts can need, and
:meth:`Hosts.close` puts back the values it found, unless someone has changed them since.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

__all__ = ["Hosts", "NamespacesUnavailable", "namespaces_unavailable", "TBF_BURST_BYTES"]

TBF_BURST_BYTES = 64 * 1024  # tbf bucket: a few packets' worth above the rate, as a home router allows
NEIGHBOUR_LIMITS = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"  # 2: soft limit of ARP entries, 3: hard limit


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
    """``count`` namespaces, each one host with one address, joined by a bridge in a switch namespace,
    which the root namespace joins too with an address of the same /24."""

    count: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    subnet: str = field(default_factory=lambda: f"198.{random.choice((18, 19))}.{random.randrange(256)}")
    namespaces: List[str] = field(default_factory=list)
    links: List[str] = field(default_factory=list)  # the bridge-side ends of the veth pairs (in the switch)
    _switch_made: bool = False
    _raised_limits: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # path -> (value found, value set)

    @property
    def bridge(self) -> str:
        return f"sw{self.tag}br"

    @property
    def switch(self) -> str:
        """The namespace that holds the bridge."""
        return f"sw{self.tag}s"

    @property
    def root_link(self) -> str:
        """The root namespace's end of its veth pair to the bridge."""
        return f"sw{self.tag}r"

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
        _run(
            [
                "ip",
                "netns",
                "exec",
                self.namespaces[host],
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.inside(host),
                "root",
                "tbf",
                *rate,
            ]
        )
        _run(
            [
                "ip",
                "netns",
                "exec",
                self.switch,
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.links[host],
                "root",
                "tbf",
                *rate,
            ]
        )

    def _link_tx_bytes(self, namespace: str, link: str) -> int:
        result = subprocess.run(
            ["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{link}/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(result.stdout.strip() or 0)

    def tx_bytes(self, host: int) -> int:
        """Bytes ``host`` has sent on its link so far."""
        return self._link_tx_bytes(self.namespaces[host], self.inside(host))

    def rx_bytes(self, host: int) -> int:
        """Bytes the bridge has sent to ``host`` so far (what ``host`` received)."""
        return self._link_tx_bytes(self.switch, self.links[host])

    def unroutable_address(self, host: int) -> str:
        """Give ``host`` a second address that no other host has a route to, and return it.

        A process on ``host`` that listens only on this address accepts no incoming connections (from
        any other host, a connect fails with "no route"), yet connects out as usual through its link,
        with the link's address as source: a host behind NAT, as the rest of the network sees it."""
        octet = 19 if self.subnet.startswith("198.18.") else 18  # the other /16 of the range: no host routes there
        address = f"198.{octet}.{self.subnet.split('.')[2]}.{10 + host}"
        _ip("-n", self.namespaces[host], "addr", "add", f"{address}/32", "dev", "lo")
        return address

    def create(self) -> "Hosts":
        reason = namespaces_unavailable()
        if reason:
            raise NamespacesUnavailable(reason)
        try:
            _ip("netns", "add", self.switch)
            self._switch_made = True
            _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", self.bridge, "up")
            _ip("link", "add", self.root_link, "type", "veth", "peer", "name", f"sw{self.tag}q")
            _ip("link", "set", f"sw{self.tag}q", "netns", self.switch)
            self._attach(f"sw{self.tag}q")
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.root_link)
            _ip("link", "set", self.root_link, "up")
            for host in range(self.count):
                self._add_host(host)
            self._make_room_for_neighbours()
        except Exception:
            self.close()
            raise
        return self

    def _attach(self, link: str) -> None:
        """Plug ``link`` (already in the switch namespace) into the bridge."""
        _ip("-n", self.switch, "link", "set", link, "master", self.bridge)
        _ip("-n", self.switch, "link", "set", link, "up")

    def _add_host(self, host: int) -> None:
        namespace, inside, outside = f"sw{self.tag}n{host}", self.inside(host), f"sw{self.tag}p{host}"
        _ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        _ip("-n", self.switch, "link", "add", outside, "type", "veth", "peer", "name", inside)
        self.links.append(outside)
        self._attach(outside)
        _ip("-n", self.switch, "link", "set", inside, "netns", namespace)
        _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")

    def _make_room_for_neighbours(self) -> None:
        """Raise the ARP table's soft and hard limits to what every host (and the root) knowing every other
        needs, with room for another such set; lower limits are never set."""
        needed = (self.count + 1) ** 2
        for level, wanted in ((2, needed), (3, 2 * needed)):
            path = NEIGHBOUR_LIMITS.format(level)
            try:
                with open(path) as f:
                    found = int(f.read())
                if found < wanted:
                    with open(path, "w") as f:
                        f.write(str(wanted))
                    self._raised_limits[path] = (found, wanted)
            except (OSError, ValueError) as e:  # hosts that talk to few others still work
                print(f"could not raise {path} to {wanted}: {e}")

    def _restore_neighbour_limits(self) -> None:
        for path, (found, raised) in self._raised_limits.items():
            try:
                with open(path) as f:
                    if int(f.read()) != raised:  # changed by someone else since: theirs now
                        continue
                with open(path, "w") as f:
                    f.write(str(found))
            except (OSError, ValueError):
                pass
        self._raised_limits = {}

    def close(self) -> None:
        """Remove the namespaces (with them every veth pair and the bridge) and the root's veth
        (each step ignores what is already gone), and put back the ARP table's limits."""
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        self.namespaces, self.links = [], []
        subprocess.run(["ip", "link", "del", self.root_link], capture_output=True, timeout=10)
        if self._switch_made:
            subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, timeout=10)
            self._switch_made = False
        self._restore_neighbour_limits()
