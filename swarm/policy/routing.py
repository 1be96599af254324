"""Which replica of a stage a trainer sends its next micro-batch to.

SWARM's "stochastic wiring": each replica is chosen with probability proportional to its
measured throughput, so over time every replica receives a share of the work matching what
it can do, and no global scheduler is needed. Replicas that fail are banned for a while,
with exponential backoff so that a flapping peer costs less and less.

Everything here is pure given ``now`` and the seed: the live trainer passes
``time.monotonic()``, the simulator passes simulated time, tests pass whatever they like.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from typing import Collection, Dict, Optional, Sequence

import numpy as np

from swarm.policy.snapshot import PeerInfo

__all__ = ["NoPeerAvailable", "routing_weights", "Router"]


class NoPeerAvailable(RuntimeError):
    """No replica of a stage can take a micro-batch right now (none online, or all banned)."""

    def __init__(self, message: str, stage: Optional[int] = None) -> None:
        super().__init__(message)
        self.stage = stage


def routing_weights(throughputs: Sequence[float]) -> np.ndarray:
    """Probabilities proportional to throughput; unmeasured (0) peers get the mean of measured ones so new peers get tried; all-unmeasured -> uniform."""
    values = np.asarray(throughputs, dtype=np.float64).reshape(-1)
    if values.size == 0:
        return values
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"throughputs must be finite and >= 0, got {list(throughputs)}")
    measured = values > 0
    if not measured.any():
        return np.full(values.size, 1.0 / values.size)
    # A new peer has no measurement until it has served something; giving it the average
    # share lets it be tried (and measured) without trusting it more than a typical peer.
    values = np.where(measured, values, values[measured].mean())
    return values / values.sum()


class Router:
    """Per-trainer routing state: stochastic wiring weighted by throughput + bans with exponential backoff. Pure given `now` (no clock reads)."""

    def __init__(self, seed: int = 0, ban_base_s: float = 1.0, ban_max_s: float = 60.0):
        if not (math.isfinite(ban_base_s) and ban_base_s > 0):
            raise ValueError(f"ban_base_s must be a finite number > 0, got {ban_base_s!r}")
        if not (math.isfinite(ban_max_s) and ban_max_s >= ban_base_s):
            raise ValueError(f"ban_max_s must be finite and >= ban_base_s, got {ban_max_s!r}")
        self.ban_base_s = float(ban_base_s)
        self.ban_max_s = float(ban_max_s)
        self._rng = random.Random(seed)
        self._banned_until: Dict[str, float] = {}
        self._num_failures: Dict[str, int] = {}

    def choose(self, candidates: Sequence[PeerInfo], now: float, exclude: Collection[str] = ()) -> PeerInfo:
        """Only state=='online', not banned, not excluded; raises NoPeerAvailable."""
        options = self.distribution(candidates, now, exclude)
        if not options:
            raise self._explain_empty(candidates, now, exclude)
        if len(options) == 1:
            return options[0][0]
        eligible = [peer for peer, _ in options]
        cumulative = list(itertools.accumulate(p for _, p in options))
        index = bisect.bisect_right(cumulative, self._rng.random() * cumulative[-1])
        return eligible[min(index, len(eligible) - 1)]

    def distribution(self, candidates: Sequence[PeerInfo], now: float,
                     exclude: Collection[str] = ()) -> list[tuple[PeerInfo, float]]:
        """The probabilities :meth:`choose` draws with: ``(peer, p)`` for each eligible peer.

        The simulator's fluid model routes expected flows with these instead of drawing
        every micro-batch; returns ``[]`` where :meth:`choose` would raise.
        """
        banned_until = self._banned_until  # is_banned, inlined: this runs for every micro-batch
        eligible = [peer for peer in candidates if peer.state == "online" and peer.peer_id not in exclude
                    and not now < banned_until.get(peer.peer_id, -math.inf)]
        if not eligible:
            return []
        return list(zip(eligible, routing_weights([peer.throughput for peer in eligible]).tolist()))

    def ban(self, peer_id: str, now: float) -> float:
        """Ban ``peer_id`` after a failure; returns the ban duration in seconds.

        The duration doubles with each failure since the last success (capped at
        ``ban_max_s``): a peer that fails once (a transient timeout) is retried soon, one
        that keeps failing stops wasting trainers' retries.
        """
        failures = self._num_failures.get(peer_id, 0)
        duration_s = min(self.ban_base_s * (2.0 ** min(failures, 60)), self.ban_max_s)
        self._num_failures[peer_id] = failures + 1
        self._banned_until[peer_id] = max(self._banned_until.get(peer_id, -math.inf), now + duration_s)
        return duration_s

    def report_success(self, peer_id: str) -> None:
        """The peer served a request: forget its failures, so its next ban starts short."""
        self._num_failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)

    def is_banned(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` is still serving a ban at time ``now``."""
        until = self._banned_until.get(peer_id)
        return until is not None and now < until

    def forget(self, peer_id: str) -> None:
        """Drop all state about a peer (e.g. its DHT record expired), bounding memory."""
        self._num_failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)

    @staticmethod
    def _explain_empty(candidates: Sequence[PeerInfo], now: float, exclude: Collection[str]) -> NoPeerAvailable:
        stages = sorted({peer.stage for peer in candidates})
        stage = stages[0] if len(stages) == 1 else None
        where = f"stage {stage}" if stage is not None else (
            f"stages {stages}" if stages else "the requested stage")
        if not candidates:
            return NoPeerAvailable(f"no peer available for {where}: no peers known", stage)
        online = [peer for peer in candidates if peer.state == "online"]
        if not online:
            states = ", ".join(f"{sum(p.state == s for p in candidates)} {s}"
                               for s in ("joining", "leaving") if any(p.state == s for p in candidates))
            return NoPeerAvailable(f"no peer available for {where}: none online ({states})", stage)
        num_excluded = sum(peer.peer_id in exclude for peer in online)
        return NoPeerAvailable(
            f"no peer available for {where}: all {len(online)} online peers are banned or excluded "
            f"({len(online) - num_excluded} banned after failures, {num_excluded} excluded)", stage)
