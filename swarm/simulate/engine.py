"""Discrete-event simulation of a swarm under churn, with a fluid model of the micro-batch flow.

Events (joins, preemptions, crashes, downloads finishing, measurements, ban expiries,
rebalancing decisions) are processed in time order from a heap. Between two events nothing
changes, so instead of simulating every micro-batch the flow is computed in closed form
and integrated over the interval (a fluid approximation):

* Routing goes through the real :class:`~swarm.policy.routing.Router`: at each stage the
  trainers split micro-batches with ``Router.distribution`` (the exact probabilities
  ``Router.choose`` draws from), honouring states and bans. Trainers are exchangeable in
  this model, so one Router stands for all of them (their draws average out).
* Trainers offer micro-batches at the rate of the weakest stage (the sum of the
  capacities its routable replicas have); replica i of a stage is offered a share p_i of
  it and completes ``min(offered * p_i, cap_i)``: with p proportional to capacity nothing
  is lost, while a new peer weighted above its capacity or a crashed peer (capacity 0,
  until trainers time out and ban it) loses the excess. Its upstream work is not charged
  (a second-order effect).
* The swarm completes the minimum over stages, further capped by the trainers' in-flight
  budget (Little's law over the expected round trip, see :mod:`swarm.simulate.network`).
* Peers decide with the real :func:`~swarm.policy.rebalance.choose_stage_for_new_peer` and
  :func:`~swarm.policy.rebalance.plan_moves` on the snapshot they would read from the DHT
  (instantly up to date, except crashed peers, whose records linger until they expire).
  The plan is a pure function of the snapshot, so it is memoised per snapshot version, and
  a peer's DHT view is refreshed at most every ``snapshot_refresh_s``. In a run with the
  ``random`` join policy (the paper's no-rebalancing baseline) joining peers instead pick
  a stage uniformly, with no load awareness.

* Global steps (with ``config.steps.enabled`` and ``steps=True``): the live step policy runs
  on each simulated stage (:mod:`swarm.simulate.stepping`), fed the samples/s the flow sends each
  replica; the run's :class:`RunResult` then carries its :class:`StepReport`.

Cost (what makes 1,000 peers for 24 h take seconds): the flow is a function of the
routing state alone, so it is recomputed only when simulated time advances past an event
that changed it (many events share a timestamp, and most, such as rebalancing ticks that
move nobody, change nothing); only the stages whose routable records, bans or crashed
peers changed call ``Router.distribution`` again, the others keep their cached shares.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random

import numpy as np
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from swarm.policy.rebalance import choose_stage_for_new_peer, next_period_s, plan_moves
from swarm.policy.routing import Router
from swarm.policy.snapshot import PeerInfo
from swarm.simulate.churn import ChurnEvent
from swarm.config.simulation import JOIN_POLICY_NAMES, SimConfig
from swarm.simulate.network import Hardware, effective_units, hop_time_s, trainer_cap
from swarm.simulate.stepping import StepReport, StepSim

__all__ = ["JOIN_POLICIES", "RunResult", "simulate_run"]

# How a joining peer picks its stage: "auto" is the live ``--stage auto`` policy
# (choose_stage_for_new_peer, the least-provisioned stage); "random" is uniform over
# stages, with no load awareness, as in the SWARM paper's no-rebalancing baseline.
JOIN_POLICIES = JOIN_POLICY_NAMES


@dataclass
class RunResult:
    """What one run achieved; ``series`` rows are (hour, samples/s achieved, samples/s optimal)."""

    rebalancing: bool
    join_policy: str = "auto"
    samples: float = 0.0
    optimal_samples: float = 0.0
    num_moves: int = 0
    trainer_bound_s: float = 0.0
    series: List[Tuple[float, float, float]] = field(default_factory=list)
    steps: Optional[StepReport] = None  # the global-step protocol, when simulated

    @property
    def fraction_of_optimal(self) -> float:
        return self.samples / self.optimal_samples if self.optimal_samples > 0 else 0.0


@dataclass
class _Peer:
    hardware: Hardware
    throughput: float  # effective samples/s
    hop_s: float  # seconds a micro-batch spends at this peer (see network.hop_time_s)
    stage: int = 0
    state: str = "joining"
    alive: bool = True
    measured: bool = False
    in_dht: bool = True
    generation: int = 0  # bumps on every move, so stale "online" events are ignored


@dataclass(frozen=True)
class _StageFlow:
    """One stage as trainers see it: routing shares and live capacities of its routable replicas."""

    peer_ids: Tuple[str, ...]  # the routable replicas, in the order of the arrays
    shares: np.ndarray  # probability that a micro-batch goes to each replica (Router.distribution)
    caps: np.ndarray  # samples/s each replica can serve now (0 once crashed)
    hop_s: float  # expected seconds a micro-batch spends at this stage
    capacity: float  # samples/s: caps.sum()


class _Run:
    """One simulated run; the heap holds (time_s, seq, kind, peer_id, payload)."""

    def __init__(
        self,
        config: SimConfig,
        churn: Sequence[ChurnEvent],
        optimum: Sequence[Tuple[float, float]],
        rebalancing: bool,
        join_policy: str,
        steps: bool = False,
    ) -> None:
        if join_policy not in JOIN_POLICIES:
            raise ValueError(f"join_policy must be one of {JOIN_POLICIES}, got {join_policy!r}")
        self.config, self.rebalancing, self.join_policy = config, rebalancing, join_policy
        self.optimum = list(optimum)
        self.router = Router(
            seed=config.seed, ban_base_s=1.0, ban_max_s=60.0, slow_tolerance=config.slow_replica_tolerance
        )
        self.rng = random.Random(config.seed * 7919 + 17)
        self.join_rng = random.Random(config.seed * 7919 + 23)  # stage draws of the "random" join policy
        self.peers: Dict[str, _Peer] = {}
        self.info: Dict[str, PeerInfo] = {}
        # records the trainers may route to, per stage: the Router only ever picks online
        # peers, so joining and leaving records cannot change a stage's routing distribution
        self.online: List[Dict[str, PeerInfo]] = [{} for _ in range(config.num_stages)]
        self.version, self._plan_version, self._plan_time = 0, -1, -math.inf
        self._plan: Dict[str, int] = {}  # peer id -> the stage the last rebalancing plan moves it to
        self._snapshot_version = -1
        self._snapshot: List[PeerInfo] = []
        empty = _StageFlow((), np.zeros(0), np.zeros(0), 0.0, 0.0)
        self._offered, self._completed = 0.0, 0.0  # samples/s offered to every stage, completed by the swarm
        self.stage_flows: List[_StageFlow] = [empty] * config.num_stages
        self.dirty = set(range(config.num_stages))  # stages whose routing must be recomputed
        self.heap: list = []
        self.seq = itertools.count()
        for event in churn:
            self._push(event.time_s, event.kind, event.peer_id, event)
        self.result = RunResult(rebalancing, join_policy)
        self.steps = (
            StepSim(config.steps, config.num_stages, config.duration_s, self.stage_rates)
            if steps and config.steps.enabled
            else None
        )

    def _push(self, time_s: float, kind: str, peer_id: str, payload=None) -> None:
        heapq.heappush(self.heap, (time_s, next(self.seq), kind, peer_id, payload))

    # -- snapshot bookkeeping -------------------------------------------------------------
    def _announce(self, peer_id: str) -> None:
        peer = self.peers[peer_id]
        old = self.info.get(peer_id)
        if old is not None and self.online[old.stage].pop(peer_id, None) is not None:
            self.dirty.add(old.stage)
        if peer.in_dht:
            record = PeerInfo(peer_id, peer.stage, peer.state, peer.throughput if peer.measured else 0.0, 0)
            self.info[peer_id] = record
            if peer.state == "online":
                self.online[peer.stage][peer_id] = record
                self.dirty.add(peer.stage)
        else:
            self.info.pop(peer_id, None)
        self.version += 1

    def snapshot(self) -> List[PeerInfo]:
        if self._snapshot_version != self.version:
            self._snapshot, self._snapshot_version = list(self.info.values()), self.version
        return self._snapshot

    # -- flow -----------------------------------------------------------------------------
    def _stage_flow(self, stage: int, now: float) -> _StageFlow:
        """Routing shares, live capacities (0 for crashed peers) and expected hop time of a stage."""
        options = self.router.distribution(list(self.online[stage].values()), now)
        if not options:
            return _StageFlow((), np.zeros(0), np.zeros(0), 0.0, 0.0)
        records, probabilities = zip(*options)
        peers = self.peers
        shares = np.array(probabilities)
        chosen = [peers[record.peer_id] for record in records]
        caps = np.array([peer.throughput if peer.alive else 0.0 for peer in chosen])
        hops = np.array([peer.hop_s for peer in chosen])
        return _StageFlow(
            tuple(record.peer_id for record in records), shares, caps, float(shares @ hops), float(caps.sum())
        )

    def flow(self, now: float) -> Tuple[float, bool]:
        """Samples/s completed by the whole pipeline now, and whether trainers are the limit.

        Trainers inject at the rate of the weakest stage; a replica offered more than it can
        serve (a new peer weighted above its capacity, a crashed one) completes only its
        capacity and the excess is delayed or retried: counted as lost, conservatively.
        Only stages whose routing changed since the last call are recomputed.
        """
        for stage in self.dirty:
            self.stage_flows[stage] = self._stage_flow(stage, now)
        self.dirty.clear()
        flows = self.stage_flows
        offered = min(f.capacity for f in flows)
        self._offered, self._completed = offered, 0.0
        if offered <= 0:
            return 0.0, False
        shares = np.concatenate([f.shares for f in flows])
        caps = np.concatenate([f.caps for f in flows])
        starts = np.cumsum([0] + [f.shares.size for f in flows[:-1]])
        completed = float(np.add.reduceat(np.minimum(offered * shares, caps), starts).min())
        cap, _ = trainer_cap([f.hop_s for f in flows], self.config)
        self._completed = min(completed, cap)
        return self._completed, cap < completed

    def stage_rates(self, stage: int) -> Dict[str, float]:
        """Samples/s of completed micro-batches each routable replica of ``stage`` works on now: its share of
        what the stage completes, scaled to what the whole pipeline completes (the flow's last computation)."""
        f = self.stage_flows[stage]
        done = np.minimum(self._offered * f.shares, f.caps)
        total = float(done.sum())
        if total <= 0:
            return {}
        return dict(zip(f.peer_ids, (done * (self._completed / total)).tolist()))

    # -- events ---------------------------------------------------------------------------
    def _join_stage(self) -> int:
        if self.join_policy == "auto":
            return choose_stage_for_new_peer(self.snapshot(), self.config.num_stages)
        return self.join_rng.randrange(self.config.num_stages)

    def on_join(self, now: float, peer_id: str, event: ChurnEvent) -> None:
        hardware = event.joining_hardware()
        units = effective_units(hardware, self.config)
        throughput = units * self.config.throughput_quantum
        stage = self._join_stage()
        hop_s = hop_time_s(hardware, throughput, self.config)
        self.peers[peer_id] = _Peer(hardware, throughput, hop_s, stage)
        self._announce(peer_id)
        self._push(now + self.config.join_time_s, "online", peer_id, 0)
        if self.rebalancing:
            self._push(now + self.config.join_time_s + next_period_s(self.config.rebalance, self.rng), "tick", peer_id)

    def on_online(self, now: float, peer_id: str, generation: int) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or not peer.alive or peer.state != "joining" or peer.generation != generation:
            return
        peer.state = "online"
        self._announce(peer_id)
        if self.steps is not None:
            self.steps.join(peer_id, peer.stage, peer.hardware.bandwidth_mbps)
        if not peer.measured:
            self._push(now + self.config.measure_s, "measured", peer_id)

    def on_measured(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is not None and peer.alive and not peer.measured:
            peer.measured = True
            self._announce(peer_id)

    def on_preempt(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None:
            return
        peer.state = "leaving"  # announced at once: trainers stop routing to it
        self._announce(peer_id)
        if self.steps is not None:
            self.steps.leave(peer_id)
        self._push(now + self.config.notice_s, "gone", peer_id)

    def on_crash(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None:
            return
        peer.alive = False  # its record still says what it last announced
        self.dirty.add(peer.stage)
        if self.steps is not None:
            self.steps.crash(peer_id)
        self._push(now + self.config.request_timeout_s, "detect", peer_id)
        self._push(now + self.config.dht_expiration_s, "gone", peer_id)

    def on_detect(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or not peer.in_dht:
            return
        self._push(now + self.router.ban(peer_id, now), "unban", peer_id)
        self.dirty.add(peer.stage)

    def on_unban(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or not peer.in_dht:
            return
        self.dirty.add(peer.stage)  # routable again until trainers time out once more
        self._push(now + self.config.request_timeout_s, "detect", peer_id)

    def on_gone(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None:
            return
        peer.in_dht = False
        self._announce(peer_id)
        if self.steps is not None:
            self.steps.leave(peer_id)
        del self.peers[peer_id]
        self.router.forget(peer_id)

    def on_tick(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or not peer.alive or peer.state == "leaving":
            return
        self._push(now + next_period_s(self.config.rebalance, self.rng), "tick", peer_id)
        if peer.state != "online":
            return
        # a peer's view of the DHT is refreshed at most every snapshot_refresh_s (records are
        # re-announced on that period), so one plan serves every decision in that window
        if self._plan_version != self.version and now >= self._plan_time + self.config.snapshot_refresh_s:
            moves = plan_moves(self.snapshot(), self.config.num_stages, self.config.rebalance)
            self._plan, self._plan_version = {pid: target for pid, _src, target in moves}, self.version
            self._plan_time = now
        target = self._plan.get(peer_id)
        if target is None:
            return
        if self.steps is not None:
            self.steps.leave(peer_id)
        peer.stage, peer.state, peer.generation = target, "joining", peer.generation + 1
        self._announce(peer_id)
        self.result.num_moves += 1
        self._push(now + self.config.move_time_s, "online", peer_id, peer.generation)

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Process events in time order; the flow is recomputed only when time advances
        after an event that changed some stage's routing (it cannot change otherwise)."""
        config, result = self.config, self.result
        horizon_s = config.duration_s
        for k in range(int(horizon_s // config.sample_period_s) + 1):
            self._push(k * config.sample_period_s, "sample", "")
        optimum_index, now = 0, 0.0
        flow, trainer_bound = 0.0, False
        handlers: Dict[str, Callable[..., None]] = {
            "join": self.on_join,
            "online": self.on_online,
            "measured": self.on_measured,
            "preempt": self.on_preempt,
            "crash": self.on_crash,
            "detect": self.on_detect,
            "unban": self.on_unban,
            "gone": self.on_gone,
            "tick": self.on_tick,
        }
        heap = self.heap
        while heap and heap[0][0] <= horizon_s:
            time_s, _, kind, peer_id, payload = heapq.heappop(heap)
            if time_s > now or kind == "sample":
                if self.dirty:
                    flow, trainer_bound = self.flow(now)
                    if self.steps is not None:
                        self.steps.rates_changed()
                if self.steps is not None:
                    self.steps.advance(time_s)
                result.samples += flow * (time_s - now)
                result.trainer_bound_s += (time_s - now) if trainer_bound else 0.0
                now = time_s
            if kind == "sample":
                while optimum_index + 1 < len(self.optimum) and self.optimum[optimum_index + 1][0] <= now:
                    optimum_index += 1
                result.series.append((now / 3600.0, flow, self.optimum[optimum_index][1] if self.optimum else 0.0))
            elif kind in ("join", "online"):
                handlers[kind](now, peer_id, payload)
            else:
                handlers[kind](now, peer_id)
        if self.dirty:
            flow, trainer_bound = self.flow(now)
        if self.steps is not None:
            self.steps.advance(horizon_s)
            result.steps = self.steps.finish()
        result.samples += flow * (horizon_s - now)
        result.trainer_bound_s += (horizon_s - now) if trainer_bound else 0.0
        result.optimal_samples = _integrate(self.optimum, horizon_s)
        return result


def _integrate(steps: Sequence[Tuple[float, float]], horizon_s: float) -> float:
    """Integral over [0, horizon] of a step function given as (start time, value) rows."""
    total = 0.0
    for (start, value), (end, _) in zip(steps, list(steps[1:]) + [(horizon_s, 0.0)]):
        total += value * (min(end, horizon_s) - start)
    return total


def simulate_run(
    config: SimConfig,
    churn: Sequence[ChurnEvent],
    optimum: Sequence[Tuple[float, float]],
    rebalancing: bool,
    join_policy: str = "auto",
    steps: bool = False,
) -> RunResult:
    """Simulate one run over ``churn``; ``optimum`` is the (time_s, samples/s) step function to compare with.

    ``rebalancing`` turns the periodic :func:`plan_moves` decisions on; ``join_policy``
    (one of :data:`JOIN_POLICIES`) is how joining peers choose their stage; ``steps`` simulates the
    global-step protocol too (if ``config.steps.enabled``).
    """
    return _Run(config, churn, optimum, rebalancing, join_policy, steps).run()
