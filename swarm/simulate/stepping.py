"""Global steps in the simulated swarm: the live step policy run on snapshots of each simulated stage.

Every stage keeps its replicas' gradient accumulators, steps and parameter digests; at each check
a stage's replicas announce what they hold (claims are as fresh as the stage's last check) and the
decisions are those of :mod:`swarm.policy.steps`, the functions the live peer calls:
``step_is_due`` closes a step, ``must_wait`` stops a replica from accumulating, ``needs_resync``
sends a diverged or lagging replica to download the stage's state, ``step_alone`` lets a replica
apply a step that no group averaged, and ``overclaimers`` stops believing replicas whose claims the
all-reduce did not bear out.

Model (documented simplifications):

* A replica accumulates the samples of the backward passes the flow model sends it
  (:meth:`swarm.simulate.engine._Run.stage_rates`), sampled at each check of its stage and held
  constant until the next one. It accumulates nothing while it must wait, averages or downloads
  state: those replica-seconds are the time lost waiting, by cause.
* The clock stage (the last one) is checked on the live grid: every ``announce_period_s``, and
  every ``poll_period_s`` once the policy says it is near the target. Checks that cannot change
  anything are skipped: at each check the next one is set at the first grid instant where, at the
  current rates, the policy's figures (held, pending) could cross the near threshold or the target,
  and whenever the engine's flow changes the clock's replicas announce, their rates are re-read and
  that instant re-predicted.
  Other stages are checked one poll period after the clock applies a step (the trainers' next backward
  calls tell them, and one progress call to the clock's replicas confirms it), when a replica joins, and
  every ``idle_check_period_s``; their rates are re-read at their checks only. Every replica reads the same
  snapshot (claims are refreshed at every check), so the view of the replica with the lowest id
  among those able to act decides when the stage closes and whether new gradients must wait;
  ``needs_resync`` is evaluated on its own view by every replica that does not hold the state the
  majority announces (for those that hold it the policy's answer is no).
* An all-reduce among the replicas that froze the step takes ``matchmaking_time_s`` plus twice the
  stage's gradients over the slowest member's bandwidth (a butterfly all-reduce); a group that holds
  every replica the closing view knows of (:func:`full_group_size`) starts at once and pays the transfer
  only, as the live averager does; a round with nobody to average with fails after
  ``3 * matchmaking_time_s`` (the live matchmaking timeout).
* Stages are not coupled beyond the clock: a stage that waits does not slow the flow of the
  others (the engine's throughput figures are untouched by the step protocol).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

from swarm.policy.steps import (
    ReplicaClaim,
    StageView,
    absent_claimants,
    distrust_seconds,
    full_group_size,
    majority_state,
    must_wait,
    near_target,
    near_threshold,
    needs_resync,
    others_pending,
    others_reserved,
    overclaimers,
    rounds_before_stepping_alone,
    step_alone,
    step_is_due,
    trusted_others,
)
from swarm.config.simulation import StepSimConfig

__all__ = ["StepSim", "StepReport", "allreduce_time_s"]

_MIB_BITS = 8.0 * 1024.0 * 1024.0
HISTORY_STEPS = 64  # (step, digest) pairs a replica remembers, as the live peer does
WAIT_CAUSES = ("full", "averaging", "failed_rounds", "resync")

RatesFn = Callable[[int], Dict[str, float]]  # stage -> samples/s of backward work reaching each replica


def allreduce_time_s(param_mib: float, bandwidths_mbps: List[float], matchmaking_time_s: float) -> float:
    """Seconds one all-reduce round takes: matchmaking, then each member sends and receives about twice
    the gradients (butterfly), paced by the slowest member's link."""
    slowest = min(bandwidths_mbps)
    return matchmaking_time_s + 2.0 * param_mib * _MIB_BITS / (slowest * 1e6)


@dataclass
class _Replica:
    peer_id: str
    bandwidth_mbps: float
    step: int
    digest: str
    accum_step: int
    stalled: bool = False  # announces itself online but never averages
    pending: float = 0.0
    frozen: float = 0.0  # samples of the step its overlapped round averages while ``pending`` grows for the next
    rate: float = 0.0
    settled_at: float = 0.0
    waiting: bool = False  # must_wait said so at the last check
    busy_until: float = 0.0  # averaging or downloading state until then
    busy_cause: str = ""
    alive: bool = True  # False once crashed: its record lingers with its last claim
    failed_rounds: int = 0
    claim: Optional[ReplicaClaim] = None
    history: Deque[Tuple[int, str]] = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))

    def active(self, now: float) -> bool:
        return self.alive and self.busy_until <= now


@dataclass
class _Round:
    members: List[str]
    claims: Dict[str, int]  # pending samples the other replicas announced when the step closed
    others: List[str]  # the other replicas in the closing view
    overlapped: bool = False  # its members accumulate the next step meanwhile (their ``frozen`` samples are averaged)


@dataclass
class _Stage:
    index: int
    is_clock: bool
    replicas: Dict[str, _Replica] = field(default_factory=dict)
    round: Optional[_Round] = None
    distrusted: Dict[str, float] = field(default_factory=dict)  # peer id -> until when its claims are ignored
    strikes: Dict[str, int] = field(default_factory=dict)  # peer id -> rounds in a row it did not join
    last_state: Tuple[int, str] = (0, "init")  # kept for a stage that every replica left (its checkpoint)
    check_at: float = math.inf  # the pending check's time


@dataclass
class StepReport:
    """What the step protocol achieved in one run."""

    target_batch_size: int
    duration_s: float
    step_times_s: List[float] = field(default_factory=list)  # when the clock stage applied each global step
    step_samples: List[int] = field(default_factory=list)  # samples in each global step (the clock's all-reduce)
    wait_replica_s: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAIT_CAUSES, 0.0))
    replica_s: float = 0.0  # replica-seconds online in all stages
    steps_alone: int = 0  # steps a replica applied without a group
    resyncs: int = 0  # state downloads by replicas found out of sync
    distrusted: int = 0  # times the claims of a replica still online started being ignored
    distrusted_departed: int = 0  # the same for replicas already gone (crashed or left), whose claims outlived them
    restored: int = 0  # replicas that joined a stage every replica had left (restart from its last state)

    def summary(self) -> dict:
        """JSON-ready figures: steps per hour, samples per step around the target, time lost waiting."""
        samples = sorted(self.step_samples)
        hours = self.duration_s / 3600.0
        waited = sum(self.wait_replica_s.values())

        def quantile(q: float) -> float:
            return float(samples[min(len(samples) - 1, int(q * len(samples)))]) if samples else 0.0

        mean = sum(samples) / len(samples) if samples else 0.0
        std = math.sqrt(sum((s - mean) ** 2 for s in samples) / len(samples)) if samples else 0.0
        return {
            "global_steps": len(samples),
            "global_steps_per_hour": round(len(samples) / hours, 2) if hours > 0 else 0.0,
            "target_batch_size": self.target_batch_size,
            "samples_per_step_mean": round(mean, 1),
            "samples_per_step_std": round(std, 1),
            "samples_per_step_p5": quantile(0.05),
            "samples_per_step_p50": quantile(0.5),
            "samples_per_step_p95": quantile(0.95),
            "samples_per_step_mean_over_target": round(mean / self.target_batch_size, 4),
            "wait_replica_s": round(waited, 1),
            "wait_replica_s_by_cause": {k: round(v, 1) for k, v in self.wait_replica_s.items()},
            "wait_fraction_of_replica_time": round(waited / self.replica_s, 4) if self.replica_s > 0 else 0.0,
            "wait_replica_s_per_step": round(waited / len(samples), 1) if samples else 0.0,
            "steps_alone": self.steps_alone,
            "resyncs": self.resyncs,
            "distrusted": self.distrusted,
            "distrusted_departed": self.distrusted_departed,
            "stages_restored": self.restored,
        }


class StepSim:
    """The step protocol of every stage of one simulated run; the engine advances it between its events."""

    def __init__(self, config: StepSimConfig, num_stages: int, duration_s: float, rates: RatesFn) -> None:
        self.config, self.rates = config, rates
        self.stages = [_Stage(i, i == num_stages - 1) for i in range(num_stages)]
        self.where: Dict[str, int] = {}
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.report = StepReport(config.target_batch_size, duration_s)
        self._schedule(self.stages[-1], 0.0)

    def rates_changed(self) -> None:
        """The engine's flow changed: re-read the clock's rates and re-predict its next useful check."""
        stage = self.stages[-1]
        if stage.round is not None or math.isinf(stage.check_at):
            return
        self._settle(stage)
        self._read_rates(stage)
        self._announce(stage)
        deciders = self._deciders(stage)
        if deciders:
            view = self._view(stage, stage.replicas[deciders[0]], self._announced(stage), ())
            self._reschedule(stage, self._next_clock_check(stage, view))

    # ---- events ----

    def _push(self, time_s: float, kind: str, stage: int, payload=None) -> None:
        heapq.heappush(self.heap, (time_s, next(self.seq), kind, stage, payload))

    def _reschedule(self, stage: _Stage, time_s: float) -> None:
        stage.check_at = math.inf
        self._schedule(stage, time_s)

    def _schedule(self, stage: _Stage, time_s: float) -> None:
        """At most one pending check per stage: the earliest asked for."""
        if time_s < stage.check_at:
            stage.check_at = time_s
            self._push(time_s, "check", stage.index)

    def advance(self, until: float) -> None:
        """Process the protocol's events before ``until`` (the rates stay those of the engine's current flow)."""
        while self.heap and self.heap[0][0] < until:
            time_s, _, kind, index, payload = heapq.heappop(self.heap)
            self.now = max(self.now, time_s)
            stage = self.stages[index]
            if kind == "check":
                if time_s != stage.check_at:
                    continue  # superseded by an earlier one
                stage.check_at = math.inf
                self._check(stage)
            elif kind == "averaged":
                self._averaged(stage)
            elif kind == "round_failed":
                self._round_failed(stage)
            elif kind == "resynced":
                self._resynced(stage, payload)
        self.now = max(self.now, until)

    def finish(self) -> StepReport:
        """Settle every stage up to the end of the run and return the report."""
        for stage in self.stages:
            self._settle(stage)
        return self.report

    # ---- membership (called by the engine at ``self.now``) ----

    def join(self, peer_id: str, stage_index: int, bandwidth_mbps: float) -> None:
        """A replica comes online in a stage with the state it downloaded: the stage's majority state."""
        stage = self.stages[stage_index]
        self._settle(stage)
        step, digest = self._stage_state(stage)
        replica = _Replica(
            peer_id,
            bandwidth_mbps,
            step,
            digest,
            step,
            stalled=peer_id in self.config.stalled_peers,
            settled_at=self.now,
        )
        replica.claim = self._claim_of(replica)
        stage.replicas[peer_id] = replica
        self.where[peer_id] = stage_index
        self._schedule(stage, self.now + self.config.poll_period_s)

    def leave(self, peer_id: str) -> None:
        """A replica leaves its stage (preempted with notice, moving, or its crashed record expired)."""
        index = self.where.pop(peer_id, None)
        if index is None:
            return
        stage = self.stages[index]
        self._settle(stage)
        del stage.replicas[peer_id]

    def crash(self, peer_id: str) -> None:
        """A replica dies without notice: it stops, its record keeps its last claim until it expires."""
        index = self.where.get(peer_id)
        if index is not None:
            self._settle(self.stages[index])
            self.stages[index].replicas[peer_id].alive = False

    # ---- bookkeeping ----

    def _stage_state(self, stage: _Stage) -> Tuple[int, str]:
        """The state a joiner downloads: the most common among live replicas (highest step on a tie)."""
        states = Counter((r.step, r.digest) for r in stage.replicas.values() if r.alive and not r.stalled)
        if not states:
            if not stage.replicas and stage.last_state[0] > 0:
                self.report.restored += 1
            return stage.last_state
        return max(states.items(), key=lambda item: (item[1], item[0][0], item[0][1]))[0]

    def _settle(self, stage: _Stage) -> None:
        """Accumulate every replica's samples up to now and count the time it lost waiting."""
        now, waits = self.now, self.report.wait_replica_s
        for replica in stage.replicas.values():
            start, dt = replica.settled_at, now - replica.settled_at
            replica.settled_at = now
            if dt <= 0 or not replica.alive:
                continue
            self.report.replica_s += dt
            busy = max(0.0, min(now, replica.busy_until) - start)
            if busy > 0:
                waits[replica.busy_cause] += busy
            free = dt - busy
            if replica.waiting:
                waits["full"] += free
            else:
                replica.pending += replica.rate * free

    def _claim_of(self, replica: _Replica) -> ReplicaClaim:
        return ReplicaClaim(replica.peer_id, replica.step, replica.accum_step, int(replica.pending), 0, replica.digest)

    @staticmethod
    def _announced(stage: _Stage) -> Tuple[ReplicaClaim, ...]:
        """The claims the stage's records carry: a replica that never announced has none."""
        return tuple(r.claim for r in stage.replicas.values() if r.claim is not None)

    @staticmethod
    def _round(stage: _Stage) -> _Round:
        """The round under way at ``stage``: only its events and the steps it applies look at it."""
        if stage.round is None:
            raise RuntimeError(f"stage {stage.index} has no averaging round under way")
        return stage.round

    def _view(
        self, stage: _Stage, replica: _Replica, claims: Tuple[ReplicaClaim, ...], clock_steps: Tuple[int, ...]
    ) -> StageView:
        now = self.now
        distrusted = {p for p, until in stage.distrusted.items() if until > now}
        others = [c for c in claims if c.peer_id != replica.peer_id]
        return StageView(
            peer_id=replica.peer_id,
            is_clock=stage.is_clock,
            target_batch_size=self.config.target_batch_size,
            step=replica.step,
            accum_step=replica.accum_step,
            samples_pending=int(replica.pending),
            samples_admitted=0,
            digest=replica.digest,
            averaging=stage.round is not None and replica.busy_until > now,
            others=trusted_others(others, distrusted),
            clock_steps=clock_steps,
            voters=tuple(others),
            history=tuple(replica.history) + ((replica.step, replica.digest),),
            samples_per_s=self._stage_rate(stage),
        )

    def _stage_rate(self, stage: _Stage) -> float:
        """Samples/s the stage accumulates now: what a live replica measures from the growth of the stage's claims."""
        return sum(r.rate for r in stage.replicas.values() if r.active(self.now) and not r.waiting)

    def _clock_steps(self) -> Tuple[int, ...]:
        # the steps the clock's replicas accumulate for; a simulated replica moves on when it applies a step, not
        # when it freezes one, so the other stages close theirs an all-reduce later than the live ones do
        return tuple(r.accum_step for r in self.stages[-1].replicas.values())

    # ---- the protocol ----

    def _check(self, stage: _Stage) -> None:
        """One check of a stage: announce, resync whoever must, close the step or hold back whoever must wait."""
        config, now = self.config, self.now
        self._settle(stage)
        self._read_rates(stage)
        self._announce(stage)
        claims = self._announced(stage)
        clock_steps = self._clock_steps()
        if not stage.is_clock:
            self._schedule(stage, now + config.idle_check_period_s)
        deciders = self._deciders(stage)
        if not deciders:
            self._schedule(stage, now + config.announce_period_s)
            return
        view = self._view(stage, stage.replicas[deciders[0]], claims, clock_steps)
        self._resync_if_needed(stage, majority_state(view), claims, clock_steps)
        if stage.round is not None:
            if stage.round.overlapped:  # the next step fills meanwhile: the clock holds back once it is full
                self._hold_back(stage, view)
            return  # the round's end checks again
        if step_is_due(view):
            self._close(stage, view)
            return
        self._hold_back(stage, view)

    def _hold_back(self, stage: _Stage, view: StageView) -> None:
        """Whether the stage's replicas must wait before they accumulate more (:func:`must_wait`); the clock's next
        check comes when that answer could change."""
        wait = must_wait(view)
        for replica in stage.replicas.values():
            replica.waiting = wait and replica.active(self.now)
        if stage.is_clock:
            self._schedule(stage, self._next_clock_check(stage, view))

    def _announce(self, stage: _Stage) -> None:
        for replica in stage.replicas.values():
            if replica.alive:  # a crashed replica's record keeps its last claim
                replica.claim = self._claim_of(replica)

    def _read_rates(self, stage: _Stage) -> None:
        rates = self.rates(stage.index)
        for replica in stage.replicas.values():
            replica.rate = rates.get(replica.peer_id, 0.0) if replica.alive else 0.0

    def _deciders(self, stage: _Stage) -> List[str]:
        return sorted(p for p, r in stage.replicas.items() if r.active(self.now) and not r.stalled)

    def _next_clock_check(self, stage: _Stage, view: StageView) -> float:
        """The first instant on the live check grid at which the policy's answer could change at the current
        rates: the stage's held samples reaching :func:`near_threshold` (checks speed up) or the target, or its
        pending samples reaching the target. Never later than ``idle_check_period_s``."""
        config, rate = self.config, self._stage_rate(stage)
        target = view.target_batch_size
        held = view.samples_pending + others_reserved(view)
        due = view.samples_pending + others_pending(view)
        near = near_target(view)
        gaps = (target - held, target - due) + (() if near else (near_threshold(view) - held,))
        if min(gaps) <= 0:
            delay = 0.0  # something may be due already: the next check on the grid decides
        else:
            delay = min(gaps) / rate if rate > 0 else config.idle_check_period_s
        period = config.poll_period_s if near else config.announce_period_s
        delay = min(max(period, math.ceil(delay / period - 1e-9) * period), config.idle_check_period_s)
        return self.now + delay

    def _resync_if_needed(
        self,
        stage: _Stage,
        majority: Optional[Tuple[int, str]],
        claims: Tuple[ReplicaClaim, ...],
        clock_steps: Tuple[int, ...],
    ) -> None:
        """Replicas whose state is not the majority's ask the policy whether to download the stage's state (for
        those that hold it, the policy's answer is no)."""
        if majority is not None and all((r.step, r.digest) == majority for r in stage.replicas.values()):
            return
        for replica in list(stage.replicas.values()):
            if (
                not replica.active(self.now)
                or (replica.step, replica.digest) == majority
                or (stage.round is not None and replica.peer_id in stage.round.members)
            ):
                continue
            if needs_resync(self._view(stage, replica, claims, clock_steps)):
                replica.busy_until, replica.busy_cause = self.now + self.config.resync_time_s, "resync"
                replica.waiting = False
                self.report.resyncs += 1
                self._push(replica.busy_until, "resynced", stage.index, replica.peer_id)

    def _resynced(self, stage: _Stage, peer_id: str) -> None:
        replica = stage.replicas.get(peer_id)
        if replica is None or not replica.alive:
            return
        self._settle(stage)
        others = _Stage(
            stage.index,
            stage.is_clock,
            {p: r for p, r in stage.replicas.items() if p != peer_id},
            last_state=stage.last_state,
        )
        if any(r.alive and not r.stalled for r in others.replicas.values()):
            replica.step, replica.digest = self._stage_state(others)
        replica.accum_step, replica.pending = replica.step, 0.0
        replica.history.clear()
        replica.claim = self._claim_of(replica)

    def _close(self, stage: _Stage, view: StageView) -> None:
        """Freeze the step: the replicas able to act that accumulate for it average together."""
        now = self.now
        members = sorted(
            p for p, r in stage.replicas.items() if r.active(now) and not r.stalled and r.accum_step == view.accum_step
        )
        claims = {c.peer_id: c.samples_pending for c in view.others if c.accum_step == view.accum_step}
        stage.round = _Round(members, claims, [c.peer_id for c in view.others])
        for peer_id in members:
            stage.replicas[peer_id].waiting = False
        if not view.others:  # nobody else to wait for: apply at once, as the live peer does
            stage.round.members = [view.peer_id]
            self._apply(stage, [view.peer_id])
        elif len(members) >= 2:
            matchmaking_s = 0.0 if len(members) >= full_group_size(view) else self.config.matchmaking_time_s
            if self.config.overlap_averaging:
                self._freeze_for_overlap(stage, members)
            self._start_round(
                stage,
                "averaging",
                allreduce_time_s(
                    self.config.stage_param_mib, [stage.replicas[p].bandwidth_mbps for p in members], matchmaking_s
                ),
                "averaged",
            )
        else:
            self._start_round(stage, "failed_rounds", 3.0 * self.config.matchmaking_time_s, "round_failed")

    def _freeze_for_overlap(self, stage: _Stage, members: List[str]) -> None:
        """As the live runner's freeze: the members' samples go to the round and they accumulate for the next step."""
        self._round(stage).overlapped = True
        for peer_id in members:
            replica = stage.replicas[peer_id]
            replica.frozen, replica.pending = replica.pending, 0.0
            replica.accum_step += 1
            replica.claim = self._claim_of(replica)
        if stage.is_clock:  # it holds back once the next step is full, as it would between rounds
            self._schedule(stage, self.now + self.config.poll_period_s)

    def _start_round(self, stage: _Stage, cause: str, duration_s: float, kind: str) -> None:
        round_ = self._round(stage)
        for peer_id in round_.members:
            replica = stage.replicas[peer_id]
            if not round_.overlapped:  # an overlapped round keeps its members computing
                replica.busy_until, replica.busy_cause = self.now + duration_s, cause
        self._push(self.now + duration_s, kind, stage.index)

    def _live_members(self, stage: _Stage) -> List[str]:
        return [p for p in self._round(stage).members if p in stage.replicas and stage.replicas[p].alive]

    def _averaged(self, stage: _Stage) -> None:
        self._settle(stage)
        members = self._live_members(stage)
        if members:
            self._apply(stage, members)
        else:
            stage.round = None
            self._schedule(stage, self.now)

    def _round_failed(self, stage: _Stage) -> None:
        """Nobody averaged with the lone member: retry, or apply alone once the policy says so."""
        self._settle(stage)
        members = self._live_members(stage)
        if not members:
            stage.round = None
            self._schedule(stage, self.now)
            return
        replica = stage.replicas[members[0]]
        replica.failed_rounds += 1
        claims = tuple(self._claim_of(r) for r in stage.replicas.values())
        limit = rounds_before_stepping_alone(
            self._view(stage, replica, claims, self._clock_steps()), self.config.max_failed_rounds
        )
        if step_alone(replica.failed_rounds, limit):
            self.report.steps_alone += 1
            self._distrust(stage, self._round(stage).others, transient=True)
            self._apply(stage, members)
        else:
            self._start_round(stage, "failed_rounds", 3.0 * self.config.matchmaking_time_s, "round_failed")

    def _distrust(self, stage: _Stage, peer_ids, transient: bool = False) -> None:
        for peer_id in peer_ids:
            strikes = None
            if transient:
                strikes = stage.strikes[peer_id] = stage.strikes.get(peer_id, 0) + 1
            until = self.now + distrust_seconds(strikes, limit=self.config.distrust_s)
            if stage.distrusted.get(peer_id, -math.inf) <= self.now:
                replica = stage.replicas.get(peer_id)
                if replica is not None and replica.alive:
                    self.report.distrusted += 1
                else:
                    self.report.distrusted_departed += 1
            stage.distrusted[peer_id] = max(stage.distrusted.get(peer_id, -math.inf), until)

    def _apply(self, stage: _Stage, members: List[str]) -> None:
        """Apply the step with the members' gradients; the clock's steps are the swarm's global steps."""
        round_, now = self._round(stage), self.now
        gathered = {
            p: int(stage.replicas[p].frozen if round_.overlapped else stage.replicas[p].pending) for p in members
        }
        self._distrust(stage, sorted(overclaimers(round_.claims, gathered)))
        self._distrust(stage, sorted(absent_claimants(round_.claims, gathered)), transient=True)
        if len(members) > 1:
            for peer_id in members:
                stage.strikes.pop(peer_id, None)
        first = stage.replicas[members[0]]
        step, digest = first.step + 1, f"s{stage.index}-{first.step + 1}-{members[0]}"
        for peer_id in members:
            replica = stage.replicas[peer_id]
            replica.history.append((replica.step, replica.digest))
            replica.step = replica.accum_step = step  # overlapped, it has accumulated for this one since the freeze
            replica.digest, replica.failed_rounds = digest, 0
            replica.pending, replica.frozen = (replica.pending if round_.overlapped else 0.0), 0.0
            replica.busy_until = min(replica.busy_until, now)
            replica.claim = self._claim_of(replica)
        stage.round, stage.last_state = None, (step, digest)
        self._schedule(stage, now + self.config.poll_period_s)
        if stage.is_clock:
            if step > len(self.report.step_times_s):  # a step applied alone after the others' does not count twice
                self.report.step_times_s.append(now)
                self.report.step_samples.append(sum(gathered.values()))
            # the other stages hear of it from the trainers' next backward calls, and ask the clock's replicas
            for other in self.stages[:-1]:
                self._schedule(other, now + self.config.poll_period_s)
