"""Multiaddrs as this system reads them: one place for every rule about an address.

Pure functions only; dialing (:mod:`swarm.net.dialing`), listening (:mod:`swarm.net.listening`) and the
reachability check (:mod:`swarm.net.reachability`) build on them.

The rules about where an address leads, used everywhere an address is judged:

- a *wildcard* host (``0.0.0.0``, ``::``) means "every interface": a process listens on it, nobody dials it;
- a *loopback* host (127.0.0.0/8, ``::1``) reaches only this machine: a process listening on loopback alone
  is a one-machine swarm, and nobody needs to check whether other machines can reach it;
- a *local-only* host is loopback or on Docker's default bridge (172.17.0.0/16): neither reaches another
  machine, so a peer that listens on every interface never announces one.

Every stage peer announces its visible multiaddrs in its record (:func:`announceable`), because a call by
peer id alone makes p2pd look the address up in libp2p's DHT, which keeps no entry for address ranges
go-multiaddr calls unroutable (198.18.0.0/15, 192.0.2.0/24, ...); a caller dials those addresses
(:func:`dialable`) before it talks to a peer it is not connected to.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable, List, Optional, Sequence

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

__all__ = [
    "MAX_MADDRS",
    "MAX_MADDR_CHARS",
    "host_of",
    "tcp_port",
    "address_peer_id",
    "is_ip",
    "is_wildcard",
    "is_loopback",
    "is_local_only",
    "announceable",
    "listens_on_any",
    "dialable",
    "circuit_maddr",
    "is_circuit",
    "strip_peer_id",
    "listens_on_loopback_only",
    "ip_hosts",
]

MAX_MADDRS = 4  # addresses one record carries
MAX_MADDR_CHARS = 96  # one address, as text: /ip6/<39 chars>/tcp/65535 fits
_TRANSPORTS = ("tcp", "udp")
_P2P_CODE, _CIRCUIT_CODE = 421, 290  # multicodecs of /p2p/<id> and /p2p-circuit
_WILDCARDS = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))
_LOOPBACK = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128")]
_CONTAINER_BRIDGE = [ipaddress.ip_network("172.17.0.0/16")]  # Docker's default bridge: this host's containers only


def host_of(maddr: Multiaddr) -> Optional[str]:
    """The IP or DNS host of ``maddr``; None if it names none."""
    names = [p.name for p in maddr.protocols()]
    for proto in ("ip4", "ip6", "dns4", "dns6", "dns"):
        if proto in names:
            return maddr.value_for_protocol(proto)
    return None


def _host_of_text(text: object) -> Optional[str]:
    try:
        return host_of(Multiaddr(str(text)))
    except Exception:  # multiaddr raises several unrelated types on garbage
        return None


def tcp_port(maddr: object) -> Optional[int]:
    """The TCP port of a multiaddr (0 included: "any free port"); None without one or for garbage."""
    try:
        port = Multiaddr(str(maddr)).value_for_protocol("tcp")
    except Exception:  # no tcp part, or not a multiaddr
        return None
    return int(port) if port and str(port).isdigit() else None


def address_peer_id(address: object) -> Optional[str]:
    """The base58 peer id after ``/p2p/`` in a multiaddr; None if there is none or it is not a multiaddr."""
    try:
        return str(Multiaddr(str(address)).value_for_protocol("p2p")) or None
    except Exception:  # not a multiaddr with a peer id
        return None


def _ip(host: Optional[str]) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(host) if host is not None else None
    except ValueError:
        return None  # a DNS name


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address (not a DNS name)."""
    return _ip(host) is not None


def is_wildcard(host: Optional[str]) -> bool:
    """Whether ``host`` means every interface (0.0.0.0 or ::)."""
    return _ip(host) in _WILDCARDS


def is_loopback(host: Optional[str]) -> bool:
    """Whether ``host`` reaches this machine only (127.0.0.0/8, ::1). A DNS name is assumed not to."""
    address = _ip(host)
    return address is not None and any(address in network for network in _LOOPBACK)


def is_local_only(host: Optional[str]) -> bool:
    """Whether ``host`` never reaches another machine: loopback, or Docker's default bridge. A DNS name is
    assumed to resolve to somewhere reachable."""
    address = _ip(host)
    return address is not None and any(address in network for network in _LOOPBACK + _CONTAINER_BRIDGE)


def strip_peer_id(maddr: Multiaddr) -> Multiaddr:
    """The address without its ``/p2p/<id>`` suffix, which p2pd refuses in a connect request."""
    if "p2p" not in [p.name for p in maddr.protocols()]:
        return maddr
    return maddr.decapsulate(Multiaddr(f"/p2p/{maddr.value_for_protocol('p2p')}"))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def circuit_maddr(relay: str, relay_peer_id: str) -> Multiaddr:
    """``relay``/p2p/``relay_peer_id``/p2p-circuit: reach a peer through the relay at ``relay`` (an address
    without a peer id). Built byte by byte because hivemind's multiaddr encodes a ``/p2p/`` value as a CID,
    which p2pd refuses inside an address ("length greater than remaining number of bytes in buffer");
    p2pd expects the bare multihash of the peer id."""
    peer_id = PeerID.from_base58(relay_peer_id).to_bytes()
    return Multiaddr(
        Multiaddr(relay).to_bytes() + _varint(_P2P_CODE) + _varint(len(peer_id)) + peer_id + _varint(_CIRCUIT_CODE)
    )


def is_circuit(maddr: Multiaddr) -> bool:
    """Whether ``maddr`` reaches its peer through a relay."""
    return "p2p-circuit" in [p.name for p in maddr.protocols()]


def _parse_circuit(maddr: Multiaddr) -> Optional[Multiaddr]:
    """A relay address cut after ``/p2p-circuit`` and encoded as p2pd reads it; None without a relay's peer id."""
    relay = Multiaddr(str(maddr).partition("/p2p-circuit")[0])
    if "p2p" not in [p.name for p in relay.protocols()]:
        return None
    return circuit_maddr(str(strip_peer_id(relay)), relay.value_for_protocol("p2p"))


def _parse(text: str) -> Optional[Multiaddr]:
    """A dialable address (an IP or DNS host and a TCP/UDP port), without its peer id; None if not one."""
    if not isinstance(text, str) or not 0 < len(text) <= 4 * MAX_MADDR_CHARS:
        return None
    try:
        maddr = Multiaddr(text)
        maddr = _parse_circuit(maddr) if is_circuit(maddr) else strip_peer_id(maddr)
    except Exception:  # multiaddr and base58 raise several unrelated types on garbage
        return None
    if maddr is None:
        return None
    names = [p.name for p in maddr.protocols()]
    if host_of(maddr) is None or not any(t in names for t in _TRANSPORTS) or len(str(maddr)) > MAX_MADDR_CHARS:
        return None
    return maddr


def announceable(visible: Iterable[str], listens_on_any: bool) -> List[str]:
    """What a peer announces of its ``visible`` multiaddrs: without peer ids, duplicates and addresses
    that cannot be dialed, at most :data:`MAX_MADDRS`. A peer that listens on every interface also drops
    local-only addresses (:func:`is_local_only`), which only reach its own machine; one that listens on
    loopback keeps them (a swarm on one machine)."""
    chosen: List[str] = []
    for text in visible:
        maddr = _parse(str(text))
        if maddr is None or (listens_on_any and is_local_only(host_of(maddr))) or str(maddr) in chosen:
            continue
        chosen.append(str(maddr))
    return chosen[:MAX_MADDRS]


def listens_on_any(host_maddrs: Iterable[str]) -> bool:
    """Whether any of the addresses a process listens on is a wildcard (0.0.0.0 or ::)."""
    return any(is_wildcard(_host_of_text(m)) for m in host_maddrs)


def listens_on_loopback_only(host_maddrs: Iterable[str]) -> bool:
    """Whether every address a process listens on is a loopback one (a one-machine swarm)."""
    return all(is_loopback(_host_of_text(m)) for m in host_maddrs)


def ip_hosts(maddrs: Iterable[str]) -> List[str]:
    """The distinct IP hosts of ``maddrs``, in order; DNS names and garbage left out."""
    hosts: List[str] = []
    for text in maddrs:
        host = _host_of_text(text)
        if host is not None and is_ip(host) and host not in hosts:
            hosts.append(host)
    return hosts


def dialable(announced: Sequence[str]) -> List[Multiaddr]:
    """The addresses of a record that a connect may use; anything malformed is left out."""
    parsed = (_parse(text) for text in list(announced)[:MAX_MADDRS])
    return [maddr for maddr in parsed if maddr is not None]
