"""The simulator: deterministic, exact optimum, rebalancing helps under churn, CLI works."""

import dataclasses
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.policy.rebalance import RebalanceConfig
from swarm.simulate import SimConfig, max_min_partition, run_experiment
from swarm.simulate.churn import generate_churn, load_trace
from swarm.simulate.engine import _Run, simulate_run
from swarm.simulate.experiment import optimum_timeline
from swarm.simulate.optimum import MaxMinTracker

ROOT = Path(__file__).resolve().parent.parent


def _brute_force(values, num_bins):
    best = 0
    for assignment in itertools.product(range(num_bins), repeat=len(values)):
        loads = [0] * num_bins
        for value, b in zip(values, assignment):
            loads[b] += value
        best = max(best, min(loads))
    return best


def test_optimum_matches_brute_force_on_small_cases():
    rng = random.Random(0)
    for _ in range(300):
        num_bins = rng.randrange(1, 4)
        values = [rng.choice([rng.randrange(1, 10), rng.randrange(1, 100)]) for _ in range(rng.randrange(0, 9))]
        result = max_min_partition(values, num_bins)
        assert result.exact and result.value == _brute_force(values, num_bins), (values, num_bins)
    assert max_min_partition([100, 1, 1, 1], 2).value == 3  # a giant peeled off alone
    assert max_min_partition([3, 3, 2, 2, 2], 2).value == 6  # greedy LPT gives 5


def test_tracker_stays_exact_under_churn_and_matches_bound():
    rng = random.Random(1)
    tracker, live = MaxMinTracker(3), []
    for step in range(300):
        if live and rng.random() < 0.45:
            tracker.remove(live.pop(rng.randrange(len(live))))
        else:
            live.append(step)
            tracker.add(step, rng.randrange(1, 30))
        if len(live) <= 8:
            values = [tracker.where[k][1] for k in live]
            assert tracker.optimum().value == _brute_force(values, 3)
        else:
            result = tracker.optimum()
            assert result.value <= result.upper <= sum(tracker.loads) // 3


def test_repair_step_moves_closest_to_half_the_gap():
    # the repair's step search (early exit, vectorised pairs) against every exchange
    rng = random.Random(2)
    for _ in range(200):
        tracker = MaxMinTracker(2)
        for key in range(rng.randrange(2, 14)):
            tracker._put(key, rng.randrange(1, 40), rng.randrange(2))
        low, high = sorted(range(2), key=tracker.loads.__getitem__)
        gap = tracker.loads[high] - tracker.loads[low]
        for pairs in (False, True):
            def selections(index):
                items = [value for value, count in tracker.bins[index].items() for _ in range(count)]
                sizes = (0, 1, 2) if pairs else (0, 1)
                return [c for k in sizes for c in itertools.combinations(items, k)]
            distances = [abs(sum(h) - sum(l) - gap / 2) for h in selections(high) for l in selections(low)
                         if 0 < sum(h) - sum(l) < gap]
            step = tracker._best_step(low, high, pairs)
            assert (step is None) == (not distances)
            if step is not None:
                assert abs(sum(step[0]) - sum(step[1]) - gap / 2) == min(distances)
                assert all(tracker.bins[high][v] >= step[0].count(v) for v in step[0])
                assert all(tracker.bins[low][v] >= step[1].count(v) for v in step[1])


def _small(**overrides):
    base = dict(num_peers=60, num_stages=4, hours=3.0, seed=3, mean_lifetime_h=1.0, num_trainers=16,
                rebalance=RebalanceConfig(period_s=300.0, min_gain=0.01, max_movers_per_period=1))
    base.update(overrides)
    return SimConfig(**base)


def test_simulation_is_deterministic_for_a_seed():
    first, second = run_experiment(_small()), run_experiment(_small())
    for summary in (first, second):
        summary.pop("wall_s")
    assert first == second
    other = run_experiment(_small(seed=4))
    other.pop("wall_s")
    assert other != first


def test_rebalancing_beats_static_under_churn():
    # both runs join with --stage auto, so only the moves differ: newcomers crowd wherever
    # the snapshot says, while preemption hollows stages out; only moves can fix the rest
    summary = run_experiment(_small(throughput_list=(1.0, 1.0, 1.0, 6.0), crash_fraction=0.5,
                                    static_join_policy="auto"))
    assert summary["moves"] > 0
    assert summary["fraction_of_optimal_rebalanced"] > summary["fraction_of_optimal_static"]
    assert 0.0 < summary["fraction_of_optimal_static"] <= 1.0 + 1e-9
    assert summary["fraction_of_optimal_rebalanced"] <= 1.0 + 1e-9
    assert summary["optimum_inexact"] <= summary["optimum_evaluations"]


def test_random_joins_unbalance_the_static_swarm():
    # the paper's baseline: without load-aware joins nor moves, churn drifts the stages
    # apart; joining with --stage auto alone keeps them close
    config = _small(num_peers=100, hours=2.0, mean_lifetime_h=0.5)
    random_join = run_experiment(config)
    auto_join = run_experiment(dataclasses.replace(config, static_join_policy="auto"))
    assert random_join["join_policy_static"] == "random" and auto_join["join_policy_static"] == "auto"
    assert random_join["fraction_of_optimal_static"] < auto_join["fraction_of_optimal_static"] - 0.03
    # the rebalanced run does not depend on the baseline's join policy
    assert random_join["series_rebalanced"] == auto_join["series_rebalanced"]
    with pytest.raises(ValueError, match="static_join_policy"):
        _small(static_join_policy="roundrobin")


class _NeverClean(set):
    """A dirty set that stays full: every stage recomputed whenever the flow is."""

    def clear(self):
        pass


@pytest.mark.parametrize("rebalancing,join_policy", [(True, "auto"), (False, "random")])
def test_incremental_flow_matches_full_recompute(rebalancing, join_policy):
    # the engine recomputes only stages whose routing changed, and only when time advances;
    # recomputing every stage at every step must give exactly the same run
    config = _small(hours=2.0, crash_fraction=0.5)
    churn = generate_churn(config)
    steps = optimum_timeline(config, churn).steps
    fast = simulate_run(config, churn, steps, rebalancing, join_policy)
    run = _Run(config, churn, steps, rebalancing, join_policy)
    run.dirty = _NeverClean(range(config.num_stages))
    full = run.run()
    assert fast.samples > 0 and (fast.series, fast.samples, fast.num_moves) == (full.series, full.samples, full.num_moves)


def test_trace_file_is_read_and_validated(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,event,peer_id,compute\n0,join,a,2.0\n0,join,b,1.0\n10,crash,a\n")
    events = load_trace(str(trace), _small())
    assert [(e.kind, e.peer_id) for e in events] == [("join", "a"), ("join", "b"), ("crash", "a")]
    assert events[0].hardware.compute == 2.0
    trace.write_text("0,preempt,zz\n")
    with pytest.raises(ValueError, match="row 1"):
        load_trace(str(trace), _small())
    assert generate_churn(_small()) == generate_churn(_small())


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="num_stages"):
        SimConfig(num_stages=0)
    with pytest.raises(ValueError, match="crash_fraction"):
        SimConfig(crash_fraction=2.0)


def test_cli_prints_json_last_line():
    completed = subprocess.run(
        [sys.executable, "-m", "peers.cli", "simulate", "--peers", "40", "--stages", "3", "--hours", "1",
         "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    for key in ("fraction_of_optimal_rebalanced", "fraction_of_optimal_static", "wall_s"):
        assert isinstance(summary[key], float)
    assert summary["join_policy_static"] == "random"
    auto = subprocess.run(
        [sys.executable, "-m", "peers.cli", "simulate", "--peers", "40", "--stages", "3", "--hours", "0.5",
         "--static_join", "auto", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert auto.returncode == 0, auto.stderr
    assert json.loads(auto.stdout.strip().splitlines()[-1])["join_policy_static"] == "auto"
    bad = subprocess.run([sys.executable, "-m", "peers.cli", "simulate", "--stages", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "num_stages" in bad.stderr
