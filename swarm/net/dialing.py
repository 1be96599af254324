"""Reaching a peer at the addresses it announces, instead of relying on libp2p's own routing.

Once p2pd holds a connection, every client of that daemon uses it: the RPCs of this process, and the
averager and state downloads that hivemind runs over the same daemon. So a caller connects p2pd to a
peer's announced addresses (:class:`Dialer`) before it talks to a peer it is not connected to; the
addresses come from the peers' records (:class:`AddressBook`), judged by :mod:`swarm.net.addresses`.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Dict, Iterable, List, Mapping, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger

from swarm.hivemind_private import daemon_connect
from swarm.net.addresses import MAX_MADDRS, dialable

__all__ = ["is_routing_failure", "AddressBook", "address_book", "Dialer", "dialer_for"]

logger = get_logger(__name__)

CONNECT_TIMEOUT_S = 5.0  # seconds one connect attempt may take
CONNECTED_TTL_S = 10.0  # seconds a peer seen connected is not checked again
RETRY_AFTER_S = 5.0  # seconds before dialing a peer again after a failed connect
_ROUTING_FAILURES = ("routing: not found", "failed to find any peer in table", "no addresses", "failed to dial")


def is_routing_failure(error: BaseException) -> bool:
    """Whether a call failed because p2pd could not find or dial the peer (not because the peer failed)."""
    text = str(error).lower()
    return any(marker in text for marker in _ROUTING_FAILURES)


class AddressBook:
    """Where peers said they can be reached: peer id -> announced multiaddrs, for the whole process.

    Filled by whoever parses peer records (:func:`swarm.dht.directory.fetch_stage_records`), read by every
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
            await asyncio.wait_for(daemon_connect(self.p2p, PeerID.from_base58(peer_id), maddrs), CONNECT_TIMEOUT_S)
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
