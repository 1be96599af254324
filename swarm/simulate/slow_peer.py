"""A slow peer joins a balanced swarm: the simulator's account of what it costs, with and without the policy.

A 2-stage swarm of four equal peers (2 + 2) whose trainers keep a bounded number of micro-batches in
flight, as live trainers do; after it has run for ``join_at_s`` a peer ``slowdown`` times slower than
the others joins (the stage it needs capacity most, ``--stage auto``). Each slowdown is a fresh run.
The fluid model of :mod:`swarm.simulate.engine` routes with the live :class:`~swarm.policy.routing.Router`:
``slow_tolerance`` inf is throughput-proportional routing alone, a finite one adds
:func:`swarm.policy.slow_replicas.worth_waiting_for`. Samples/s are read from the run's series
before the join and once the newcomer is measured.

Trainers are the limit here (their in-flight budget over the round trip, Little's law), which is
where a slow replica hurts: a micro-batch routed to it holds a trainer's slot for its whole, long
hop. The fluid model has no queues, so it does not show the slow replica helping a saturated stage
(live, queued calls at its stage-mates make it worth waiting for, see the routing rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Sequence

from swarm.policy.slow_replicas import SLOW_TOLERANCE
from swarm.simulate.churn import ChurnEvent
from swarm.config.simulation import SimConfig, StepSimConfig
from swarm.simulate.engine import simulate_run
from swarm.simulate.network import Hardware

__all__ = ["SlowPeerScenario", "run_slow_peer_scenario"]


@dataclass(frozen=True)
class SlowPeerScenario:
    """The swarm, the slow newcomers and the routing rule of :func:`run_slow_peer_scenario`."""

    slowdowns: Sequence[float] = (5.0, 50.0)  # how many times slower each newcomer is (one run each)
    compute: float = 20.0  # samples/s of each of the four balanced peers
    num_trainers: int = 2
    max_in_flight: int = 2  # micro-batches each trainer keeps in flight
    microbatch_size: int = 4  # samples per micro-batch
    latency_s: float = 0.001  # one-way access latency of every peer, seconds
    join_at_s: float = 100.0  # when the slow peer joins
    join_time_s: float = 20.0  # seconds a peer downloads state before serving
    measure_s: float = 10.0  # seconds until a peer announces its measured throughput
    duration_s: float = 300.0  # simulated seconds per run
    slow_tolerance: float = SLOW_TOLERANCE  # inf = throughput-proportional routing alone

    def __post_init__(self) -> None:
        if not self.slowdowns or any(not (s >= 1.0 and math.isfinite(s)) for s in self.slowdowns):
            raise ValueError(f"slowdowns must be finite numbers >= 1, got {self.slowdowns!r}")
        if not self.join_at_s + self.join_time_s + self.measure_s < self.duration_s:
            raise ValueError("the slow peer must join, download and be measured before the run ends")


def _config(scenario: SlowPeerScenario) -> SimConfig:
    return SimConfig(
        num_peers=4,
        num_stages=2,
        hours=scenario.duration_s / 3600.0,
        seed=0,
        throughput_list=(scenario.compute,),
        bandwidth_mbps_median=10_000.0,
        bandwidth_sigma=0.0,
        latency_ms_range=(1000 * scenario.latency_s,) * 2,
        activation_mib_per_sample=0.01,
        num_trainers=scenario.num_trainers,
        max_inflight_per_trainer=scenario.max_in_flight,
        microbatch_size=scenario.microbatch_size,
        join_rate_per_h=0.0,
        join_time_s=scenario.join_time_s,
        measure_s=scenario.measure_s,
        sample_period_s=5.0,
        steps=StepSimConfig(enabled=False),
        slow_replica_tolerance=scenario.slow_tolerance,
    )


def _churn(scenario: SlowPeerScenario, slowdown: float) -> List[ChurnEvent]:
    def machine(compute: float) -> Hardware:
        return Hardware(compute, 10_000.0, scenario.latency_s)

    events = [ChurnEvent(0.0, "join", f"peer{i}", machine(scenario.compute)) for i in range(4)]
    events.append(ChurnEvent(scenario.join_at_s, "join", "slow", machine(scenario.compute / slowdown)))
    return events


def run_slow_peer_scenario(scenario: SlowPeerScenario) -> List[Dict[str, float]]:
    """One run per slowdown; for each: samples/s just before the join and at the end, and their ratio."""
    config = _config(scenario)
    results = []
    for slowdown in scenario.slowdowns:
        run = simulate_run(config, _churn(scenario, slowdown), [], rebalancing=False, join_policy="auto")
        before = [flow for hour, flow, _ in run.series if hour * 3600.0 < scenario.join_at_s][-1]
        after = run.series[-1][1]
        results.append(
            {
                "slowdown": slowdown,
                "samples_per_s_before": round(before, 3),
                "samples_per_s_after": round(after, 3),
                "throughput_ratio_after_vs_before": round(after / before, 4) if before > 0 else 0.0,
                "slow_tolerance": scenario.slow_tolerance,
            }
        )
    return results


def compare(scenario: SlowPeerScenario = SlowPeerScenario()) -> Dict[str, List[Dict[str, float]]]:
    """The scenario with the policy and with throughput-proportional routing alone."""
    return {
        "policy": run_slow_peer_scenario(scenario),
        "naive": run_slow_peer_scenario(replace(scenario, slow_tolerance=math.inf)),
    }
