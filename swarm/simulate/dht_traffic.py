"""A model of the control plane's DHT traffic: bytes per second per peer and the largest message, by swarm size.

Every peer re-stores its record every ``announce_period_s`` (a store reaches ``replication`` nodes after a
Kademlia lookup of ``log2(N)`` hops, each hop a small request) and reads every stage's key every
``read_period_s`` (one lookup per key: ``log2(N)`` small hops, and the value itself from the nodes that
hold it). A stage's key is one DHT value, a dictionary of its replicas' records: reading it moves
``N / num_stages`` records, so the reads of all stages move every record of the swarm.
``calibrate`` fits the per-hop bytes and a per-byte overhead to live measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Sequence

__all__ = ["TrafficModel", "stage_value_bytes", "per_peer_bytes_per_s", "calibrate", "MESSAGE_CAP_BYTES"]

MESSAGE_CAP_BYTES = 4 * 1024 * 1024  # hivemind's cap on a unary protobuf message


@dataclass(frozen=True)
class TrafficModel:
    record_bytes: float  # a stored record: msgpack, signature and owner subkey
    num_stages: int
    announce_period_s: float = 1.0  # live PeerConfig.announce_period_s
    read_period_s: float = 0.25  # live PeerConfig.poll_period_s: a peer reads every stage this often
    replication: int = 5  # nodes a value is stored on (hivemind's num_replicas default)
    hop_bytes: float = 600.0  # request + reply of one lookup hop without values
    overhead: float = 1.0  # bytes on the wire per byte of value (calibrated)

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.record_bytes <= 0 or self.announce_period_s <= 0 or self.read_period_s <= 0:
            raise ValueError("num_stages >= 1 and positive record size and periods are required")


def stage_value_bytes(model: TrafficModel, num_peers: int) -> float:
    """Bytes of one stage's value (all its replicas' records): the largest message a read returns."""
    return math.ceil(num_peers / model.num_stages) * model.record_bytes


def _hops(num_peers: int) -> float:
    return max(1.0, math.log2(max(num_peers, 2)))


def per_peer_bytes_per_s(model: TrafficModel, num_peers: int) -> Dict[str, float]:
    """Bytes per second one peer sends and receives, by what for (``store``, ``read``, ``total``)."""
    hops = _hops(num_peers)
    store = (hops * model.hop_bytes + model.replication * model.record_bytes * model.overhead) / model.announce_period_s
    # every record is read once per read period by every reader (from one holder): N records per read
    read = (model.num_stages * hops * model.hop_bytes
            + num_peers * model.record_bytes * model.overhead) / model.read_period_s
    # what others send to this peer while it serves their lookups and stores is, on average, as much again
    return {"store": 2 * store, "read": 2 * read, "total": 2 * (store + read)}


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
