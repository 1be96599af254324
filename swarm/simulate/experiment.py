"""The rebalancing experiment: the same churn with and without rebalancing, against the optimum."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from swarm.simulate.churn import ChurnEvent, churn_for
from swarm.config.simulation import SimConfig
from swarm.simulate.engine import RunResult, simulate_run
from swarm.simulate.network import effective_units
from swarm.simulate.optimum import MaxMinTracker

__all__ = ["OptimumTimeline", "optimum_timeline", "run_experiment"]


@dataclass(frozen=True)
class OptimumTimeline:
    """Optimal swarm throughput over time as (time_s, samples/s) steps, and how it was proved."""

    steps: List[Tuple[float, float]]
    num_evaluations: int
    num_inexact: int  # evaluations where only the upper bound could be proved (it is used)


def optimum_timeline(config: SimConfig, churn: Sequence[ChurnEvent]) -> OptimumTimeline:
    """The best assignment of the *live* peers at every moment.

    Live = finished its first download and not preempted yet; the same set in every run, so
    the optimum is shared. Peers that are moving between stages count as live: the cost of
    moving is part of what rebalancing is judged on.
    """
    joins: Dict[str, ChurnEvent] = {e.peer_id: e for e in churn if e.kind == "join"}
    departures = {e.peer_id: e.time_s for e in churn if e.kind != "join"}
    changes: List[Tuple[float, int, str]] = []
    for peer_id, join in joins.items():
        start = join.time_s + config.join_time_s
        end = departures.get(peer_id, float("inf"))
        if start < end and start < config.duration_s:
            changes.append((start, 1, peer_id))
            if end < config.duration_s:
                changes.append((end, 0, peer_id))
    changes.sort()
    tracker = MaxMinTracker(config.num_stages)
    steps: List[Tuple[float, float]] = [(0.0, 0.0)]
    evaluations = inexact = 0
    index = 0
    while index < len(changes):
        now = changes[index][0]
        while index < len(changes) and changes[index][0] == now:
            _, is_add, peer_id = changes[index]
            if is_add:
                tracker.add(peer_id, effective_units(joins[peer_id].joining_hardware(), config))
            else:
                tracker.remove(peer_id)
            index += 1
        result = tracker.optimum()
        evaluations += 1
        inexact += not result.exact
        upper = result.value if result.upper is None else result.upper  # filled in by PartitionResult itself
        steps.append((now, upper * config.throughput_quantum))
    return OptimumTimeline(steps, evaluations, inexact)


def run_experiment(config: SimConfig) -> dict:
    """Run with rebalancing and without on the same churn; a JSON-ready summary.

    Rebalanced: peers join with the live ``--stage auto`` policy and re-plan every
    ``config.rebalance.period_s``; it also runs the global-step protocol (``steps`` in the summary,
    when ``config.steps.enabled``). Static: no moves, peers join by ``config.static_join_policy``.
    """
    started = time.perf_counter()
    churn = churn_for(config)
    timeline = optimum_timeline(config, churn)
    rebalanced = simulate_run(config, churn, timeline.steps, rebalancing=True, steps=True)
    static = simulate_run(config, churn, timeline.steps, rebalancing=False, join_policy=config.static_join_policy)
    return _summary(config, churn, timeline, rebalanced, static, time.perf_counter() - started)


def _summary(
    config: SimConfig,
    churn: Sequence[ChurnEvent],
    timeline: OptimumTimeline,
    rebalanced: RunResult,
    static: RunResult,
    wall_s: float,
) -> dict:
    hours = config.hours
    return {
        "fraction_of_optimal_rebalanced": round(rebalanced.fraction_of_optimal, 4),
        "fraction_of_optimal_static": round(static.fraction_of_optimal, 4),
        "wall_s": round(wall_s, 2),
        "peers": config.num_peers,
        "stages": config.num_stages,
        "hours": hours,
        "seed": config.seed,
        "rebalance_period_s": config.rebalance.period_s,
        "rebalance_min_gain": config.rebalance.min_gain,
        "rebalance_max_movers_per_period": config.rebalance.max_movers_per_period,
        "join_policy_rebalanced": rebalanced.join_policy,
        "join_policy_static": static.join_policy,
        "mean_lifetime_h": config.mean_lifetime_h,
        "crash_fraction": config.crash_fraction,
        "trainers": config.num_trainers,
        "mean_throughput_rebalanced": round(rebalanced.samples / config.duration_s, 3),
        "mean_throughput_static": round(static.samples / config.duration_s, 3),
        "mean_throughput_optimal": round(rebalanced.optimal_samples / config.duration_s, 3),
        "moves": rebalanced.num_moves,
        "joins": sum(e.kind == "join" for e in churn),
        "preemptions": sum(e.kind == "preempt" for e in churn),
        "crashes": sum(e.kind == "crash" for e in churn),
        "trainer_bound_fraction_rebalanced": round(rebalanced.trainer_bound_s / config.duration_s, 4),
        "optimum_evaluations": timeline.num_evaluations,
        "optimum_inexact": timeline.num_inexact,
        "series_hours": [round(row[0], 3) for row in rebalanced.series],
        "series_rebalanced": [round(row[1], 2) for row in rebalanced.series],
        "series_static": [round(row[1], 2) for row in static.series],
        "series_optimal": [round(row[2], 2) for row in rebalanced.series],
        "steps": rebalanced.steps.summary() if rebalanced.steps is not None else None,
    }
