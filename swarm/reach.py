"""Reaching a peer at the addresses it announces, instead of relying on libp2p's own routing.

A call by peer id alone makes p2pd look the address up in libp2p's DHT, which keeps no entry for
address ranges go-multiaddr calls unroutable (198.18.0.0/15, 192.0.2.0/24, ...): across hosts on
such a range every call fails with ``routing: not found`` although both sides can reach each other.
So every stage peer announces its visible multiaddrs in its record (:func:`announceable`), and a
caller connects p2pd to those addresses before it talks to a peer it is not connected to
(:class:`Dialer`). Once p2pd holds a connection, every client of that daemon uses it: the RPCs of
this process, and the averager and state downloads that hivemind runs over the same daemon.

The address filters are pure; the dialer is the only part that does I/O.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import weakref
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr

__all__ = ["MAX_MADDRS", "MAX_MADDR_CHARS", "announceable", "listens_on_any", "dialable", "is_routing_failure",
           "circuit_maddr", "is_circuit", "host_of", "AddressBook", "address_book", "Dialer", "dialer_for"]

logger = get_logger(__name__)

MAX_MADDRS = 4  # addresses one record carries
MAX_MADDR_CHARS = 96  # one address, as text: /ip6/<39 chars>/tcp/65535 fits
CONNECT_TIMEOUT_S = 5.0  # seconds one connect attempt may take
CONNECTED_TTL_S = 10.0  # seconds a peer seen connected is not checked again
RETRY_AFTER_S = 5.0  # seconds before dialing a peer again after a failed connect
_TRANSPORTS = ("tcp", "udp")
_P2P_CODE, _CIRCUIT_CODE = 421, 290  # multicodecs of /p2p/<id> and /p2p-circuit
_ROUTING_FAILURES = ("routing: not found", "failed to find any peer in table", "no addresses", "failed to dial")
# addresses that never reach another host: loopback and the default container bridge
_LOCAL_ONLY = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128", "172.17.0.0/16")]


def host_of(maddr: Multiaddr) -> Optional[str]:
    names = [p.name for p in maddr.protocols()]
    for proto in ("ip4", "ip6", "dns4", "dns6", "dns"):
        if proto in names:
            return maddr.value_for_protocol(proto)
    return None


def _strip_peer_id(maddr: Multiaddr) -> Multiaddr:
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
    return Multiaddr(Multiaddr(relay).to_bytes() + _varint(_P2P_CODE) + _varint(len(peer_id)) + peer_id
                     + _varint(_CIRCUIT_CODE))


def is_circuit(maddr: Multiaddr) -> bool:
    """Whether ``maddr`` reaches its peer through a relay."""
    return "p2p-circuit" in [p.name for p in maddr.protocols()]


def _parse_circuit(maddr: Multiaddr) -> Optional[Multiaddr]:
    """A relay address cut after ``/p2p-circuit`` and encoded as p2pd reads it; None without a relay's peer id."""
    relay = Multiaddr(str(maddr).partition("/p2p-circuit")[0])
    if "p2p" not in [p.name for p in relay.protocols()]:
        return None
    return circuit_maddr(str(_strip_peer_id(relay)), relay.value_for_protocol("p2p"))


def _local_only(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a DNS name: assume it resolves to somewhere reachable
    return any(address in network for network in _LOCAL_ONLY)


def _parse(text: str) -> Optional[Multiaddr]:
    """A dialable address (an IP or DNS host and a TCP/UDP port), without its peer id; None if not one."""
    if not isinstance(text, str) or not 0 < len(text) <= 4 * MAX_MADDR_CHARS:
        return None
    try:
        maddr = Multiaddr(text)
        maddr = _parse_circuit(maddr) if is_circuit(maddr) else _strip_peer_id(maddr)
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
    that cannot be dialed, at most :data:`MAX_MADDRS`. A peer that listens on every interface (0.0.0.0)
    also drops loopback and container-bridge addresses, which only reach itself; one that listens on
    loopback keeps them (a swarm on one machine)."""
    chosen: List[str] = []
    for text in visible:
        maddr = _parse(str(text))
        if maddr is None or (listens_on_any and _local_only(host_of(maddr))) or str(maddr) in chosen:
            continue
        chosen.append(str(maddr))
    return chosen[:MAX_MADDRS]


def listens_on_any(host_maddrs: Iterable[str]) -> bool:
    """Whether any of the addresses a process listens on is a wildcard (0.0.0.0 or ::)."""
    return any(f"/{proto}/{host}/" in f"{m}/" for m in host_maddrs for proto, host in (("ip4", "0.0.0.0"), ("ip6", "::")))


def dialable(announced: Sequence[str]) -> List[Multiaddr]:
    """The addresses of a record that a connect may use; anything malformed is left out."""
    parsed = (_parse(text) for text in list(announced)[:MAX_MADDRS])
    return [maddr for maddr in parsed if maddr is not None]


def is_routing_failure(error: BaseException) -> bool:
    """Whether a call failed because p2pd could not find or dial the peer (not because the peer failed)."""
    text = str(error).lower()
    return any(marker in text for marker in _ROUTING_FAILURES)


class AddressBook:
    """Where peers said they can be reached: peer id -> announced multiaddrs, for the whole process.

    Filled by whoever parses peer records (:func:`swarm.dht_io.fetch_stage_records`), read by every
    :class:`Dialer`; bounded by the peers this process has seen records of."""

    MAX_PEERS = 65536

    def __init__(self) -> None:
        self._addresses: Dict[str, List[str]] = {}

    def learn(self, announced: Mapping[str, Sequence[str]]) -> None:
        """Remember peer id -> multiaddrs; a peer that announces none keeps what it announced before."""
        for peer_id, maddrs in announced.items():
            if maddrs and (peer_id in self._addresses or len(self._addresses) < self.MAX_PEERS):
                self._addresses[peer_id] = list(maddrs)[:MAX_MADDRS]

    def get(self, peer_id: str) -> List[str]:
        return list(self._addresses.get(peer_id, ()))


address_book = AddressBook()


class Dialer:
    """Connects one p2pd to peers at their announced addresses, once and on demand.

    :meth:`ensure` connects when the peer is not connected yet; it never raises: a failed connect is
    logged, and the call that follows reports the real error."""

    def __init__(self, p2p: P2P, book: AddressBook = address_book):
        self.p2p, self.book = p2p, book
        self._connected: Dict[str, float] = {}  # peer id -> monotonic time it was last seen connected
        self._failed: Dict[str, float] = {}  # peer id -> monotonic time of its last failed connect
        self._listed_at = -CONNECTED_TTL_S

    async def _refresh_connected(self) -> None:
        now = time.monotonic()
        if now - self._listed_at < CONNECTED_TTL_S:
            return
        self._listed_at = now
        try:
            peers = await asyncio.wait_for(self.p2p.list_peers(), CONNECT_TIMEOUT_S)
        except Exception as e:  # the daemon is busy or gone: dial as if nothing were connected
            logger.debug(f"listing p2pd's connections failed: {type(e).__name__}: {e}")
            return
        self._connected = {str(info.peer_id): now for info in peers}

    async def ensure(self, peer_id: str, force: bool = False) -> bool:
        """Connect to ``peer_id`` at its announced addresses unless p2pd is connected to it already; True
        if a connection is known or was made. ``force``: dial even if it looked connected (a call to it
        just failed to route)."""
        await self._refresh_connected()
        now = time.monotonic()
        if not force and now - self._connected.get(peer_id, -CONNECTED_TTL_S) < CONNECTED_TTL_S:
            return True
        maddrs = dialable(self.book.get(peer_id))
        if not maddrs or now - self._failed.get(peer_id, -RETRY_AFTER_S) < RETRY_AFTER_S:
            return False
        try:
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), maddrs), CONNECT_TIMEOUT_S)
        except Exception as e:  # unreachable, refused, timed out: the caller's call reports what it sees
            self._failed[peer_id] = time.monotonic()
            logger.info(f"could not connect to {peer_id} at {[str(m) for m in maddrs]}: {type(e).__name__}: {e}")
            return False
        self._connected[peer_id] = time.monotonic()
        self._failed.pop(peer_id, None)
        return True

    async def ensure_all(self, peer_ids: Iterable[str]) -> None:
        """Connect to every one of ``peer_ids`` that is not connected yet, concurrently."""
        await asyncio.gather(*(self.ensure(peer_id) for peer_id in set(peer_ids)))


_DIALERS: "weakref.WeakKeyDictionary[P2P, Dialer]" = weakref.WeakKeyDictionary()


def dialer_for(p2p: P2P) -> Dialer:
    """The dialer of ``p2p`` (one per daemon client, so that its view of connections is shared)."""
    dialer = _DIALERS.get(p2p)
    if dialer is None:
        dialer = _DIALERS[p2p] = Dialer(p2p)
    return dialer
