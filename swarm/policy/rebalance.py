"""Which stage a peer should serve: on joining (``--stage auto``) and periodically after.

The swarm's throughput is the minimum over stages of the stage capacity, the sum of the
throughputs of the peers serving it, so capacity belongs where that minimum is. Every peer
computes the same plan from the same DHT snapshot (:func:`plan_moves`, deterministic, ties
broken by peer id) and moves only if the plan names it; hence no coordinator is needed and
at most ``max_movers_per_period`` peers move per period even though all of them decide.

How the snapshot is read (the choices that matter):

* ``leaving`` peers count for nothing: they are about to disappear.
* ``joining`` peers count at their future stage: they are downloading state and will serve
  soon; ignoring them would make every peer that decides meanwhile rush to the same stage.
* Unmeasured peers (throughput 0.0) are estimated as the mean of the measured peers (or
  1.0 each when nobody is measured, i.e. peers are counted), so a new peer is neither
  ignored nor trusted more than a typical one. A peer's throughput is assumed to be the
  same on any stage: stages are cut to cost the same.
* Throughput must mean *capacity* (samples per busy second): a peer outside the bottleneck
  is idle part of the time and would look slow if measured per wall-clock second.
* Queue lengths are only a tie-breaker: among stages of equal capacity, the one with more
  queued requests is the bottleneck (it is where work is actually waiting). They are too
  noisy an instantaneous signal to drive moves on their own.

A move must clear ``min_gain``: the relative improvement of the first stage capacity that
changes in the sorted ("leximin") capacity vector. With a unique bottleneck that is exactly
the swarm-throughput gain; with several tied bottlenecks it lets the swarm lift them one at
a time. Every accepted move strictly improves the leximin order, so repeatedly applying the
plan reaches a fixed point: no flapping.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from swarm.policy.snapshot import PeerInfo

__all__ = [
    "RebalanceConfig",
    "stage_capacities",
    "choose_stage_for_new_peer",
    "plan_moves",
    "decide_move",
    "next_period_s",
    "swarm_throughput",
    "apply_moves",
    "settle_join_choice",
]

Move = Tuple[str, int, int]


@dataclass(frozen=True)
class RebalanceConfig:
    """How often and how eagerly peers move to the bottleneck stage."""

    period_s: float = 60.0  # mean seconds between decisions
    period_jitter: float = 0.2  # fraction of period_s, randomised so peers do not move together
    min_gain: float = 0.05  # relative swarm-throughput gain a move must clear (no flapping)
    max_movers_per_period: int = 1  # bound on peers moving in one period

    def __post_init__(self) -> None:
        if not (isinstance(self.period_s, (int, float)) and math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"period_s must be a finite number > 0, got {self.period_s!r}")
        if not (isinstance(self.period_jitter, (int, float)) and 0 <= self.period_jitter < 1):
            raise ValueError(f"period_jitter must be in [0, 1), got {self.period_jitter!r}")
        if not (isinstance(self.min_gain, (int, float)) and math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ValueError(f"min_gain must be a finite number >= 0, got {self.min_gain!r}")
        if (
            isinstance(self.max_movers_per_period, bool)
            or not isinstance(self.max_movers_per_period, int)
            or self.max_movers_per_period < 0
        ):
            raise ValueError(f"max_movers_per_period must be an int >= 0, got {self.max_movers_per_period!r}")


def _check_num_stages(num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")


def _fill_value(peers: Sequence[PeerInfo], default_s: float = 0.0) -> float:
    """The estimate for unmeasured peers: the mean of measured non-leaving peers."""
    total, count = 0.0, 0
    for peer in peers:
        throughput = peer.throughput
        if throughput > 0 and peer.state != "leaving":
            total += throughput
            count += 1
    if count:
        return total / count
    return default_s if default_s > 0 else 1.0


def stage_capacities(peers: Sequence[PeerInfo], num_stages: int) -> list[float]:
    """Expected samples/s each stage can serve: the sum over its online and joining peers."""
    _check_num_stages(num_stages)
    return _capacities_and_queues(peers, num_stages, _fill_value(peers))[0]


def _capacities_and_queues(peers: Sequence[PeerInfo], num_stages: int, fill: float) -> Tuple[List[float], List[int]]:
    """Per stage: expected capacity (unmeasured peers count as ``fill``) and queued requests.

    One pass over the snapshot (policies run on every join of a large swarm); each sum
    accumulates in snapshot order.
    """
    capacities, queues = [0.0] * num_stages, [0] * num_stages
    for peer in peers:
        stage = peer.stage
        if stage < num_stages and peer.state != "leaving":
            throughput = peer.throughput
            capacities[stage] += throughput if throughput > 0 else fill
            queues[stage] += peer.queue_length
    return capacities, queues


def swarm_throughput(peers: Sequence[PeerInfo], num_stages: int) -> float:
    """The pipeline is as fast as its slowest stage."""
    return min(stage_capacities(peers, num_stages))


def _bottleneck(capacities: Sequence[float], queues: Sequence[int]) -> int:
    return min(range(len(capacities)), key=lambda s: (capacities[s], -queues[s], s))


def choose_stage_for_new_peer(
    peers: Sequence[PeerInfo], num_stages: int, my_throughput: float = 0.0, fitting: Optional[Sequence[int]] = None
) -> int:
    """The stage that needs capacity most: the lowest expected capacity.

    Ties go to the stage with more queued requests, then the lowest index. ``my_throughput``
    (if known) is the estimate for unmeasured peers when nobody is measured yet: peers that
    join a run are likely to resemble the joining one. ``fitting`` (None = every stage) are the stages
    whose memory the joining peer has (:func:`swarm.model.footprint.stages_that_fit`); the choice is
    among them only, and ValueError when there is none.
    """
    _check_num_stages(num_stages)
    candidates = range(num_stages) if fitting is None else sorted(set(fitting))
    if fitting is not None and not all(isinstance(s, int) and 0 <= s < num_stages for s in candidates):
        raise ValueError(f"fitting stages must be in 0..{num_stages - 1}, got {list(fitting)}")
    if not candidates:
        raise ValueError("no stage of this run fits this peer's memory")
    capacities, queues = _capacities_and_queues(peers, num_stages, _fill_value(peers, default_s=my_throughput))
    return min(candidates, key=lambda s: (capacities[s], -queues[s], s))


def settle_join_choice(
    peers: Sequence[PeerInfo], my_peer_id: str, my_stage: int, num_stages: int, fitting: Optional[Sequence[int]] = None
) -> int:
    """Re-check a ``--stage auto`` choice once it has been announced as 'joining'.

    Peers that start together choose from the same snapshot and pick the same stage. Once the
    choices are visible, the joiner with the smallest peer id on a stage keeps it; every other
    joiner there chooses again with all of them counted, so two joiners never chase each other (among the
    ``fitting`` stages, as :func:`choose_stage_for_new_peer`).
    """
    rivals = [p for p in peers if p.state == "joining" and p.stage == my_stage and p.peer_id != my_peer_id]
    if not rivals or min(p.peer_id for p in rivals) > my_peer_id:
        return my_stage
    return choose_stage_for_new_peer([p for p in peers if p.peer_id != my_peer_id], num_stages, fitting=fitting)


def _improves(new_sorted: Sequence[float], old_sorted: Sequence[float], min_gain: float) -> bool:
    """Leximin comparison with a relative threshold on the first differing component."""
    for new, old in zip(new_sorted, old_sorted):
        if new == old:
            continue
        if new < old:
            return False
        return old <= 0.0 or new >= old * (1.0 + min_gain) and new - old > 1e-12 * max(1.0, old)
    return False


SIMILAR_THROUGHPUT = 1.25  # throughputs within this factor count as equal when picking who moves


def _stable_pick(candidates: List[Tuple[float, str]], throughput: float) -> Tuple[float, str]:
    """Among the candidates whose throughput is within SIMILAR_THROUGHPUT of ``throughput``, the one
    with the smallest peer id. Measured throughputs are noisy EMAs: picking the exact best would
    name a different peer in every snapshot, and since each peer acts only on its own jittered tick
    a move could wait many periods for the named peer's tick to coincide with it being named."""
    lo = bisect.bisect_left(candidates, (throughput / SIMILAR_THROUGHPUT, ""))
    hi = bisect.bisect_right(candidates, (throughput * SIMILAR_THROUGHPUT, "\uffff"))
    return min(candidates[lo:hi], key=lambda c: c[1])


def _best_move(
    capacities: List[float],
    movable: Dict[int, List[Tuple[float, str]]],
    num_online: List[int],
    bottleneck: int,
    min_gain: float,
) -> Optional[Tuple[str, int, float]]:
    """The single move into ``bottleneck`` that best improves the leximin capacity vector.

    For a given source stage only the pair (source, bottleneck) changes and its sum is
    fixed, so the leximin-best peer is the one whose throughput is closest to half the
    capacity difference: two candidates per stage (found by bisection) suffice.
    """
    old_sorted = sorted(capacities)
    best_key, best = None, None
    for source, candidates in movable.items():
        if source == bottleneck or num_online[source] < 2 or not candidates:
            continue  # never empty a stage: at least one online peer must stay
        half = (capacities[source] - capacities[bottleneck]) / 2.0
        i = bisect.bisect_left(candidates, (half, ""))
        for j in {max(0, i - 1), min(i, len(candidates) - 1)}:
            throughput, peer_id = _stable_pick(candidates, candidates[j][0])
            new = list(capacities)
            new[source] -= throughput
            new[bottleneck] += throughput
            new_sorted = sorted(new)
            if not _improves(new_sorted, old_sorted, min_gain):
                continue
            key = (tuple(new_sorted), new[source])  # then keep the source stage richer
            if best is None or best_key is None or key > best_key or (key == best_key and peer_id < best[0]):
                best_key, best = key, (peer_id, source, throughput)
    return best


def plan_moves(peers: Sequence[PeerInfo], num_stages: int, config: RebalanceConfig) -> list[tuple[str, int, int]]:
    """Moves ``(peer_id, from_stage, to_stage)`` that every peer computes alike from a snapshot.

    Greedy: up to ``max_movers_per_period`` times, take the bottleneck stage and move into
    it the online peer whose departure hurts its stage least, i.e. the move that yields
    the best sorted capacity vector, if it clears ``min_gain``. Never empties a stage.
    """
    _check_num_stages(num_stages)
    fill = _fill_value(peers)
    capacities, queues = [0.0] * num_stages, [0] * num_stages
    num_online = [0] * num_stages
    movable: Dict[int, List[Tuple[float, str]]] = {}
    for peer in peers:  # one pass, as in _capacities_and_queues, plus the online peers
        stage, state = peer.stage, peer.state
        if stage < num_stages and state != "leaving":
            throughput = peer.throughput
            estimate = throughput if throughput > 0 else fill
            capacities[stage] += estimate
            queues[stage] += peer.queue_length
            if state == "online":
                num_online[stage] += 1
                movable.setdefault(stage, []).append((estimate, peer.peer_id))
    for candidates in movable.values():
        candidates.sort()
    moves: List[Move] = []
    for _ in range(config.max_movers_per_period):
        bottleneck = _bottleneck(capacities, queues)
        best = _best_move(capacities, movable, num_online, bottleneck, config.min_gain)
        if best is None:
            break
        peer_id, source, throughput = best
        moves.append((peer_id, source, bottleneck))
        capacities[source] -= throughput
        capacities[bottleneck] += throughput  # counted at once, like a joining peer
        num_online[source] -= 1
        movable[source].remove((throughput, peer_id))
    return moves


def decide_move(peers: Sequence[PeerInfo], my_peer_id: str, num_stages: int, config: RebalanceConfig) -> Optional[int]:
    """The stage this peer should move to now, or None: whether the shared plan names it."""
    for peer_id, _source, target in plan_moves(peers, num_stages, config):
        if peer_id == my_peer_id:
            return target
    return None


def next_period_s(config: RebalanceConfig, rng: random.Random) -> float:
    """Seconds until the next decision: uniform in period_s * (1 ± period_jitter).

    The jitter de-synchronises peers, so the one named by the plan usually moves (and
    re-announces itself) before the others decide again on a stale snapshot.
    """
    return config.period_s * (1.0 + config.period_jitter * (2.0 * rng.random() - 1.0))


def apply_moves(peers: Sequence[PeerInfo], moves: Sequence[Move]) -> list[PeerInfo]:
    """The snapshot after ``moves``, movers shown as joining their new stage (for simulation and tests)."""
    targets = {peer_id: target for peer_id, _source, target in moves}
    return [
        PeerInfo(p.peer_id, targets[p.peer_id], "joining", p.throughput, 0) if p.peer_id in targets else p
        for p in peers
    ]
