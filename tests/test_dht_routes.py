"""DHT nodes on an address range libp2p's routing leaves out (198.18.0.0/15) reach each other by the addresses
the node that named a peer answers (:mod:`swarm.dht.routes`): their routing tables grow past the nodes p2pd
happens to be connected to, and a record lands on its key's nearest nodes, as on loopback."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, List

import pytest
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID

from swarm import PROTOCOL_VERSION
from swarm.config.settings import NetworkConfig
from swarm.dht.node import NUM_REPLICAS, known_nodes, start_dht
from swarm.dht.records import PeerRecord, stage_key
from swarm.dht.routes import _parse_reply, routes_of
from swarm.dht.store import fetch_records, store_record

RUN_ID = "routes"
NODES = NUM_REPLICAS + 3
STAGES = 4  # stages 0 and 1 are stored first, while the nodes meet; 2 and 3 once they have


def _record(dht: DHT, stage: int) -> PeerRecord:
    return PeerRecord(version=PROTOCOL_VERSION, peer_id=dht.identity.peer_id, stage=stage, state="online",
                      throughput=1.0, queue_length=0, step=1, accum_step=0, samples_pending=0, samples_applied=0)


@contextlib.contextmanager
def _nodes(count: int, address: str) -> Iterator[List[DHT]]:
    started: List[DHT] = []
    try:
        started.append(start_dht(NetworkConfig(host_maddrs=[f"/ip4/{address}/tcp/0"]), run_id=RUN_ID, num_stages=STAGES))
        initial = [str(maddr) for maddr in started[0].get_visible_maddrs()]
        for _ in range(count - 1):
            network = NetworkConfig(initial_peers=initial, host_maddrs=[f"/ip4/{address}/tcp/0"])
            started.append(start_dht(network, run_id=RUN_ID, num_stages=STAGES))
        yield started
    finally:
        for dht in reversed(started):
            dht.shutdown()


async def _node_id(_dht: DHT, node) -> int:
    return int(node.node_id)


async def _holds(key: str, _dht: DHT, node) -> bool:
    return node.protocol.storage.get(DHTID.generate(source=key)) is not None


async def _ask(node_id: str, peer_ids: List[str], _dht: DHT, node):
    """Runs in the DHT process: what ``node_id`` answers about where ``peer_ids`` listen."""
    return await routes_of(node).ask(PeerID.from_base58(node_id), [PeerID.from_base58(p) for p in peer_ids])


async def test_nodes_on_a_range_libp2p_does_not_route_store_on_the_keys_nearest_nodes(hosts):
    with _nodes(NODES, hosts.root_address) as nodes:
        for first in (0, 2):  # a joiner's first store lands among the few nodes it knows; later ones, where they belong
            for index, writer in enumerate(nodes[1:]):
                stage = first + index % 2
                assert await store_record(writer, stage_key(RUN_ID, stage), _record(writer, stage), expiration_s=60)
        known = [await dht.run_coroutine(known_nodes, return_future=True) for dht in nodes]
        # without the addresses a node names, each of them knows the bootstrap alone
        assert min(known) >= NUM_REPLICAS, known

        ids = [await dht.run_coroutine(_node_id, return_future=True) for dht in nodes]
        for stage in range(STAGES):
            key = stage_key(RUN_ID, stage)
            writers = {nodes[1 + i].identity.peer_id for i in range(NODES - 1) if i % 2 == stage % 2}
            for reader in nodes:
                assert set(await fetch_records(reader, key, PeerRecord, timeout=10.0, strict=True)) == writers
            if stage >= 2:
                nearest = sorted(range(NODES), key=lambda index: ids[index] ^ int(DHTID.generate(source=key)))
                holders = [index for index, dht in enumerate(nodes)
                           if await dht.run_coroutine(partial(_holds, key), return_future=True)]
                assert sorted(holders) == sorted(nearest[:NUM_REPLICAS]), (stage, holders, nearest)


async def test_a_node_says_where_the_peers_of_its_table_listen_and_nothing_of_strangers():
    with _nodes(3, "127.0.0.1") as (bootstrap, named, asking):
        stranger = PeerID.from_base58("QmTNusEdJxsGQQ9XWwEXtiDhuyJ4QePAS8YrnXX9DLeh6o")
        answer = await asking.run_coroutine(
            partial(_ask, bootstrap.identity.peer_id, [named.identity.peer_id, stranger.to_base58()]),
            return_future=True)
        visible = {str(m).partition("/p2p/")[0] for m in named.get_visible_maddrs()}
    assert set(answer) == {bootstrap.identity.peer_id, named.identity.peer_id}
    assert answer[named.identity.peer_id] and set(answer[named.identity.peer_id]) <= visible


@pytest.mark.parametrize("reply", [None, [1, 2], "text", 7])
def test_an_answer_that_is_not_a_mapping_is_refused(reply):
    with pytest.raises(ValueError):
        _parse_reply(reply)


def test_malformed_entries_of_an_answer_are_left_out():
    long = "/ip4/1.2.3.4/tcp/1/" + "x" * 4096
    parsed = _parse_reply({"a": ["/ip4/1.2.3.4/tcp/5", 7, long], "b": "/ip4/1.2.3.4/tcp/5", 3: ["/ip4/1.2.3.4/tcp/5"]})
    assert parsed == {"a": ["/ip4/1.2.3.4/tcp/5"]}
