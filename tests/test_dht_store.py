"""Storing a record in a live DHT of a few nodes on loopback: it lands on the key's ``NUM_REPLICAS`` nearest
nodes, and the walk that finds them brings back no copy of what those nodes already keep under the key
(hivemind's own store, walked alike, does)."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Dict, Iterator, List

import pytest
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from swarm import PROTOCOL_VERSION
from swarm.config.settings import NetworkConfig
from swarm.dht.node import NUM_REPLICAS, STORE_TRAVERSAL, start_dht
from swarm.dht.records import PeerRecord, stage_key
from swarm.dht.store import fetch_records, store_record

RUN_ID = "store-walk"
NODES = NUM_REPLICAS + 3  # more nodes than replicas: where a value lands is a choice

_answers_with_values: Dict[str, int] = {}  # per DHT process: answers to the counted walks that carried a value


async def _node_id(_dht: DHT, node) -> int:
    return int(node.node_id)


async def _holds(key: str, _dht: DHT, node) -> bool:
    return node.protocol.storage.get(DHTID.generate(source=key)) is not None


async def _count_answers(_dht: DHT, node) -> None:
    """Runs in the DHT process: from now on, count the lookup answers that carry a value."""
    original = node.protocol.call_find
    _answers_with_values["n"] = 0

    async def counting(peer, keys):
        response = await original(peer, keys)
        for value, _nearest in (response or {}).values():
            _answers_with_values["n"] += value is not None
        return response

    node.protocol.call_find = counting
    _answers_with_values["original"] = original


async def _counted(_dht: DHT, node) -> int:
    """Runs in the DHT process: stop counting; the answers with a value since :func:`_count_answers`."""
    node.protocol.call_find = _answers_with_values.pop("original")
    return _answers_with_values.pop("n")


def _record(dht: DHT, step: int) -> PeerRecord:
    return PeerRecord(version=PROTOCOL_VERSION, peer_id=dht.identity.peer_id, stage=0, state="online",
                      throughput=1.0, queue_length=0, step=step, accum_step=0, samples_pending=0, samples_applied=0)


@contextlib.contextmanager
def _nodes(count: int) -> Iterator[List[DHT]]:
    started: List[DHT] = []
    try:
        started.append(start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), run_id=RUN_ID, num_stages=1))
        initial = [str(address) for address in started[0].get_visible_maddrs()]
        for _ in range(count - 1):
            network = NetworkConfig(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            started.append(start_dht(network, run_id=RUN_ID, num_stages=1))
        yield started
    finally:
        for dht in reversed(started):
            dht.shutdown()


@pytest.fixture(scope="module")
def nodes():
    with _nodes(NODES) as started:
        yield started


async def test_a_record_lands_on_the_keys_nearest_nodes_and_every_node_reads_it(nodes):
    key = stage_key(RUN_ID, 0)
    writer = nodes[3]
    assert await store_record(writer, key, _record(writer, step=7), expiration_s=60)

    key_id = int(DHTID.generate(source=key))
    ids = [await dht.run_coroutine(_node_id, return_future=True) for dht in nodes]
    nearest = sorted(range(len(nodes)), key=lambda index: ids[index] ^ key_id)[:NUM_REPLICAS]
    holders = [index for index, dht in enumerate(nodes)
               if await dht.run_coroutine(partial(_holds, key), return_future=True)]
    assert sorted(holders) == sorted(nearest)
    for reader in nodes:
        found = await fetch_records(reader, key, PeerRecord, timeout=10.0, strict=True)
        assert found[writer.identity.peer_id].step == 7


async def test_the_walk_of_a_store_brings_back_no_copy_of_the_key_where_hiveminds_brings_them_all(nodes):
    key = stage_key(RUN_ID, 1)
    for index, owner in enumerate(nodes[:4]):  # the key's nearest nodes keep a dictionary of 4 records
        assert await store_record(owner, key, _record(owner, step=index), expiration_s=60)
    writer = nodes[-1]

    await writer.run_coroutine(_count_answers, return_future=True)
    assert await store_record(writer, key, _record(writer, step=1), expiration_s=60)
    ours = await writer.run_coroutine(_counted, return_future=True)

    await writer.run_coroutine(_count_answers, return_future=True)
    value = _record(writer, step=2).model_dump(mode="json")
    assert await writer.store(key, value, get_dht_time() + 60, subkey=writer.identity.owner_subkey,
                              return_future=True, **STORE_TRAVERSAL)
    theirs = await writer.run_coroutine(_counted, return_future=True)

    assert ours == 0
    assert theirs >= 1, "hivemind's store walked by the key's holders without their copies: nothing to compare"
    found = await fetch_records(nodes[0], key, PeerRecord, timeout=10.0, strict=True)
    assert len(found) == 5 and found[writer.identity.peer_id].step == 2


async def test_a_directory_store_reports_the_nodes_its_dht_node_knows(nodes):
    from swarm.dht.directory import Directory

    writer = nodes[4]
    directory = Directory(writer, RUN_ID, num_stages=1, home=writer.identity.peer_id)
    assert directory.nodes_known == -1
    assert await directory.store(_record(writer, step=3), expiration_s=60)
    assert NODES // 2 <= directory.nodes_known <= NODES - 1  # a swarm this small: most other nodes, or all
