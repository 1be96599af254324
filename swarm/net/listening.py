"""Where a process listens and what its p2pd announces: concrete ports, and no addresses that reach only itself.

p2pd announces what it is told to (``announce_maddrs``), else every address of every interface it listens
on. Two things go wrong without help: hivemind refuses ``/tcp/0`` in an announced address although it is
the natural way to say "the port I listen on", and a process listening on 0.0.0.0 announces its loopback
and container-bridge addresses too, which on any other machine reach that machine itself. The decisions
are pure (:func:`resolve_ports`, :func:`wildcard_announcements`); :func:`listen_and_announce` adds the I/O.
"""

from __future__ import annotations

import socket
import struct
import sys
from typing import Callable, List, Sequence, Tuple

from hivemind.utils.multiaddr import Multiaddr

from swarm.net.addresses import announceable, tcp_port

__all__ = ["resolve_ports", "wildcard_announcements", "listen_and_announce", "free_tcp_port", "interface_addresses"]

_IPV4_ANY = "/ip4/0.0.0.0/"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _with_port(maddr: str, port: int) -> str:
    return maddr.replace("/tcp/0", f"/tcp/{port}", 1)


def free_tcp_port(host_maddr: str) -> int:
    """A TCP port free now on the interface of ``host_maddr`` (the kernel's pick, released at once)."""
    maddr = Multiaddr(host_maddr)
    names = [p.name for p in maddr.protocols()]
    if "ip6" in names:
        family, host = socket.AF_INET6, maddr.value_for_protocol("ip6")
    else:
        family, host = socket.AF_INET, maddr.value_for_protocol("ip4") if "ip4" in names else "0.0.0.0"
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _fixed(host_maddrs: Sequence[str], free_port: Callable[[str], int]) -> List[str]:
    return [_with_port(m, free_port(m)) if tcp_port(m) == 0 else m for m in host_maddrs]


def resolve_ports(
    host_maddrs: Sequence[str], announce_maddrs: Sequence[str], free_port: Callable[[str], int] = free_tcp_port
) -> Tuple[List[str], List[str]]:
    """Listen and announce addresses with ``/tcp/0`` in an announced address made concrete: there it means
    "the port this process listens on", which p2pd cannot announce (hivemind refuses port 0 there). A listen
    address on port 0 gets a port from ``free_port`` first, so that both name the same one. Without port 0
    in ``announce_maddrs`` both lists come back unchanged. ``ValueError`` when that port is ambiguous."""
    host, announce = list(host_maddrs), list(announce_maddrs)
    if not any(tcp_port(m) == 0 for m in announce):
        return host, announce
    host = _fixed(host, free_port)
    ports = {port for port in map(tcp_port, host) if port is not None}
    if len(ports) != 1:
        raise ValueError(
            f"announce_maddrs {announce} use port 0 (the port this process listens on), but "
            f"host_maddrs {list(host_maddrs)} listen on {len(ports) or 'no'} TCP ports: "
            f"name the port to announce"
        )
    port = ports.pop()
    return host, [_with_port(m, port) if tcp_port(m) == 0 else m for m in announce]


def wildcard_announcements(host_maddrs: Sequence[str], interfaces: Sequence[str]) -> List[str]:
    """What a process listening on ``host_maddrs`` (ports already concrete) should announce when nobody told it:
    each 0.0.0.0 listener at each of ``interfaces`` (IPv4 addresses) that reaches beyond this machine, and
    specific listen addresses as they are. Empty (let p2pd decide) when there is no IPv4 wildcard, an IPv6
    wildcard is among them (its addresses are not known here), or no interface address is usable."""
    if not any(m.startswith(_IPV4_ANY) for m in host_maddrs) or any(m.startswith("/ip6/::/") for m in host_maddrs):
        return []
    expanded = []
    for maddr in host_maddrs:
        if maddr.startswith(_IPV4_ANY):
            expanded += [maddr.replace(_IPV4_ANY, f"/ip4/{address}/", 1) for address in interfaces]
        else:
            expanded.append(maddr)
    return announceable(expanded, listens_on_any=True)  # without loopback and container-bridge addresses


def interface_addresses() -> List[str]:
    """This machine's IPv4 interface addresses (the first of each interface); empty where the ioctl that
    reads them is not available (anything but Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    import fcntl

    addresses = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            addresses.append(socket.inet_ntoa(packed[20:24]))
    return addresses


def listen_and_announce(host_maddrs: Sequence[str], announce_maddrs: Sequence[str]) -> Tuple[List[str], List[str]]:
    """The addresses to give p2pd: :func:`resolve_ports`, and for a wildcard listener told nothing to announce,
    :func:`wildcard_announcements` over this machine's interfaces (on a port chosen here when it was 0)."""
    host, announce = resolve_ports(host_maddrs, announce_maddrs)
    if announce or not any(m.startswith(_IPV4_ANY) for m in host):
        return host, announce
    interfaces = interface_addresses()
    if not wildcard_announcements([_with_port(m, 1) for m in host], interfaces):
        return host, announce
    host = _fixed(host, free_tcp_port)
    return host, wildcard_announcements(host, interfaces)
