"""Reaching DHT nodes whose addresses libp2p's routing does not keep.

hivemind's DHT names nodes by peer id only: a lookup's answers carry the peer ids of the nodes nearest a key,
and p2pd finds a peer id's address through libp2p's own routing. That routing keeps public addresses and
private ones (RFC 1918, loopback) but not others, such as 198.18.0.0/15; there a node could call only the
nodes p2pd happened to be connected to, its routing table stayed a handful of nodes, and its stores landed
where readers that know other nodes do not look.

So each DHT process serves one more small call, ``ADDRESSES``: given peer ids, it answers the addresses they
told it themselves, and its own. Before a node calls a peer it is not connected to, it asks the node whose
answer named that peer (which knows it: it is in that node's routing table) for the peer's addresses, and
connects p2pd to them (:class:`Routes`). An address only says where to dial: libp2p's handshake proves the
peer id, so a wrong answer costs a failed dial, never a call to someone else. Where libp2p routes an address
itself, this costs one small call for each node met, and the connection it would have found comes sooner.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_logger

from swarm.hivemind_private import wrap_dht_protocol
from swarm.net.addresses import MAX_MADDR_CHARS, MAX_MADDRS, announceable
from swarm.net.dialing import AddressBook, Dialer

__all__ = ["ADDRESSES", "Routes", "reach_nodes_by_address", "routes_of"]

logger = get_logger(__name__)

ADDRESSES = "swarm.dht.addresses"  # the handler's name on p2pd
MAX_ASKED = 20  # peer ids one request may ask about (hivemind's answers name at most its bucket size, 20)
ASK_TIMEOUT_S = 3.0  # seconds a node may take to answer where a peer is
OWN_ADDRESSES_TTL_S = 30.0  # seconds a node's answer of its own addresses is reused
JOIN_WALK_TIMEOUT_S = 30.0  # seconds the walk to a node's own id may take once it can reach by address
MAX_INTRODUCERS = 65536  # peer ids remembered with the node that named them
MAX_REPLY_BYTES = (MAX_ASKED + 1) * (64 + MAX_MADDRS * (MAX_MADDR_CHARS + 8))


class Routes:
    """One DHT node's way to the nodes it hears of: who named each peer id, and where each peer said it
    listens. Lives in the DHT process, beside the node."""

    def __init__(self, node: DHTNode):
        self.node, self.p2p = node, node.protocol.p2p
        self._own: Tuple[float, List[str]] = (-OWN_ADDRESSES_TTL_S, [])  # (monotonic time asked, addresses)
        self.book = AddressBook()
        self.dialer = Dialer(self.p2p, self.book)
        self.introducers: "OrderedDict[PeerID, PeerID]" = OrderedDict()

    async def serve(self) -> None:
        await self.p2p.add_protobuf_handler(ADDRESSES, self._answer, runtime_pb2.ExpertRequest)

    def note_answer(self, answered_by: PeerID, response: Optional[Dict[Any, Any]]) -> None:
        """Remember ``answered_by`` as the node that named each peer of a lookup's answer."""
        for _value, nearest in (response or {}).values():
            for peer_id in nearest.values():
                if peer_id != self.p2p.peer_id and not self.book.get(peer_id.to_base58()):
                    self.introducers[peer_id] = answered_by
                    self.introducers.move_to_end(peer_id)
        while len(self.introducers) > MAX_INTRODUCERS:
            self.introducers.popitem(last=False)

    async def reach(self, peer_id: PeerID) -> None:
        """Connect p2pd to ``peer_id`` unless it is connected: at the addresses the peer told us, or those the
        node that named it answers. Never raises: the call that follows reports what went wrong."""
        key = peer_id.to_base58()
        if await self.dialer.ensure(key):
            return
        introducer = self.introducers.get(peer_id)
        if self.book.get(key) or introducer is None or introducer == peer_id:
            return
        self.book.learn(await self.ask(introducer, [peer_id]))
        await self.dialer.ensure(key)

    async def ask(self, node: PeerID, peer_ids: Sequence[PeerID]) -> Dict[str, List[str]]:
        """Where ``node`` says each of ``peer_ids`` listens (and itself); {} if it does not answer."""
        request = runtime_pb2.ExpertRequest(metadata=msgpack.packb([p.to_bytes() for p in peer_ids[:MAX_ASKED]]))
        try:
            response = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(node, ADDRESSES, request, runtime_pb2.ExpertResponse), ASK_TIMEOUT_S
            )
            if len(response.metadata) > MAX_REPLY_BYTES:
                raise ValueError(f"a reply of {len(response.metadata)} bytes")
            return _parse_reply(msgpack.unpackb(response.metadata))
        except Exception as e:  # no answer, or nonsense: the peer stays unreached, as without this
            logger.debug(f"{node} did not say where peers listen: {type(e).__name__}: {e}")
            return {}

    async def _answer(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Where each asked peer listens, as far as this node knows: the addresses it said itself, for peers of
        this node's routing table (whom any lookup answer of this node may name). A peer not asked yet is asked
        now, over the connection it holds to this node; and this node's own addresses always, as libp2p's
        identify tells any peer. In a private run only a caller in the routing table (one that passed the run's
        authorizer) hears of other nodes."""
        try:
            asked = [PeerID(raw) for raw in msgpack.unpackb(request.metadata)[:MAX_ASKED]]
        except Exception:
            return runtime_pb2.ExpertResponse()
        table = self.node.protocol.routing_table.peer_id_to_uid
        private = self.node.protocol.authorizer is not None
        if private and context.remote_id not in table:  # in a private run, only its members hear of others
            asked = []
        known = [p for p in asked if p in table and p != context.remote_id]
        missing = [p for p in known if not self.book.get(p.to_base58())]
        if missing:
            told = await asyncio.gather(*(self.ask(p, []) for p in missing))
            self.book.learn({p.to_base58(): own.get(p.to_base58(), []) for p, own in zip(missing, told)})
        reply = {p.to_base58(): self.book.get(p.to_base58()) for p in known}
        reply[self.p2p.peer_id.to_base58()] = await self.own_maddrs()
        return runtime_pb2.ExpertResponse(metadata=msgpack.packb(reply))

    async def own_maddrs(self) -> List[str]:
        """Where this node listens, as p2pd tells it (asked again after ``OWN_ADDRESSES_TTL_S``): none yet for a
        node that is reachable only through a relay it has not reserved."""
        asked_at, own = self._own
        if time.monotonic() - asked_at >= OWN_ADDRESSES_TTL_S:
            try:
                visible = await asyncio.wait_for(self.p2p.get_visible_maddrs(latest=True), ASK_TIMEOUT_S)
                own = announceable([str(maddr) for maddr in visible], listens_on_any=False)
            except Exception as e:  # no address yet, or p2pd is busy: answer none this time
                logger.debug(f"p2pd named no address of this node: {type(e).__name__}: {e}")
                own = []
            self._own = (time.monotonic(), own)
        return own


def _parse_reply(reply: Any) -> Dict[str, List[str]]:
    """Peer id -> addresses from an answer, leaving out anything malformed."""
    if not isinstance(reply, dict):
        raise ValueError("the reply is not a mapping")
    parsed: Dict[str, List[str]] = {}
    for peer_id, maddrs in list(reply.items())[: MAX_ASKED + 1]:
        if isinstance(peer_id, str) and isinstance(maddrs, list):
            parsed[peer_id] = [m for m in maddrs[:MAX_MADDRS] if isinstance(m, str) and len(m) <= MAX_MADDR_CHARS]
    return parsed


_ROUTES: Dict[int, Routes] = {}  # per DHT process: the node's routes, by id(node)


def routes_of(node: DHTNode) -> Optional[Routes]:
    return _ROUTES.get(id(node))


async def reach_nodes_by_address(_dht: Any, node: DHTNode) -> None:
    """Runs once in the DHT process (through ``dht.run_coroutine``): serve ``ADDRESSES``, and make every lookup
    call of ``node`` reach its peer first and remember who its answer named."""
    routes = _ROUTES[id(node)] = Routes(node)
    await routes.serve()

    def reaching(call_find):
        async def call_find_reaching(peer_id, keys):
            await routes.reach(peer_id)
            response = await call_find(peer_id, keys)
            routes.note_answer(peer_id, response)
            return response

        return call_find_reaching

    wrap_dht_protocol(node.protocol, wrap_call_find=reaching)
    # hivemind's node joined before it could reach anyone but the nodes it dialed: forget the failures that
    # cost, and walk to its own id again, as a joining node does, to meet its neighbours
    node.blacklist.clear()
    asyncio.create_task(_meet_neighbours(node))


async def _meet_neighbours(node: DHTNode) -> None:
    try:
        await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), JOIN_WALK_TIMEOUT_S)
    except Exception as e:  # the node still works with the table it has, and lookups grow it
        logger.debug(f"the walk to this node's own id failed: {type(e).__name__}: {e}")
