"""A model of the control plane's DHT traffic: bytes per second per peer and the largest message, by swarm size.

It follows the live layout and readers (:mod:`swarm.policy.directory`, :mod:`swarm.dht.directory`): a
stage's records are split into ``2**level`` shards of about ``SHARD_CAPACITY`` records. Every peer

- re-stores its record every ``announce_period_s`` at each level it writes (``write_levels``; a store
  is a Kademlia lookup of ``log2(N)`` hops, then the record to ``replication`` nodes; the lookup is for the
  id beside the key's, so its answers carry nodes, not the shard: see ``swarm.dht.node.store_in_dht``);
- reads its own stage every ``read_period_s`` (its own shard and ``rotate`` more), and every other stage
  every ``announce_period_s`` (the same number of shards): one lookup per shard, ``log2(N)`` small hops,
  and the shard's records from ``read_copies`` holders (a read stops at the first fresh copy, but the
  nodes asked at the same time answer too);
- probes every stage every ``probe_period_s``: ``chains`` chains of one shard per level probed (every level
  on one probe in ``FULL_PROBE_EVERY``, those next to the stage's own on the others), of which the levels
  written hold records (about a shard's worth per level written).

Per-peer traffic is then ``O(log N)`` (the hops), and the largest message is one shard. ``calibrate``
fits a per-byte overhead to live measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from swarm.policy.directory import level_for, mean_probe_levels, shard_count, write_levels
from swarm.policy.steps import (
    AVERAGING_READ_S,
    CLOCK_ASKED,
    CLOCK_WATCH_S,
    CLOCK_WATCHERS,
    FOLLOWER_READ_S,
    StageView,
    clock_watch_period_s,
    seconds_between_reads,
)

__all__ = [
    "TrafficModel",
    "ProgressModel",
    "shard_value_bytes",
    "per_peer_bytes_per_s",
    "progress_bytes_per_s",
    "approach_reads",
    "trainer_bytes_per_s",
    "calibrate",
    "MESSAGE_CAP_BYTES",
]

MESSAGE_CAP_BYTES = 4 * 1024 * 1024  # hivemind's cap on a unary protobuf message


@dataclass(frozen=True)
class TrafficModel:
    record_bytes: float  # a stored record: msgpack, signature and owner subkey
    num_stages: int
    announce_period_s: float = 60.0  # PeerConfig.announce_period_s: stores, and reads of the other stages
    # reads of the peer's own stage: live, once an announce period (near a global step stage-mates exchange
    # progress by direct calls instead: ProgressModel)
    read_period_s: float = 60.0
    probe_period_s: float = 480.0  # swarm.dht.directory.probe_period_for(announce_period_s)
    chains: int = 4  # swarm.dht.directory.PROBE_CHAINS
    rotate: int = 1  # shards a read covers besides the reader's own
    replication: int = 5  # nodes a value is stored on (hivemind's num_replicas default)
    read_copies: int = 2  # copies of a shard a read receives: swarm.dht.node.FRESH_LOOKUP_WORKERS nodes asked at once
    hop_bytes: float = 600.0  # request + reply of one lookup hop without values
    overhead: float = 1.0  # bytes on the wire per byte of value (calibrated)
    # stages a peer reads (its own included): every stage (None), or its own and the clock stage (2), as the
    # live peer does unless it rebalances
    stages_read: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.record_bytes <= 0 or self.announce_period_s <= 0 or self.read_period_s <= 0:
            raise ValueError("num_stages >= 1 and positive record size and periods are required")


def _stage_size(model: TrafficModel, num_peers: int) -> int:
    return math.ceil(num_peers / model.num_stages)


def shard_value_bytes(model: TrafficModel, num_peers: int) -> float:
    """Bytes of one shard's value at the level of the stage's size: the largest message a read returns."""
    size = _stage_size(model, num_peers)
    return math.ceil(size / shard_count(level_for(size))) * model.record_bytes


def _hops(num_peers: int) -> float:
    return max(1.0, math.log2(max(num_peers, 2)))


def per_peer_bytes_per_s(model: TrafficModel, num_peers: int) -> Dict[str, float]:
    """Bytes per second one peer sends and receives, by what for (``store``, ``read``, ``probe``, ``total``)."""
    hops, size = _hops(num_peers), _stage_size(model, num_peers)
    level = level_for(size)
    shards_read = min(1 + model.rotate, shard_count(level))
    shard_records = size / shard_count(level)
    lookup = hops * model.hop_bytes
    # a store sends the record to the replication nodes after a lookup whose answers carry nodes only
    store = len(write_levels(size)) * (lookup + model.replication * model.record_bytes * model.overhead)
    one_stage = shards_read * (lookup + model.read_copies * shard_records * model.record_bytes * model.overhead)
    stages_read = model.num_stages if model.stages_read is None else min(model.stages_read, model.num_stages)
    reads_per_s = 1 / model.read_period_s + (stages_read - 1) / model.announce_period_s
    written = len(write_levels(size))
    shard_bytes = written * shard_records * model.record_bytes * model.overhead
    probe = model.chains * (mean_probe_levels(level) * lookup + shard_bytes)
    # what others send to this peer while it serves their lookups and stores is, on average, as much again
    rates = {
        "store": 2 * store / model.announce_period_s,
        "read": 2 * one_stage * reads_per_s,
        "probe": 2 * probe * stages_read / model.probe_period_s,
    }
    rates["total"] = sum(rates.values())
    return rates


def calibrate(model: TrafficModel, measured: Sequence[tuple]) -> TrafficModel:
    """The model with ``overhead`` fitted (least squares through the origin) to live ``(num_peers,
    bytes_per_s_per_peer)`` pairs, ``hop_bytes`` kept."""
    base = dataclasses.replace(model, overhead=1.0)
    fixed, per_overhead = [], []
    for num_peers, _ in measured:
        with_one = per_peer_bytes_per_s(base, num_peers)["total"]
        zero = per_peer_bytes_per_s(dataclasses.replace(base, overhead=0.0), num_peers)["total"]
        fixed.append(zero)
        per_overhead.append(with_one - zero)
    numerator = sum(v * (y - f) for v, f, (_, y) in zip(per_overhead, fixed, measured))
    denominator = sum(v * v for v in per_overhead)
    overhead = max(numerator / denominator, 0.0) if denominator > 0 else 1.0
    return dataclasses.replace(model, overhead=overhead)


# ---- the control plane as a whole: DHT traffic at minute-scale periods, progress calls near steps ----


@dataclass(frozen=True)
class ProgressModel:
    """Progress calls between replicas (:mod:`swarm.server.progress`), each one exchange of two small messages:
    made near a global step (the clock stage a few times as it fills its batch, the others every
    ``FOLLOWER_READ_S``), once when a replica closes a step, once per step by a replica of another stage that a
    trainer tells the clock moved on, and while a step is averaged."""

    exchange_bytes: float  # one call on the wire, request and reply: payloads, framing and TCP/IP headers
    poll_period_s: float = 0.25  # live PeerConfig.poll_period_s
    near_s: float = 5.0  # swarm.policy.steps.NEAR_TARGET_S: how long before a step replicas call each other
    step_s: float = 60.0  # seconds a global step takes
    averaging_s: float = 5.0  # seconds a step's all-reduce takes
    max_asked: int = 8  # swarm.server.progress.MAX_ASKED


def approach_reads(near_s: float, poll_period_s: float) -> int:
    """Reads of the clock stage's replica in the last ``near_s`` seconds before it fills its batch: the waits the
    live policy picks (:func:`swarm.policy.steps.seconds_between_reads`), replayed on a stage that fills at a
    steady rate (each read after ``APPROACH_SHARE`` of the time left, every poll period in the last ones)."""
    target, rate = 10**9, 1000.0  # a batch far larger than the window: only the time left decides
    reads, left = 0, near_s
    while left > 0:
        view = StageView(
            peer_id="",
            is_clock=True,
            target_batch_size=target,
            step=0,
            accum_step=0,
            samples_pending=math.ceil(target - rate * left),
            samples_admitted=0,
            digest="",
            averaging=False,
            samples_per_s=rate,
        )
        reads, left = reads + 1, left - seconds_between_reads(view, poll_period_s, math.inf)
    return reads


def progress_bytes_per_s(model: ProgressModel, num_peers: int, num_stages: int) -> Dict[str, float]:
    """Bytes per second of progress calls through one replica, averaged over a step: ``peer`` for a replica of
    a stage that is not the last, ``clock_peer`` for one of the last (which the other stages ask).

    Per step, a replica makes its reads (:func:`approach_reads` on the clock stage, one every
    ``FOLLOWER_READ_S`` of the near window elsewhere, one every ``AVERAGING_READ_S`` of the all-reduce) and one
    call to tell its mates it closed the step, each asking at most ``max_asked`` stage-mates, and is asked as
    often by them (a mate that called is not asked back in the same period, so this bounds it from above). The
    ``CLOCK_WATCHERS`` of every other stage also ask ``CLOCK_ASKED`` clock replicas, once a clock-watch period
    (:func:`swarm.policy.steps.clock_watch_period_s`) of their reads and once per step when a trainer tells
    them the clock moved on; every such call lands on one of the clock's replicas."""
    replicas = max(1, math.ceil(num_peers / num_stages))
    near_s = min(model.near_s, model.step_s)
    averaging = math.ceil(model.averaging_s / max(model.poll_period_s, AVERAGING_READ_S))
    follower_s = max(model.poll_period_s, FOLLOWER_READ_S)
    clock_reads = approach_reads(near_s, model.poll_period_s) + averaging + 1
    follower_reads = math.ceil(near_s / follower_s) + averaging + 1
    mates = 2 * min(model.max_asked, replicas - 1)
    watch_s = clock_watch_period_s(num_stages, replicas, max(model.poll_period_s, CLOCK_WATCH_S))
    asked = min(CLOCK_ASKED, replicas)
    # per step, made by one replica of another stage: a watcher's reads and the read a hint makes
    clock_calls = min(CLOCK_WATCHERS, replicas) / replicas * asked * (math.ceil(near_s / watch_s) + 1)
    clock_in = (num_stages - 1) * clock_calls  # per step, taken by one clock replica (as many replicas per stage)
    per_s = model.exchange_bytes / model.step_s
    return {
        "peer": per_s * (follower_reads * mates + (clock_calls if num_stages > 1 else 0.0)),
        "clock_peer": per_s * (clock_reads * mates + (clock_in if num_stages > 1 else 0.0)),
    }


def trainer_bytes_per_s(
    model: TrafficModel,
    num_peers: int,
    refresh_period_s: float,
    trainer_record_bytes: float,
    stages_per_refresh: Optional[int] = None,
    probe_period_s: Optional[float] = None,
) -> float:
    """Bytes per second one trainer sends and receives: ``stages_per_refresh`` stages read once a refresh period
    (None: every stage; a trainer is a DHT client: it serves no lookups), so each stage once in
    ``ceil(stages / stages_per_refresh)`` periods; a probe of every stage on its first read ``probe_period_s``
    after the last (None: the model's); and its own record stored once a refresh period."""
    hops, size = _hops(num_peers), _stage_size(model, num_peers)
    level = level_for(size)
    lookup = hops * model.hop_bytes
    shards_read = min(1 + model.rotate, shard_count(level))
    one_stage = shards_read * (
        lookup + model.read_copies * size / shard_count(level) * model.record_bytes * model.overhead
    )
    shard_bytes = len(write_levels(size)) * size / shard_count(level) * model.record_bytes * model.overhead
    probe = model.chains * (mean_probe_levels(level) * lookup + shard_bytes)
    store = lookup + model.replication * trainer_record_bytes * model.overhead
    read = model.num_stages if stages_per_refresh is None else min(model.num_stages, stages_per_refresh)
    cycle_s = refresh_period_s * math.ceil(model.num_stages / read)
    probe_s = math.ceil((probe_period_s or model.probe_period_s) / cycle_s) * cycle_s
    return read * one_stage / refresh_period_s + model.num_stages * probe / probe_s + store / refresh_period_s
