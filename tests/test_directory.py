"""The sharded stage directory: layout (pure), and readers and writers over a DHT that keeps values in memory."""

from __future__ import annotations

import asyncio
import math
import random
from types import SimpleNamespace
from typing import Dict, List

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration

import swarm.dht.directory as directory_module
import swarm.dht.store as dht_io
import swarm.policy.directory as layout
from swarm import PROTOCOL_VERSION
from swarm.dht.directory import Directory
from swarm.dht.identity import load_or_create_identity
from swarm.dht.node import store_in_dht
from swarm.policy.directory import (
    MAX_LEVEL, PROBE_REACH, SHARD_CAPACITY, coverage_polls, probe_due, probe_estimate, probe_levels, level_for, shard_count,
    shard_of, shards_to_read, write_levels,
)
from swarm.net.addresses import MAX_MADDR_CHARS, MAX_MADDRS
from swarm.dht.records import MAX_COUNT, MAX_EXCLUDED, MAX_ID_LENGTH, PeerRecord, shard_key, stage_key

# ---- the layout ----


def test_small_stages_stay_one_key_and_large_ones_split_to_about_capacity():
    assert level_for(0) == level_for(1) == level_for(SHARD_CAPACITY) == 0
    assert level_for(SHARD_CAPACITY + 1) == 1
    for size in (100, 1000, 4096):
        assert SHARD_CAPACITY / 2 < size / shard_count(level_for(size)) <= SHARD_CAPACITY
    assert level_for(10**9) == MAX_LEVEL
    assert level_for(float("nan")) == 0
    assert shard_key("r", 3, 0, 0) == stage_key("r", 3)
    with pytest.raises(ValueError):
        shard_key("r", 3, 2, 4)


def test_a_writer_covers_its_neighbouring_level_and_never_more_than_two():
    for size in range(1, 5000):
        levels = write_levels(size)
        assert level_for(size) in levels and len(levels) <= 2 and levels == tuple(range(levels[0], levels[-1] + 1))
    # every reader whose estimate is within the band of the writer's finds the record at its own level
    rng = random.Random(0)
    for _ in range(2000):
        size = rng.uniform(1, 5000)
        reader = size * rng.uniform(1 / layout.WRITE_BAND, layout.WRITE_BAND)
        assert level_for(reader) in write_levels(size)


def test_shards_split_in_two_from_one_level_to_the_next():
    ids = [f"peer{i}" for i in range(200)]
    for level in range(MAX_LEVEL):
        assert all(shard_of(i, level + 1) >> 1 == shard_of(i, level) for i in ids)
    counts = [0] * 16
    for i in ids:
        counts[shard_of(i, 4)] += 1
    assert max(counts) < 3 * 200 / 16  # a hash, not a prefix of the text


def test_a_reader_sees_every_shard_within_its_coverage_and_reads_few_at_once():
    level, home = 5, 7
    seen, cursor = set(), 0
    for _ in range(coverage_polls(level, rotate=2)):
        shards, cursor = shards_to_read(level, home, cursor, rotate=2)
        assert len(shards) == 3 and shards[0] == home
        seen.update(shards)
    assert seen == set(range(32))
    assert shards_to_read(2, 1, 0, rotate=-1)[0] == [0, 1, 2, 3]
    assert shards_to_read(0, 0, 0, rotate=1)[0] == [0]


def test_an_empty_home_shard_triggers_a_probe_only_where_emptiness_is_unlikely():
    """Shards of a few records are often empty by chance; a reader re-probes at once only when its level
    says its own shard should hold more than a handful, and otherwise waits for the periodic probe."""
    level = level_for(30)  # 8 shards of about 3.75 records
    assert probe_due(level, home_count=0, estimated_size=30, since_probe_s=1.0, period_s=10.0)
    assert not probe_due(level, home_count=0, estimated_size=20, since_probe_s=1.0, period_s=10.0)  # 2.5 a shard
    assert not probe_due(level, home_count=2, estimated_size=30, since_probe_s=1.0, period_s=10.0)
    assert not probe_due(level, home_count=-1, estimated_size=30, since_probe_s=1.0, period_s=10.0)  # not read yet
    assert probe_due(level, home_count=2, estimated_size=30, since_probe_s=10.0, period_s=10.0)
    assert probe_due(level, home_count=2, estimated_size=300, since_probe_s=1.0, period_s=10.0)  # another level's size


def _lowest(layout_map: Dict[tuple, set], home: str, levels=range(MAX_LEVEL + 1)) -> List[int]:
    """What a probe of ``levels`` by ``home`` finds: the lowest level of every record in its own shards."""
    lowest: Dict[str, int] = {}
    for level in levels:
        for peer_id in layout_map.get((level, shard_of(home, level)), ()):
            lowest[peer_id] = min(level, lowest.get(peer_id, level))
    return list(lowest.values())


@pytest.mark.parametrize("size", [3, 40, 300, 4000])
def test_a_probe_finds_the_level_the_writers_use(size):
    """A reader's first probe (``FIRST_PROBE_CHAINS`` chains through random points, their estimates averaged)
    lands on a level the writers use, whose shards hold the whole stage at about a shard's capacity each."""
    rng = random.Random(size)
    layout_map: Dict[tuple, set] = {}
    ids = [f"p{size}-{i}" for i in range(size)]
    for peer_id in ids:  # each writer's estimate of the size is off by up to 15%
        for level in write_levels(size * rng.uniform(0.85, 1.15)):
            layout_map.setdefault((level, shard_of(peer_id, level)), set()).add(peer_id)
    chains = directory_module.FIRST_PROBE_CHAINS
    estimate = sum(probe_estimate(_lowest(layout_map, f"point{i}")) for i in range(chains)) / chains
    level = level_for(estimate)
    found = set().union(*(layout_map.get((level, shard), set()) for shard in range(shard_count(level))))
    assert found == set(ids), f"level {level}: {len(found)} of {size}"
    # at most a few times the capacity: shards of a few records vary by a few records
    assert max(len(v) for (lvl, _), v in layout_map.items() if lvl == level) <= 4 * SHARD_CAPACITY
    assert probe_estimate([]) == 0.0
    # the probes between full ones read the levels next to the reader's, and still land on a level written
    window = probe_levels(level, probes_done=1)
    assert len(window) <= 2 * layout.PROBE_REACH + 1
    estimates = [probe_estimate(_lowest(layout_map, f"window{i}", window)) for i in range(200)]
    assert abs(sum(estimates) / len(estimates) - size) < 0.15 * size  # without bias, to the spread of writers
    chains = directory_module.PROBE_CHAINS
    assert all(level_for(sum(estimates[i:i + chains]) / chains) in range(level - 1, level + 2)
               for i in range(0, 200, chains))


def test_probes_read_the_levels_next_to_the_readers_and_every_level_now_and_then():
    assert probe_levels(5, probes_done=0) == range(MAX_LEVEL + 1)  # the first probe
    assert probe_levels(5, probes_done=1) == range(5 - layout.PROBE_REACH, 5 + layout.PROBE_REACH + 1)
    assert probe_levels(0, probes_done=1)[0] == 0 and probe_levels(MAX_LEVEL, probes_done=1)[-1] == MAX_LEVEL
    assert probe_levels(5, probes_done=layout.FULL_PROBE_EVERY) == range(MAX_LEVEL + 1)
    assert 2 * layout.PROBE_REACH + 1 < layout.mean_probe_levels(5) < MAX_LEVEL + 1


# ---- the largest record ----


def test_the_largest_record_stays_under_2_kb_signed():
    """Every field at its bound, signed by a 2048-bit RSA key (the size libp2p and the DHT use), with its subkey."""
    identity = load_or_create_identity(None)
    record = PeerRecord(
        version=PROTOCOL_VERSION, peer_id="p" * MAX_ID_LENGTH, stage=4095, state="joining", throughput=1e12,
        queue_length=MAX_COUNT, step=MAX_COUNT, accum_step=MAX_COUNT, samples_pending=MAX_COUNT,
        samples_frozen=MAX_COUNT, samples_admitted=MAX_COUNT, samples_applied=MAX_COUNT, digest="f" * 64,
        samples_processed=MAX_COUNT, contributed_base=MAX_COUNT, contributed_bits=2**64 - 1,
        tentative_bits=2**64 - 1, resets=MAX_COUNT, reset_from=MAX_COUNT, run_hash="h" * 16,
        excluded="x" * (MAX_EXCLUDED * (MAX_ID_LENGTH + 1)), maddrs="m" * (MAX_MADDRS * (MAX_MADDR_CHARS + 1)))
    dht_record = DHTRecord(key=DHTID.generate(source=stage_key("r", 0)).to_bytes(),
                           subkey=MSGPackSerializer.dumps(identity.owner_subkey),
                           value=MSGPackSerializer.dumps(record.model_dump(mode="json")), expiration_time=1e10)
    signed = RSASignatureValidator(identity.private_key).sign_value(dht_record)
    assert len(signed) > len(dht_record.value)  # the signature is in
    assert len(signed) + len(identity.owner_subkey) < 2048


# ---- readers and writers over an in-memory DHT ----


class _Clock:
    now = 1000.0


class _MemoryDHT:
    """The two coroutines the directory runs in the DHT process (a store, a lookup), over a shared dict."""

    def __init__(self, table: Dict[str, Dict[bytes, ValueWithExpiration]], identity, reads: List[int]):
        self.table, self.identity, self.reads = table, identity, reads

    def run_coroutine(self, fn, return_future):
        future = asyncio.get_running_loop().create_future()
        if fn.func is store_in_dht:
            stored = fn.keywords
            self.table.setdefault(stored["key"], {})[stored["subkey"]] = ValueWithExpiration(
                stored["value"], stored["expiration_time"])
            future.set_result(True)
            return future
        self.fresh_s = fn.keywords["fresh_s"]
        found = {}
        for key in fn.keywords["keys"]:
            live = {subkey: item for subkey, item in self.table.get(key, {}).items()
                    if item.expiration_time > _Clock.now}
            self.reads.append(len(live))
            found[key] = ValueWithExpiration(live, max(i.expiration_time for i in live.values())) if live else None
        future.set_result(found)
        return future


def _record(identity, stage: int) -> PeerRecord:
    return PeerRecord(version=PROTOCOL_VERSION, peer_id=identity.peer_id, stage=stage, state="online",
                      throughput=1.0, queue_length=0, step=0, accum_step=0, samples_pending=0, samples_applied=0)


@pytest.fixture(scope="module")
def identities():
    return [load_or_create_identity(None) for _ in range(40)]


def test_a_growing_stage_moves_to_shards_and_a_new_reader_sees_all_of_it_a_few_shards_at_a_time(
        identities, monkeypatch):
    monkeypatch.setattr(layout, "SHARD_CAPACITY", 10)  # 40 replicas: 4 shards of 10, two levels up
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(dht_io, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(directory_module, "time", SimpleNamespace(monotonic=lambda: _Clock.now))
    table, reads = {}, []
    writers = [Directory(_MemoryDHT(table, identity, reads), "run", 2, home=identity.peer_id) for identity in identities]

    async def announce_rounds(rounds: int) -> None:
        for _ in range(rounds):
            for writer, identity in zip(writers, identities):
                await writer.read([1])
                assert await writer.store(_record(identity, 1), expiration_s=6.0)
            _Clock.now += 2.0

    asyncio.run(announce_rounds(60))
    # each writer reads two shards a poll, so it sees part of the stage, but all agree on its size and level
    assert {writer.levels()[1] for writer in writers} <= {2, 3}, [w.levels() for w in writers]
    sizes = [writer.size(1) for writer in writers]
    assert 36 <= sum(sizes) / len(sizes) <= 44, sizes  # the estimator is unbiased: their mean is the stage's size
    # one writer's estimate spreads with how unevenly the records fall across shards (a standard deviation of up to
    # ~5 here); within a factor 2 of the size, a reader's probe window (PROBE_REACH levels around its own) finds it
    assert PROBE_REACH == 1 and all(20 <= size <= 80 for size in sizes), sizes
    # level 0 holds only the records of the first rounds, expired
    assert all(item.expiration_time <= _Clock.now for item in table[stage_key("run", 1)].values())

    reader_identity = load_or_create_identity(None)
    reads.clear()
    reader = Directory(_MemoryDHT(table, reader_identity, reads), "run", 2, home=reader_identity.peer_id, rotate=1)

    async def poll(times: int) -> None:
        for _ in range(times):
            await reader.read([1])

    asyncio.run(poll(1))  # the first probe: one shard per level, along FIRST_PROBE_CHAINS chains
    level = reader.levels()[1]
    assert level in (2, 3) and len(reads) <= directory_module.FIRST_PROBE_CHAINS * (MAX_LEVEL + 1)
    asyncio.run(poll(int(coverage_polls(level, rotate=1))))
    assert set(reader.records()) == {identity.peer_id for identity in identities}
    assert max(reads) <= 2.5 * 10  # no key read held much more than a shard's capacity


def test_a_small_stage_is_read_whole_and_a_withdrawn_record_leaves_the_view(identities, monkeypatch):
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(dht_io, "get_dht_time", lambda: _Clock.now)
    table, reads = {}, []
    dhts = [_MemoryDHT(table, identity, reads) for identity in identities[:3]]
    writers = [Directory(dht, "run", 1, home=dht.identity.peer_id) for dht in dhts]

    async def go():
        for writer, dht in zip(writers, dhts):
            await writer.store(_record(dht.identity, 0), expiration_s=6.0)
        await writers[0].read()
        assert set(writers[0].records()) == {dht.identity.peer_id for dht in dhts}
        assert list(table) == [stage_key("run", 0)]  # one key: the layout of a small run
        del table[stage_key("run", 0)][dhts[2].identity.owner_subkey]
        writers[0].stages[0].probed_at = _Clock.now  # no probe due: the whole level-0 key is read
        await writers[0].read()
        assert set(writers[0].records()) == {dht.identity.peer_id for dht in dhts[:2]}

    asyncio.run(go())


def test_a_fresh_copy_adds_records_and_withdrawals_while_only_a_whole_read_drops_what_it_lacks(
        identities, monkeypatch):
    """A read that stops at the first fresh copy may get one that missed a store: the records it lacks stay in the
    view (till they expire or a whole read drops them), a withdrawal in it leaves; a node that serves the DHT reads
    whole until it settled (its own copy holds only the stores since it started)."""
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(dht_io, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(directory_module, "time", SimpleNamespace(monotonic=lambda: _Clock.now))
    table, reads = {}, []
    dhts = [_MemoryDHT(table, identity, reads) for identity in identities[:4]]
    writers = [Directory(dht, "run", 1, home=dht.identity.peer_id) for dht in dhts]
    reader_dht = dhts[0]
    reader = Directory(reader_dht, "run", 1, home=reader_dht.identity.peer_id, fresh_s=60.0, settle_s=45.0)
    reader.stages[0].probed_at = _Clock.now + 1e6  # no probe due in this test: probes always read whole
    key = stage_key("run", 0)
    ids = [dht.identity.peer_id for dht in dhts]

    async def go():
        for writer, dht in zip(writers, dhts):
            await writer.store(_record(dht.identity, 0), expiration_s=120.0)
        await reader.read()
        assert reader_dht.fresh_s is None and set(reader.records()) == set(ids)  # not settled: whole
        _Clock.now += 46.0
        missing = table[key].pop(dhts[3].identity.owner_subkey)  # this copy missed one owner's store
        await reader.read()
        assert reader_dht.fresh_s == 60.0 and set(reader.records()) == set(ids)  # kept: the copy may be partial
        await dht_io.store_record(dhts[2], key, None, expiration_s=120.0)  # the owner leaves
        await reader.read()
        assert set(reader.records()) == set(ids) - {ids[2]}
        await reader.read(whole=True)
        assert reader_dht.fresh_s is None and set(reader.records()) == set(ids[:2])
        table[key][dhts[3].identity.owner_subkey] = missing
        await reader.read()
        assert set(reader.records()) == set(ids) - {ids[2]}

    asyncio.run(go())


def test_a_failed_read_keeps_the_view_or_raises_when_strict(identities, monkeypatch):
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(dht_io, "get_dht_time", lambda: _Clock.now)
    table, reads = {}, []
    dht = _MemoryDHT(table, identities[0], reads)
    reader = Directory(dht, "run", 1, home=identities[0].peer_id)

    async def go():
        await reader.store(_record(identities[0], 0), expiration_s=6.0)
        assert await reader.read()

        def broken(fn, return_future):
            raise ConnectionError("DHT process gone")
        dht.run_coroutine = broken
        assert not await reader.read()
        assert set(reader.records()) == {identities[0].peer_id}
        with pytest.raises(LookupError):
            await reader.read(strict=True)

    asyncio.run(go())
    assert math.isfinite(reader.size(0))


def test_a_failed_probe_is_retried_within_a_share_of_the_period_and_counts_as_the_first(identities, monkeypatch):
    """Until its first probe succeeds a reader stores at level 0 only, where readers of a sharded stage do not
    look: so a failed probe is tried again after ``PROBE_RETRY_SHARE`` of the period, and the probe that then
    succeeds sets the estimate whole (it is not averaged with the estimate of a probe that never happened)."""
    monkeypatch.setattr(layout, "SHARD_CAPACITY", 10)
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(dht_io, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(directory_module, "time", SimpleNamespace(monotonic=lambda: _Clock.now))
    table, reads = {}, []
    level = level_for(len(identities))  # 40 replicas: level 2, 4 shards of 10

    async def go():
        for identity in identities:
            writer = Directory(_MemoryDHT(table, identity, reads), "run", 1, home=identity.peer_id)
            writer.stages[0].level, writer.stages[0].estimate = level, float(len(identities))
            assert await writer.store(_record(identity, 0), expiration_s=600.0)
        newcomer = load_or_create_identity(None)
        dht = _MemoryDHT(table, newcomer, reads)
        reader = Directory(dht, "run", 1, home=newcomer.peer_id, probe_period_s=10.0)
        working = dht.run_coroutine

        def broken(fn, return_future):
            raise ConnectionError("lookup timed out")
        dht.run_coroutine = broken
        share = directory_module.PROBE_RETRY_SHARE
        for failures in (1, 2):  # the wait doubles with each failure in a row
            assert reader.probe_is_due(0) and not await reader.read()
            _Clock.now += 0.9 * share * 2 ** (failures - 1) * 10.0
            assert not reader.probe_is_due(0)
            _Clock.now += 0.2 * share * 2 ** (failures - 1) * 10.0
        dht.run_coroutine = working
        assert reader.probe_is_due(0)
        assert await reader.read()
        assert reader.levels()[0] in write_levels(len(identities)) and reader.size(0) > 20, reader.size(0)

    asyncio.run(go())


def test_a_read_while_a_probe_of_the_stage_is_in_flight_does_not_probe_it_again(identities, monkeypatch):
    """Two readers of one directory (a peer's coordinator and its announcer) may read at once: while one read probes a
    stage, the other reads the stage's shards only, rather than a second probe of tens of keys."""
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: _Clock.now)
    monkeypatch.setattr(dht_io, "get_dht_time", lambda: _Clock.now)
    table, reads = {}, []
    dht = _MemoryDHT(table, identities[0], reads)
    reader = Directory(dht, "run", 2, home=identities[0].peer_id)
    asked: List[List[str]] = []
    answer = dht.run_coroutine

    async def go():
        held = asyncio.get_running_loop().create_future()

        def slow(fn, return_future):
            asked.append(list(fn.keywords["keys"]))
            if len(asked) > 1:
                return answer(fn, return_future)
            future = asyncio.get_running_loop().create_future()
            held.add_done_callback(lambda _: future.set_result(answer(fn, return_future).result()))
            return future

        dht.run_coroutine = slow
        first = asyncio.create_task(reader.read([0]))
        while not asked:
            await asyncio.sleep(0)
        assert reader.probe_is_due(0)
        assert await reader.read([0, 1])  # stage 0: its shard only; stage 1: its own probe
        held.set_result(None)
        assert await first

    asyncio.run(go())

    def of_stage(keys: List[str], stage: int) -> List[str]:
        return [key for key in keys if key == stage_key("run", stage) or key.startswith(f"run_stage{stage}_")]

    assert len(of_stage(asked[0], 0)) > 1  # the first read probed stage 0's levels
    assert of_stage(asked[1], 0) == [stage_key("run", 0)]  # the second read only its shard
    assert len(of_stage(asked[1], 1)) > 1  # and probed stage 1, which no read was probing
