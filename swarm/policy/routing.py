"""Which replica of a stage a trainer sends its next micro-batch to.

SWARM's "stochastic wiring": each replica is chosen with probability proportional to its
throughput, so over time every replica receives a share of the work matching what it can do,
and no global scheduler is needed. Replicas that fail are banned for a while, with exponential
backoff so that a flapping peer costs less and less.

A replica's announced throughput is only a hint: anyone can announce anything. So announced
values are capped (:func:`cap_announced`), and once a trainer has timed a replica's calls it
routes by its own measurement (:func:`effective_throughputs`), which the replica's announcement
can move by a bounded factor only. A call's wall time includes the network and the queue at a
busy replica, which is exactly what a trainer waits for; but where transfers dominate (small
models, loopback) wall times hardly tell replicas apart, while an honest announcement of the
replica's own compute does: hence the bounded say.

A trainer with ``slow_tolerance`` set also leaves out replicas whose expected completion time is far
worse than their stage-mates' (:mod:`swarm.policy.slow_replicas`), and keeps at most ``max_probes``
calls in flight to a replica it has not timed yet. Leaving a replica out is a verdict nothing revisits
(no call, no new measurement), so it takes a settled measurement: until ``SETTLE_CALLS`` calls of each
kind have come back, a replica counts as untimed there (one slow first call, which pays for the replica's
lazy initialisation, would otherwise shut it out for good).

Everything here is pure given ``now`` and the seed: the live trainer passes
``time.monotonic()``, the simulator passes simulated time, tests pass whatever they like.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import deque
from typing import Collection, Deque, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from swarm.policy.slow_replicas import MAX_PROBES, probe_allowed, worth_waiting_for
from swarm.policy.snapshot import PeerInfo

__all__ = [
    "NoPeerAvailable",
    "routing_weights",
    "cap_announced",
    "effective_throughputs",
    "preferred_replica",
    "Router",
]

FloatArray = Union[Sequence[float], np.ndarray]  # figures per replica, as a list or as an array

ANNOUNCED_CAP = 4.0  # an announced throughput counts at most this multiple of the stage's (lower) median
MEASURED_CAP = 2.0  # an unmeasured replica counts at most this multiple of the best measured one
ANNOUNCED_TRUST = 4.0  # an announcement moves a measured replica's weight by at most this factor either way
MEASURE_WINDOW = 16  # successful calls per replica that its measurement is taken over
MEASURE_QUANTILE = 0.25  # which quantile of those calls' wall seconds per sample is the measurement
SETTLE_CALLS = 3  # calls of each kind timed before the slow rule may leave a replica out


class NoPeerAvailable(RuntimeError):
    """No replica of a stage can take a micro-batch right now (none online, or all banned)."""

    def __init__(self, message: str, stage: Optional[int] = None) -> None:
        super().__init__(message)
        self.stage = stage


def routing_weights(throughputs: FloatArray) -> np.ndarray:
    """Probabilities proportional to throughput; unmeasured (0) peers get the mean of measured ones so new peers
    get tried; all-unmeasured -> uniform."""
    values = _as_throughputs(throughputs, "throughputs")
    if values.size == 0:
        return values
    measured = values > 0
    if not measured.any():
        return np.full(values.size, 1.0 / values.size)
    # A new peer has no measurement until it has served something; giving it the average
    # share lets it be tried (and measured) without trusting it more than a typical peer.
    values = np.where(measured, values, values[measured].mean())
    return values / values.sum()


def cap_announced(announced: Sequence[float], factor: float = ANNOUNCED_CAP) -> np.ndarray:
    """Announced throughputs, each clipped at ``factor`` times the lower median of the positive ones.

    The lower median, because with two replicas the plain median is the mean, which one liar
    announcing 1e12 samples/s controls; the lower one stays an honest value while honest
    replicas are at least half of the stage."""
    values = _as_throughputs(announced, "announced")
    positive = np.sort(values[values > 0])
    if positive.size == 0:
        return values
    return np.minimum(values, factor * positive[(positive.size - 1) // 2])


def effective_throughputs(
    announced: Sequence[float],
    measured: Sequence[float],
    *,
    announced_cap: float = ANNOUNCED_CAP,
    measured_cap: float = MEASURED_CAP,
    announced_trust: float = ANNOUNCED_TRUST,
) -> np.ndarray:
    """What each replica of a stage is routed by (0 = unknown, see :func:`routing_weights`).

    ``measured[i] > 0`` is this trainer's own measurement of replica i (samples/s of wall time).
    Announced values are capped (:func:`cap_announced`) and, once some replicas are measured,
    converted to the measured scale (they count compute alone, measurements also the network and
    queueing) by the median ratio of the replicas that have both. A measured replica is routed
    by its converted announcement kept within ``announced_trust`` times its measurement either
    way, so no announcement beats a large enough measured gap. An unmeasured one gets its
    converted announcement, or the mean measured value if there is none, and never more than
    ``measured_cap`` times the best measured replica: enough to be tried, not to take over."""
    hints = cap_announced(announced, announced_cap)
    timed = _as_throughputs(measured, "measured")
    if timed.shape != hints.shape:
        raise ValueError(f"announced and measured must have the same length, got {hints.size} and {timed.size}")
    is_timed = timed > 0
    if not is_timed.any():
        return hints
    both = is_timed & (hints > 0)
    scale = float(np.median(timed[both] / hints[both])) if both.any() else 0.0  # measured units per announced unit
    converted = hints * scale
    has_hint = converted > 0
    guesses = np.minimum(np.where(has_hint, converted, timed[is_timed].mean()), measured_cap * timed.max())
    trusted = np.where(has_hint, np.clip(converted, timed / announced_trust, timed * announced_trust), timed)
    return np.where(is_timed, trusted, guesses)


def preferred_replica(eligible: Sequence[PeerInfo], prefer: Optional[str]) -> Optional[PeerInfo]:
    """The replica a call should go to regardless of throughput, or None to draw one.

    A stage's backward goes back to the replica that ran the micro-batch's forward (``prefer``),
    which may still hold the forward's graph and then skips recomputing it; the draw already
    weighed that replica's throughput when it got the forward. Only an eligible replica (online,
    not banned, not excluded after a failed try) is preferred: a dead or banned one costs
    nothing more than a recomputation elsewhere."""
    if prefer is None:
        return None
    return next((peer for peer in eligible if peer.peer_id == prefer), None)


def _as_throughputs(values: FloatArray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {list(values)}")
    return array


class Router:
    """Per-trainer routing state: stochastic wiring weighted by throughput + bans with exponential backoff.
    Pure given `now` (no clock reads)."""

    def __init__(
        self,
        seed: int = 0,
        ban_base_s: float = 1.0,
        ban_max_s: float = 60.0,
        *,
        announced_cap: float = ANNOUNCED_CAP,
        measured_cap: float = MEASURED_CAP,
        announced_trust: float = ANNOUNCED_TRUST,
        measure_window: int = MEASURE_WINDOW,
        measure_quantile: float = MEASURE_QUANTILE,
        slow_tolerance: float = math.inf,
        max_probes: int = MAX_PROBES,
    ):
        if not (math.isfinite(ban_base_s) and ban_base_s > 0):
            raise ValueError(f"ban_base_s must be a finite number > 0, got {ban_base_s!r}")
        if not (math.isfinite(ban_max_s) and ban_max_s >= ban_base_s):
            raise ValueError(f"ban_max_s must be finite and >= ban_base_s, got {ban_max_s!r}")
        for name, value in (
            ("announced_cap", announced_cap),
            ("measured_cap", measured_cap),
            ("announced_trust", announced_trust),
        ):
            if not value >= 1.0:  # also rejects NaN; inf turns the cap off
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if not (isinstance(measure_window, int) and measure_window >= 1):
            raise ValueError(f"measure_window must be an int >= 1, got {measure_window!r}")
        if not 0.0 <= measure_quantile <= 1.0:
            raise ValueError(f"measure_quantile must be in [0, 1], got {measure_quantile!r}")
        if not slow_tolerance >= 1.0:  # also rejects NaN; inf = plain throughput-proportional routing
            raise ValueError(f"slow_tolerance must be >= 1, got {slow_tolerance!r}")
        if not (isinstance(max_probes, int) and max_probes >= 1):
            raise ValueError(f"max_probes must be an int >= 1, got {max_probes!r}")
        self.slow_tolerance, self.max_probes = float(slow_tolerance), max_probes
        self.ban_base_s = float(ban_base_s)
        self.ban_max_s = float(ban_max_s)
        self.announced_cap, self.measured_cap, self.announced_trust = announced_cap, measured_cap, announced_trust
        self.measure_window, self.measure_quantile = measure_window, measure_quantile
        self._rng = random.Random(seed)
        self._banned_until: Dict[str, float] = {}
        self._distrusted_until: Dict[str, float] = {}  # bans for proven misbehaviour: no success lifts them
        self._num_failures: Dict[str, int] = {}
        # (peer id, kind of call) -> wall seconds per sample of its latest successful calls of that kind
        self._costs_s: Dict[Tuple[str, str], Deque[float]] = {}
        self._by_kind: Dict[str, Dict[str, float]] = {}  # peer id -> kind of call -> samples/s measured
        self._measured: Dict[str, float] = {}  # peer id -> samples/s: the measurement routing uses

    def choose(
        self,
        candidates: Sequence[PeerInfo],
        now: float,
        exclude: Collection[str] = (),
        prefer: Optional[str] = None,
        in_flight: Optional[Mapping[str, int]] = None,
    ) -> PeerInfo:
        """Only state=='online', not banned, not excluded; raises NoPeerAvailable.

        ``prefer`` (see :func:`preferred_replica`) is taken whenever it is eligible; otherwise, or
        without it, the replica is drawn by throughput. ``in_flight``: this trainer's calls under way
        per replica (see :meth:`distribution`)."""
        options = self.distribution(candidates, now, exclude, in_flight)
        if not options:
            raise self._explain_empty(candidates, now, exclude)
        chosen = preferred_replica([peer for peer, p in options if p > 0], prefer)  # p = 0: not worth waiting for
        if chosen is not None:
            return chosen
        if len(options) == 1:
            return options[0][0]
        eligible = [peer for peer, _ in options]
        cumulative = list(itertools.accumulate(p for _, p in options))
        index = bisect.bisect_right(cumulative, self._rng.random() * cumulative[-1])
        return eligible[min(index, len(eligible) - 1)]

    def distribution(
        self,
        candidates: Sequence[PeerInfo],
        now: float,
        exclude: Collection[str] = (),
        in_flight: Optional[Mapping[str, int]] = None,
    ) -> list[tuple[PeerInfo, float]]:
        """The probabilities :meth:`choose` draws with: ``(peer, p)`` for each eligible peer.

        With ``slow_tolerance`` finite, only replicas worth waiting for get a share: the calls
        ahead of a new one at a replica are this trainer's ``in_flight`` calls to it or the queue it
        announces, whichever is larger, and a replica this router has not timed takes at most
        ``max_probes`` calls at once. The simulator's fluid model routes expected flows with these
        instead of drawing every micro-batch; returns ``[]`` where :meth:`choose` would raise.
        """
        banned_until, distrusted_until = self._banned_until, self._distrusted_until  # is_banned, inlined: hot path
        eligible = [
            peer
            for peer in candidates
            if peer.state == "online"
            and peer.peer_id not in exclude
            and not now < banned_until.get(peer.peer_id, -math.inf)
            and not now < distrusted_until.get(peer.peer_id, -math.inf)
        ]
        if not eligible:
            return []
        slow_rule = math.isfinite(self.slow_tolerance) and len(eligible) > 1
        measured = [
            self._settled_throughput(peer.peer_id) if slow_rule else self.measured_throughput(peer.peer_id)
            for peer in eligible
        ]
        throughputs = effective_throughputs(
            [peer.throughput for peer in eligible],
            measured,
            announced_cap=self.announced_cap,
            measured_cap=self.measured_cap,
            announced_trust=self.announced_trust,
        )
        weights = routing_weights(throughputs)
        if slow_rule:
            weights = self._without_slow(eligible, measured, weights, in_flight or {})
        return list(zip(eligible, weights.tolist()))

    def _settled_throughput(self, peer_id: str) -> float:
        """The measurement of ``peer_id`` once every kind of call to it was timed ``SETTLE_CALLS`` times
        (or the whole window, if shorter); 0.0, untimed, before."""
        kinds = self._by_kind.get(peer_id, {})
        needed = min(SETTLE_CALLS, self.measure_window)
        if not kinds or any(len(self._costs_s[(peer_id, kind)]) < needed for kind in kinds):
            return 0.0
        return self.measured_throughput(peer_id)

    def _without_slow(
        self, eligible: Sequence[PeerInfo], measured: Sequence[float], weights: np.ndarray, in_flight: Mapping[str, int]
    ) -> np.ndarray:
        """``weights`` with the replicas not worth waiting for, and unmeasured ones probed enough, at 0
        (renormalised); the replica of the earliest expected completion always keeps its share."""
        calls = np.array([in_flight.get(peer.peer_id, 0) for peer in eligible], dtype=np.float64)
        queues = np.maximum(calls, [peer.queue_length for peer in eligible])
        keep = worth_waiting_for(weights, queues, self.slow_tolerance)
        keep &= np.array([probe_allowed(timed, int(count), self.max_probes) for timed, count in zip(measured, calls)])
        if not keep.any():
            keep[int(np.argmin((queues + 1.0) / weights))] = True
        kept = np.where(keep, weights, 0.0)
        return kept / kept.sum()

    def ban(self, peer_id: str, now: float, duration_s: Optional[float] = None) -> float:
        """Ban ``peer_id`` after a failure; returns the ban duration in seconds.

        The duration doubles with each failure since the last success (capped at
        ``ban_max_s``): a peer that fails once (a transient timeout) is retried soon, one
        that keeps failing stops wasting trainers' retries. With ``duration_s`` the peer is
        set aside for that long without counting a failure (a busy peer is not a faulty one).
        """
        if duration_s is None:
            failures = self._num_failures.get(peer_id, 0)
            duration_s = min(self.ban_base_s * (2.0 ** min(failures, 60)), self.ban_max_s)
            self._num_failures[peer_id] = failures + 1
        elif not (math.isfinite(duration_s) and duration_s >= 0):
            raise ValueError(f"duration_s must be a finite number >= 0, got {duration_s!r}")
        self._banned_until[peer_id] = max(self._banned_until.get(peer_id, -math.inf), now + duration_s)
        return duration_s

    def distrust(self, peer_id: str, now: float, duration_s: float) -> None:
        """Ban ``peer_id`` for ``duration_s`` for proven misbehaviour (a reply outvoted by other replicas).
        Unlike :meth:`ban`, a later success does not lift it: calls sent before the ban may still succeed."""
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise ValueError(f"duration_s must be a finite number >= 0, got {duration_s!r}")
        self._distrusted_until[peer_id] = max(self._distrusted_until.get(peer_id, -math.inf), now + duration_s)

    def report_success(self, peer_id: str, samples: int = 0, elapsed_s: float = 0.0, kind: str = "") -> None:
        """The peer served a request: forget its failures, so its next ban starts short, and, given
        the call's ``samples`` and wall time ``elapsed_s``, update this router's measurement of it.

        The measurement is a low quantile of the latest calls' wall time per sample: a call to the
        clock stage can wait for the stage's global step to close (seconds, alike for every replica,
        and most often for the replica that gets the most calls), which says nothing about the
        replica, whereas a replica that keeps requests queued is slow at that quantile too.

        Each ``kind`` of call (a method) is measured apart and the slowest kind is the replica's
        measurement: a micro-batch's backward follows its forward to the same replica, so a replica
        with quick forwards and slow backwards must not look quick."""
        if not (isinstance(samples, int) and samples >= 0):
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        if not (math.isfinite(elapsed_s) and elapsed_s >= 0):
            raise ValueError(f"elapsed_s must be a finite number >= 0, got {elapsed_s!r}")
        self._num_failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)
        if samples > 0 and elapsed_s > 0:
            costs = self._costs_s.setdefault((peer_id, kind), deque(maxlen=self.measure_window))
            costs.append(elapsed_s / samples)
            kinds = self._by_kind.setdefault(peer_id, {})
            kinds[kind] = 1.0 / float(np.quantile(costs, self.measure_quantile))
            self._measured[peer_id] = min(kinds.values())

    def measured_throughput(self, peer_id: str) -> float:
        """Samples per second of wall time of this router's successful calls to ``peer_id``; 0.0 = none yet."""
        return self._measured.get(peer_id, 0.0)

    def is_banned(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` is still serving a ban (or a :meth:`distrust`) at time ``now``."""
        until = max(self._banned_until.get(peer_id, -math.inf), self._distrusted_until.get(peer_id, -math.inf))
        return now < until

    def forget(self, peer_id: str) -> None:
        """Drop all state about a peer (e.g. its DHT record expired), bounding memory."""
        self._num_failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)
        self._distrusted_until.pop(peer_id, None)
        for kind in self._by_kind.pop(peer_id, {}):
            self._costs_s.pop((peer_id, kind), None)
        self._measured.pop(peer_id, None)

    @staticmethod
    def _explain_empty(candidates: Sequence[PeerInfo], now: float, exclude: Collection[str]) -> NoPeerAvailable:
        stages = sorted({peer.stage for peer in candidates})
        stage = stages[0] if len(stages) == 1 else None
        where = f"stage {stage}" if stage is not None else (f"stages {stages}" if stages else "the requested stage")
        if not candidates:
            return NoPeerAvailable(f"no peer available for {where}: no peers known", stage)
        online = [peer for peer in candidates if peer.state == "online"]
        if not online:
            states = ", ".join(
                f"{sum(p.state == s for p in candidates)} {s}"
                for s in ("joining", "leaving")
                if any(p.state == s for p in candidates)
            )
            return NoPeerAvailable(f"no peer available for {where}: none online ({states})", stage)
        num_excluded = sum(peer.peer_id in exclude for peer in online)
        return NoPeerAvailable(
            f"no peer available for {where}: all {len(online)} online peers are banned or excluded "
            f"({len(online) - num_excluded} banned after failures, {num_excluded} excluded)",
            stage,
        )
