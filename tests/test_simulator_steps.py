"""The simulator runs the live step policy: predictable step counts, a frozen replica, the report."""

import dataclasses

import pytest

from swarm.policy.rebalance import RebalanceConfig
from swarm.simulate import SimConfig, run_experiment
from swarm.simulate.churn import generate_churn
from swarm.config.simulation import StepSimConfig
from swarm.simulate.engine import _Run
from swarm.simulate.experiment import optimum_timeline
from swarm.simulate.stepping import allreduce_time_s

THROUGHPUT = 2.0  # samples/s of every peer
TARGET = 400
PARAM_MIB = 500.0  # 0.84 s per all-reduce on the 10 Gbit/s links


def _steady(num_peers: int = 4, **steps) -> SimConfig:
    """2 stages x 2 replicas (by default), constant throughput, links far faster than compute, no churn."""
    return SimConfig(num_peers=num_peers, num_stages=2, hours=1.0, seed=0, throughput_list=(THROUGHPUT,),
                     throughput_jitter=0.0, bandwidth_mbps_median=10_000.0, bandwidth_sigma=0.0,
                     join_rate_per_h=0.0, mean_lifetime_h=1e6, crash_fraction=0.0, num_trainers=4,
                     rebalance=RebalanceConfig(period_s=300.0, min_gain=0.01, max_movers_per_period=1),
                     steps=StepSimConfig(target_batch_size=TARGET, stage_param_mib=PARAM_MIB, **steps))


def _run(config: SimConfig) -> _Run:
    churn = generate_churn(config)
    run = _Run(config, churn, optimum_timeline(config, churn).steps, True, "auto", steps=True)
    run.run()
    return run


def test_steps_per_hour_follow_throughput_over_target():
    config = _steady()
    report = _run(config).result.steps
    summary = report.summary()
    stage_rate = 2 * THROUGHPUT  # the clock stage's two replicas
    # every replica averages every step, so each group is whole at once and waits out no matchmaking time
    averaging_s = allreduce_time_s(PARAM_MIB, [10_000.0], 0.0)
    # replicas serve once their download ends; a step takes the batch's time plus one all-reduce, during which
    # the replicas wait
    expected = (config.duration_s - config.join_time_s) / (TARGET / stage_rate + averaging_s)
    assert summary["global_steps"] == pytest.approx(expected, rel=0.03)
    assert summary["global_steps_per_hour"] == pytest.approx(expected / config.hours, rel=0.03)
    # a step closes at the first check at or after the target: at most one poll's worth of samples more
    assert TARGET <= summary["samples_per_step_p5"] <= summary["samples_per_step_p95"] \
        <= TARGET + stage_rate * config.steps.poll_period_s + 1
    # every replica of both stages waits out every all-reduce of its stage, and nothing else
    waits = summary["wait_replica_s_by_cause"]
    assert waits["averaging"] == pytest.approx(2 * 2 * averaging_s * summary["global_steps"], rel=0.05)
    assert waits["failed_rounds"] == waits["resync"] == 0.0
    assert summary["steps_alone"] == summary["resyncs"] == summary["distrusted"] == 0
    # steps are evenly spaced
    gaps = [b - a for a, b in zip(report.step_times_s, report.step_times_s[1:])]
    assert max(gaps) - min(gaps) <= config.steps.poll_period_s + 1e-6


def test_a_frozen_replica_is_stepped_around_alone():
    healthy = _run(_steady())
    clock = healthy.steps.stages[-1]
    frozen = sorted(clock.replicas)[0]
    run = _run(_steady(stalled_peers=(frozen,)))
    summary = run.result.steps.summary()
    # it announces pending samples but never averages: its stage-mate fails max_failed_rounds rounds, applies
    # the step alone and stops believing it; the frozen replica, now behind, downloads the state
    assert summary["steps_alone"] >= 1
    assert summary["distrusted"] >= 1
    assert summary["resyncs"] >= 1
    assert summary["wait_replica_s_by_cause"]["failed_rounds"] >= 2 * 3 * run.config.steps.matchmaking_time_s
    # the stage keeps stepping, on the healthy replica's samples alone (fewer per step than the target at times)
    healthy_steps = healthy.result.steps.summary()["global_steps"]
    assert 0.3 * healthy_steps < summary["global_steps"] <= healthy_steps
    assert summary["samples_per_step_p5"] < TARGET
    assert run.steps.stages[-1].replicas[frozen].step < max(r.step for r in run.steps.stages[-1].replicas.values()) \
        or summary["resyncs"] >= 1


def test_a_group_short_of_a_known_replica_waits_out_the_matchmaking_time():
    """3 replicas per stage, one of the clock's frozen: the other two are a majority and average without it,
    but only after the matchmaking time, since the view holds a third replica that might still come."""
    config = _steady(num_peers=6)
    clock = _run(config).steps.stages[-1]
    assert len(clock.replicas) == 3
    run = _run(_steady(num_peers=6, stalled_peers=(sorted(clock.replicas)[0],)))
    summary = run.result.steps.summary()
    assert summary["global_steps"] > 0
    per_round = allreduce_time_s(PARAM_MIB, [10_000.0], run.config.steps.matchmaking_time_s)
    # the clock's two healthy replicas wait out every one of its rounds in full, matchmaking included
    assert summary["wait_replica_s_by_cause"]["averaging"] >= 2 * per_round * summary["global_steps"] * 0.9


def test_experiment_reports_steps_and_config_is_validated():
    summary = run_experiment(dataclasses.replace(_steady(), hours=0.2))
    for key in ("global_steps_per_hour", "samples_per_step_mean", "wait_replica_s"):
        assert key in summary["steps"]
    off = run_experiment(dataclasses.replace(_steady(), hours=0.2, steps=StepSimConfig(enabled=False)))
    assert off["steps"] is None
    with pytest.raises(ValueError, match="target_batch_size"):
        StepSimConfig(target_batch_size=0)
    with pytest.raises(ValueError, match="poll_period_s"):
        StepSimConfig(poll_period_s=-1.0)


def test_an_honest_swarm_under_churn_distrusts_only_replicas_that_are_gone():
    """Replicas crash (their records keep their last claims until they expire) and new ones join: the stage
    stops believing the claims of the crashed ones, which the report counts apart, and never distrusts a
    replica that is still online."""
    config = dataclasses.replace(_steady(num_peers=8), mean_lifetime_h=0.25, crash_fraction=1.0,
                                 join_rate_per_h=32.0)
    summary = _run(config).result.steps.summary()
    assert summary["global_steps"] > 0
    assert summary["distrusted_departed"] >= 1
    assert summary["distrusted"] == 0


@pytest.mark.parametrize("averaging_s", [50.0, 150.0])  # shorter and longer than a step's 100 s of compute
def test_overlapped_averaging_keeps_replicas_computing(averaging_s):
    """With the all-reduce overlapped, a step takes its batch's compute or its all-reduce, whichever is longer,
    instead of both: replicas wait only where the clock holds a whole next batch before the round ends."""
    mib = averaging_s / allreduce_time_s(1.0, [10_000.0], 0.0)
    runs = {}
    for overlap in (False, True):
        config = _steady(overlap_averaging=overlap)
        config = dataclasses.replace(config, steps=dataclasses.replace(config.steps, stage_param_mib=mib))
        runs[overlap] = _run(config).result.steps.summary()
    serial, overlapped = runs[False], runs[True]
    config = _steady()
    fill_s = TARGET / (2 * THROUGHPUT)
    span = config.duration_s - config.join_time_s
    assert serial["global_steps"] == pytest.approx(span / (fill_s + averaging_s), abs=1)
    # the first step applies after its batch and its round; one applies every max(batch, round) after that
    assert overlapped["global_steps"] == pytest.approx(1 + (span - fill_s - averaging_s) / max(fill_s, averaging_s),
                                                       abs=1)
    assert overlapped["wait_replica_s_by_cause"]["averaging"] == 0.0
    waited_full = overlapped["wait_replica_s_by_cause"]["full"]
    # only the clock's 2 replicas hold back, for what the round outlasts the next batch
    assert waited_full == pytest.approx(2 * max(0.0, averaging_s - fill_s) * overlapped["global_steps"], rel=0.1,
                                        abs=2 * 2 * config.steps.poll_period_s * overlapped["global_steps"])
    assert TARGET <= overlapped["samples_per_step_p5"] <= overlapped["samples_per_step_p95"] \
        <= TARGET + 2 * THROUGHPUT * config.steps.poll_period_s + 1
    assert overlapped["steps_alone"] == overlapped["resyncs"] == overlapped["distrusted"] == 0
