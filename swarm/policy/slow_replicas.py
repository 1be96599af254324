"""Slow replicas: when waiting for a replica costs the swarm more than the replica adds.

Throughput-proportional routing (:mod:`swarm.policy.routing`) is right when replicas are saturated:
every replica then adds its capacity. But a trainer keeps a bounded number of micro-batches in
flight, so a micro-batch sent to a replica 50x slower than its stage-mates holds one of those slots
50x longer: with a 1/101 share (its throughput's) a trainer's mean round trip grows by half and its
samples/s drop by a third, while the stage gained 1% of capacity it did not need. What a micro-batch
costs is its *expected completion time* at a replica: the calls ahead of it there, plus itself, over
the replica's throughput. Replicas of about the same speed share calls while that time is within
``tolerance`` of the best replica's; a replica more than ``tolerance`` times slower than the fastest
gets a call only when it would complete it first, that is exactly when its faster stage-mates are
backed up enough for its capacity to help.

A replica that no trainer would route to by that rule stands by (:func:`standby_verdict`): it
stays online (averaging, serving its state) but its own log says, in one line, why it gets no work.

Everything here is a pure function of plain numbers or a snapshot (no clocks, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple, Union

import numpy as np

from swarm.policy.snapshot import PeerInfo

__all__ = [
    "SLOW_TOLERANCE",
    "MAX_PROBES",
    "RESUME_MARGIN",
    "completion_times",
    "worth_waiting_for",
    "probe_allowed",
    "StandbyVerdict",
    "standby_verdict",
]

FloatArray = Union[Sequence[float], np.ndarray]  # figures per replica, as a list or as an array

SLOW_TOLERANCE = 2.0  # a replica is routed to while its expected completion is within this multiple of the best one's
MAX_PROBES = 1  # calls a trainer keeps in flight to a replica it has not timed yet
RESUME_MARGIN = 0.8  # a standing-by replica resumes only once within this fraction of the tolerance (no flapping)


def completion_times(throughputs: FloatArray, queues: FloatArray) -> np.ndarray:
    """Expected seconds per sample until a new call to each replica completes: (calls ahead + 1) / throughput.

    An unknown throughput (0) counts as the mean of the known ones (a new replica is tried, as in
    :func:`swarm.policy.routing.routing_weights`); all unknown: every replica counts as throughput 1."""
    rates, ahead = _rates_and_queues(throughputs, queues)
    return (ahead + 1.0) / rates


def _rates_and_queues(throughputs: FloatArray, queues: FloatArray) -> Tuple[np.ndarray, np.ndarray]:
    rates = _non_negative(throughputs, "throughputs")
    ahead = _non_negative(queues, "queues")
    if rates.shape != ahead.shape:
        raise ValueError(f"throughputs and queues must have the same length, got {rates.size} and {ahead.size}")
    known = rates > 0
    return np.where(known, rates, rates[known].mean() if known.any() else 1.0), ahead


def worth_waiting_for(throughputs: FloatArray, queues: FloatArray, tolerance: float = SLOW_TOLERANCE) -> np.ndarray:
    """Which replicas a call may go to: those whose :func:`completion_times` are within ``tolerance`` times
    the best one's, and for a replica itself more than ``tolerance`` times slower than the fastest,
    only while it would complete the call first.

    The slack lets calls spread over replicas of about the same speed (announced queues are seconds
    old, and every trainer reads the same ones); a replica that slow would spend it holding a
    trainer's slot longer than any stage-mate, and earns a call only where its capacity shortens one.
    Never empty for a non-empty stage (the best replica always qualifies); ``tolerance`` inf keeps
    every replica (plain throughput-proportional routing)."""
    if not tolerance >= 1.0:  # also rejects NaN
        raise ValueError(f"tolerance must be >= 1, got {tolerance!r}")
    rates, ahead = _rates_and_queues(throughputs, queues)
    if rates.size == 0:
        return np.zeros(0, dtype=bool)
    times = (ahead + 1.0) / rates
    slow = rates * tolerance < rates.max()
    return times <= np.where(slow, 1.0, tolerance) * times.min()


def probe_allowed(measured: float, in_flight: int, max_probes: int = MAX_PROBES) -> bool:
    """Whether a trainer may send one more call to a replica: always once it has timed the replica
    (``measured`` > 0), otherwise while fewer than ``max_probes`` calls to it are in flight, so that a
    replica of unknown speed holds at most that many of the trainer's slots until it is measured."""
    return measured > 0 or in_flight < max_probes


@dataclass(frozen=True)
class StandbyVerdict:
    """Whether a replica should stand by, and the one line its log says why."""

    standby: bool
    reason: str
    slowdown: float = 1.0  # its expected completion over the best stage-mate's (1.0 when unknown)


def standby_verdict(
    peer_id: str, snapshot: Sequence[PeerInfo], tolerance: float = SLOW_TOLERANCE, standing_by: bool = False
) -> StandbyVerdict:
    """Whether replica ``peer_id`` costs its stage more than it adds, from a snapshot of the run.

    It does when, even with nothing queued at it, a call would complete more than ``tolerance`` times
    later than at its best online stage-mate with that mate's announced queue: trainers routing by
    :func:`worth_waiting_for` then send it nothing, and it serves only the averaging and the state.
    A replica standing by (``standing_by``) resumes only within ``RESUME_MARGIN`` of the tolerance, so
    that queues wavering around the threshold do not flip it. Never for the stage's only replica, nor
    before its throughput and a stage-mate's are measured."""
    me = next((p for p in snapshot if p.peer_id == peer_id), None)
    if me is None:
        return StandbyVerdict(False, f"{peer_id} is not in the snapshot")
    mates = [
        p for p in snapshot if p.stage == me.stage and p.state == "online" and p.peer_id != peer_id and p.throughput > 0
    ]
    if not mates or me.throughput <= 0:
        return StandbyVerdict(False, f"stage {me.stage}: no measured stage-mate to compare with")
    mine = 1.0 / me.throughput
    best = min((p.queue_length + 1.0) / p.throughput for p in mates)
    slowdown = mine / best
    limit = tolerance * (RESUME_MARGIN if standing_by else 1.0)
    fastest = max(p.throughput for p in mates)
    if slowdown > limit:
        return StandbyVerdict(
            True,
            (
                f"standing by on stage {me.stage}: a call here completes {slowdown:.1f}x later than at the best "
                f"stage-mate ({me.throughput:.1f} samples/s here vs up to {fastest:.1f}); trainers wait at most "
                f"{tolerance:.1f}x, so work sent here would cost the swarm more than it adds; staying online for "
                f"averaging and state"
            ),
            slowdown,
        )
    return StandbyVerdict(
        False,
        (
            f"serving on stage {me.stage}: a call here completes {slowdown:.1f}x as late as at the best stage-mate "
            f"(within {limit:.1f}x)"
        ),
        slowdown,
    )


def _non_negative(values: FloatArray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {list(values)}")
    return array
