"""Plain-data view of the swarm that every policy decision is computed from.

A snapshot is what a peer or trainer reads from the DHT at one moment: a list of
:class:`PeerInfo`. Policies never touch the network; the live system builds snapshots from
DHT records, the simulator builds them from its own state, and both feed the same
functions in :mod:`swarm.policy.routing` and :mod:`swarm.policy.rebalance`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PeerInfo", "PEER_STATES"]

PEER_STATES = ("joining", "online", "leaving")


@dataclass(frozen=True)
class PeerInfo:
    """One peer as seen in a snapshot of the DHT."""

    peer_id: str
    stage: int
    state: str = "online"  # "joining" | "online" | "leaving"
    throughput: float = 0.0  # samples/s, EMA of real work; 0.0 = not measured yet
    queue_length: int = 0  # requests waiting at the peer

    def __post_init__(self) -> None:
        # Snapshots come from untrusted DHT records: reject nonsense here so that policies
        # can assume sane numbers (a NaN throughput would poison every weight).
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise ValueError(f"peer_id must be a non-empty string, got {self.peer_id!r}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"stage must be a non-negative int, got {self.stage!r}")
        if self.state not in PEER_STATES:
            raise ValueError(f"state must be one of {PEER_STATES}, got {self.state!r}")
        if not isinstance(self.throughput, (int, float)) or not math.isfinite(self.throughput) or self.throughput < 0:
            raise ValueError(f"throughput must be a finite number >= 0, got {self.throughput!r}")
        if isinstance(self.queue_length, bool) or not isinstance(self.queue_length, int) or self.queue_length < 0:
            raise ValueError(f"queue_length must be a non-negative int, got {self.queue_length!r}")
