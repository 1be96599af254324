"""The run's directory of stage peers in the DHT: sharded stage keys, read a bounded part at a time.

Where the records go and which shards one read covers is the pure layout of
:mod:`swarm.policy.directory`; this module does the I/O. A :class:`Directory` belongs to one
reader (a stage peer, a trainer, the dashboard): it remembers the level of every stage it reads,
probes the levels again when they may have changed, and keeps the records it saw until they
expire, so that a reader of a large stage builds its view over a few polls while every single read
moves at most a few shards. A small stage is one key at level 0, read whole on every poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterable, List, Optional, Tuple

from hivemind import DHT
from hivemind.utils import get_dht_time, get_logger

from swarm.dht.node import get_many_in_dht, identity_of, known_nodes
from swarm.dht.store import parse_value, store_record, warn_once
from swarm.metrics import count_dht
from swarm.policy.directory import (
    level_for,
    probe_due,
    probe_estimate,
    probe_levels,
    shard_of,
    shards_to_read,
    write_levels,
)
from swarm.net.dialing import address_book
from swarm.dht.records import PeerRecord, shard_key, withdrawn_ids

__all__ = ["Directory", "fetch_stage_records", "fresh_for", "probe_period_for", "settle_for"]

logger = get_logger(__name__)
PROBE_PERIOD_S = 10.0  # seconds between probes of a stage's levels, at least (see probe_period_for)
PROBE_READS = 8  # reads of a stage between two of its periodic probes
# random chains of shards (one per level probed: policy.directory.probe_levels) a probe reads; the first probe of a
# stage reads more. A chain finds about a shard's worth of records at the levels written, so chains x SHARD_CAPACITY
# records make an estimate
PROBE_CHAINS = 4
FIRST_PROBE_CHAINS = 8
PROBE_WEIGHT = 0.3  # weight of the newest probe in the stage's size estimate (the rest: earlier probes)
# a probe that failed is tried again after this share of the probe period, doubling with each failure in a row up
# to the whole period: not at once (lookups are failing, and a probe is the heaviest read), not only a period later
# (until a probe succeeds, the reader stores at level 0 only, where readers of a sharded stage do not look)
PROBE_RETRY_SHARE = 0.25


@dataclass
class _Stage:
    """What a reader knows of one stage's directory."""

    level: int = 0
    probed_at: float = float("-inf")  # monotonic time of the last probe (or of the retry's time base after a failure)
    probes: int = 0  # probes that succeeded
    probe_failures: int = 0  # probes that failed since the last that succeeded
    read_at: float = float("-inf")  # monotonic time of the last read
    cursor: int = 0  # next shard of the round robin
    estimate: float = 0.0  # the stage's size, as the last probe estimated it
    home_count: int = -1  # other records in the reader's own shard at `level` at its last read; -1: not read yet
    records: Dict[str, Tuple[PeerRecord, float]] = field(default_factory=dict)  # id -> (record, DHT expiration time)
    probing: bool = False  # a read that probes this stage is in flight: another read does not probe it again


def fresh_for(expiration_s: float, announce_period_s: float) -> Optional[float]:
    """``Directory.fresh_s`` for records re-stored every ``announce_period_s`` with ``expiration_s``: a copy that
    took a store within two announce periods; None (ask every node) where that leaves no margin."""
    fresh = expiration_s - 2 * announce_period_s
    return fresh if fresh > 0 else None


def settle_for(announce_period_s: float) -> float:
    """``Directory.settle_s`` of a node that serves the DHT in a run whose records are re-stored every
    ``announce_period_s``: a period and a half, so that every owner's next store reached it."""
    return 1.5 * announce_period_s


def probe_period_for(read_period_s: float) -> float:
    """The probe period of a reader that reads each stage every ``read_period_s``: a probe every
    ``PROBE_READS`` reads (every read would be a probe once the reads are further apart than
    ``PROBE_PERIOD_S``, and a full probe reads every level's shards)."""
    return max(PROBE_PERIOD_S, PROBE_READS * read_period_s)


class Directory:
    """One reader's view of the run's stage directories.

    ``home``: the id whose shard the reader always reads (its own, so a stage peer always sees the
    stage-mates of its own shard). ``rotate``: shards read per stage per read besides the home shard
    (-1: every shard, for readers that want the whole swarm at any cost). ``fresh_s``: a lookup of a shard stops
    at the first node whose copy took a store lately (it outlives ``fresh_s`` seconds from now; records are
    re-stored every announce period), rather than asking every node near the key; None asks them all.
    ``settle_s``: for a reader whose node serves the DHT, the seconds after this directory's creation during which
    every read still asks all the nodes near a key. Such a node answers a lookup from its own copy first, and
    holds only the stores that reached it since it started: once every owner re-stored (an announce period and a
    margin), its copy is whole. A reader that keeps no values (a DHT client) needs none."""

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        num_stages: int,
        home: str,
        rotate: int = 1,
        probe_period_s: float = PROBE_PERIOD_S,
        fresh_s: Optional[float] = None,
        settle_s: float = 0.0,
    ):
        self.dht, self.run_id, self.num_stages, self.home = dht, run_id, num_stages, home
        self.rotate, self.probe_period_s, self.fresh_s = rotate, probe_period_s, fresh_s
        self.settled_at = time.monotonic() + settle_s
        self.stages = [_Stage() for _ in range(num_stages)]
        self.nodes_known = -1  # the DHT node's routing table after the last store (-1: none yet)

    # ---- reading ----

    async def read(
        self, stages: Optional[Iterable[int]] = None, timeout: float = 5.0, strict: bool = False, whole: bool = False
    ) -> bool:
        """Read ``stages`` (default: every stage) in one DHT traversal and update the view; whether the read
        succeeded. A failed read keeps the view as it was, or with ``strict`` raises ``LookupError``. ``whole``
        asks every node near each key, as a probe does, even where ``fresh_s`` would stop at the first fresh copy
        (a reader that must not miss a record: choosing a stage to join)."""
        identity_of(self.dht)  # a DHT without the signature validator would return unverified values
        stages = list(range(self.num_stages)) if stages is None else list(stages)
        now = time.monotonic()
        plans = {stage: self._plan(stage, now) for stage in stages}
        if not await self._read_plans(plans, timeout, strict, now, whole):
            return False
        # a probe that moved a whole-swarm reader to a sharded level: the rest of that level at once
        second = {
            stage: self._plan(stage, now)
            for stage in stages
            if self.rotate < 0 and plans[stage][0] and self.stages[stage].level > 0
        }
        return await self._read_plans(second, timeout, strict, now, whole) if second else True

    def _plan(self, stage: int, now: float) -> Tuple[List[List[str]], Dict[str, Tuple[int, int]]]:
        """The probe chains (empty: no probe) and the keys, key -> (level, shard), of one stage's next read."""
        known = self.stages[stage]
        if self.probe_is_due(stage, now) and not known.probing:
            # chains through random points: the reader's own shards would give every probe the same sample
            chains: List[List[str]] = []
            keyed: Dict[str, Tuple[int, int]] = {}
            for _ in range(FIRST_PROBE_CHAINS if known.probes == 0 else PROBE_CHAINS):
                point = secrets.token_hex(8)
                chain = [
                    (shard_key(self.run_id, stage, level, shard_of(point, level)), level, shard_of(point, level))
                    for level in probe_levels(known.level, known.probes)
                ]
                chains.append([key for key, _, _ in chain])
                keyed.update({key: (level, shard) for key, level, shard in chain})
            return chains, keyed
        shards, known.cursor = shards_to_read(known.level, shard_of(self.home, known.level), known.cursor, self.rotate)
        return [], {shard_key(self.run_id, stage, known.level, shard): (known.level, shard) for shard in shards}

    async def _read_plans(
        self,
        plans: Dict[int, Tuple[List[List[str]], Dict[str, Tuple[int, int]]]],
        timeout: float,
        strict: bool,
        now: float,
        whole: bool = False,
    ) -> bool:
        keys = sorted({key for _, keyed in plans.values() for key in keyed})
        probed = [stage for stage, (chains, _) in plans.items() if chains]
        whole = whole or bool(probed) or now < self.settled_at  # a probe counts what every node holds
        for stage in probed:
            self.stages[stage].probing = True
        try:
            return await self._lookup(plans, keys, timeout, strict, now, whole)
        finally:
            for stage in probed:
                self.stages[stage].probing = False

    async def _lookup(
        self,
        plans: Dict[int, Tuple[List[List[str]], Dict[str, Tuple[int, int]]]],
        keys: List[str],
        timeout: float,
        strict: bool,
        now: float,
        whole: bool,
    ) -> bool:
        try:
            found = await asyncio.wait_for(
                self.dht.run_coroutine(
                    partial(get_many_in_dht, keys=keys, timeout=timeout, fresh_s=None if whole else self.fresh_s),
                    return_future=True,
                ),
                timeout + 1.0,
            )
            if found is None:
                raise asyncio.TimeoutError(f"no answer within {timeout:.1f}s")
        except (asyncio.TimeoutError, Exception) as e:
            count_dht("read", False, len(keys))
            logger.warning(f"DHT lookup of {self.run_id!r} stages failed: {type(e).__name__}: {e}")
            for stage, (chains, _) in plans.items():
                if chains:  # the next probe after PROBE_RETRY_SHARE of the period, doubling with each failure
                    known = self.stages[stage]
                    known.probe_failures += 1
                    wait = min(1.0, PROBE_RETRY_SHARE * 2 ** (known.probe_failures - 1)) * self.probe_period_s
                    known.probed_at = now - self.probe_period_s + wait
            if strict:
                raise LookupError(f"DHT lookup of {self.run_id!r} stages failed") from e
            return False
        count_dht("read", True, len(keys))
        for stage, (chains, keyed) in plans.items():
            values = {key: (level, shard, found.get(key)) for key, (level, shard) in keyed.items()}
            self._update(stage, chains, values, now, whole)
        return True

    def _update(
        self, stage: int, chains: List[List[str]], values: Dict[str, Tuple[int, int, object]], now: float, whole: bool
    ) -> None:
        known = self.stages[stage]
        parsed = {key: (level, shard, parse_value(key, raw, PeerRecord)) for key, (level, shard, raw) in values.items()}
        if chains:
            estimate = sum(self._chain_estimate([parsed[key] for key in chain]) for chain in chains) / len(chains)
            # a probe sees about one shard's worth of records: smoothed, so that readers' levels agree
            if known.probes:
                estimate = (1 - PROBE_WEIGHT) * known.estimate + PROBE_WEIGHT * estimate
            known.estimate = estimate
            level = level_for(known.estimate)
            if level != known.level:
                logger.debug(f"stage {stage}: directory level {known.level} -> {level} (~{known.estimate:.0f} records)")
                known.level, known.cursor, known.home_count = level, 0, -1
            known.probed_at, known.probes, known.probe_failures = now, known.probes + 1, 0
        if whole:
            # a record of a shard read whole just now that the shard no longer holds has gone (withdrawn or moved);
            # the first fresh copy of a shard may lack a record that reached other nodes, which stays till it expires
            read_shards = {shard for level, shard, _ in parsed.values() if level == known.level}
            known.records = {
                peer_id: entry
                for peer_id, entry in known.records.items()
                if shard_of(peer_id, known.level) not in read_shards
            }
        else:  # a withdrawal newer than the record seen is seen in any copy that took it
            withdrawn: Dict[str, float] = {}
            for _, _, raw in values.values():
                for peer_id, expiration in withdrawn_ids(getattr(raw, "value", None)).items():
                    withdrawn[peer_id] = max(withdrawn.get(peer_id, 0.0), expiration)
            known.records = {
                peer_id: entry for peer_id, entry in known.records.items() if withdrawn.get(peer_id, 0.0) < entry[1]
            }
        home = shard_of(self.home, known.level)
        for key, (level, shard, entries) in parsed.items():
            if level == known.level and shard == home:
                known.home_count = len(entries.keys() - {self.home})
            for peer_id, (record, expiration) in entries.items():
                if record.stage != stage:
                    warn_once(key, f"record of {peer_id} names stage {record.stage}, stored under stage {stage}")
                    continue
                current = known.records.get(peer_id)
                if current is None or expiration >= current[1]:
                    known.records[peer_id] = (record, expiration)
        known.read_at = now

    def _chain_estimate(self, chain: List[Tuple[int, int, Dict[str, tuple]]]) -> float:
        """The stage's size from one probe chain, the reader's own record counted as itself."""
        lowest: Dict[str, int] = {}
        for level, _, entries in chain:
            for peer_id in entries:
                lowest[peer_id] = min(level, lowest.get(peer_id, level))
        return probe_estimate(level for peer_id, level in lowest.items() if peer_id != self.home) + (
            self.home in lowest
        )

    # ---- the view ----

    def records(self) -> Dict[str, PeerRecord]:
        """Every unexpired record seen, by peer id; a peer found under two stages (it just moved): its newest."""
        now_dht = get_dht_time()
        merged: Dict[str, Tuple[PeerRecord, float]] = {}
        for known in self.stages:
            known.records = {peer_id: entry for peer_id, entry in known.records.items() if entry[1] > now_dht}
            for peer_id, (record, expiration) in known.records.items():
                if peer_id not in merged or expiration > merged[peer_id][1]:
                    merged[peer_id] = (record, expiration)
        address_book.learn({peer_id: record.addresses for peer_id, (record, _) in merged.items()})
        return {peer_id: record for peer_id, (record, _) in merged.items()}

    def size(self, stage: int) -> float:
        """The stage's estimated number of records: at level 0 those read (the whole stage), above it the last
        probe's estimate."""
        known = self.stages[stage]
        return float(len(known.records)) if known.level == 0 else known.estimate

    def probe_is_due(self, stage: int, now: Optional[float] = None) -> bool:
        """Whether the next read of ``stage`` probes its levels (``now``: monotonic time, default the clock's)."""
        known = self.stages[stage]
        now = time.monotonic() if now is None else now
        return probe_due(known.level, known.home_count, self.size(stage), now - known.probed_at, self.probe_period_s)

    def stages_due(self, period_s: Optional[float]) -> List[int]:
        """The stages last read ``period_s`` seconds ago or longer (records are stored no more often, so an earlier
        read finds nothing new); None: every stage."""
        now = time.monotonic()
        return [stage for stage, known in enumerate(self.stages) if period_s is None or now - known.read_at >= period_s]

    def levels(self) -> List[int]:
        return [known.level for known in self.stages]

    # ---- writing ----

    async def store(self, record: PeerRecord, expiration_s: float, timeout: float = 5.0) -> bool:
        """Store this node's ``record`` at every level its stage's size may be read at; whether all stores succeeded."""
        size = max(self.size(record.stage), 1.0)
        levels = write_levels(size)
        keys = [shard_key(self.run_id, record.stage, level, shard_of(record.peer_id, level)) for level in levels]
        stored = await asyncio.gather(*(store_record(self.dht, key, record, expiration_s, timeout) for key in keys))
        with contextlib.suppress(Exception):  # a figure for metrics: a DHT shutting down keeps the last one
            self.nodes_known = await self.dht.run_coroutine(known_nodes, return_future=True)
        return all(stored)


async def fetch_stage_records(
    dht: DHT, run_id: str, num_stages: int, timeout: float = 5.0, strict: bool = False
) -> Dict[str, PeerRecord]:
    """Every peer record of the run, read whole (every shard of every stage) in one or two traversals.

    For one-off readers (``swarm status``, the run-agreement check, tests); a reader that polls keeps a
    :class:`Directory`. A failed lookup gives an empty dict and a log line, or with ``strict`` raises
    ``LookupError``."""
    directory = Directory(dht, run_id, num_stages, home=identity_of(dht).peer_id, rotate=-1)
    await directory.read(timeout=timeout, strict=strict)
    return directory.records()
