"""Slow replicas: trainers do not wait on them, unmeasured ones are probed, a replica too slow stands by;
and in the simulator a 5x and a 50x slower peer joining a balanced swarm cost nothing with the policy,
while throughput-proportional routing alone loses a large share."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
from swarm.policy.routing import SETTLE_CALLS, Router
from swarm.policy.slow_replicas import (
    SLOW_TOLERANCE, completion_times, probe_allowed, standby_verdict, worth_waiting_for,
)
from swarm.policy.snapshot import PeerInfo
import swarm.server.runner as runner_module
import swarm.server.slow_device as slow_device_module
from swarm.server.runner import StageRunner, ThroughputMeter
from swarm.server.slow_device import SlowDeviceRunner, install_slow_device
from swarm.simulate.slow_peer import SlowPeerScenario, run_slow_peer_scenario


def _stage(throughputs, queues=None, stage=0):
    queues = queues or [0] * len(throughputs)
    return [PeerInfo(f"p{i}", stage, "online", float(t), q) for i, (t, q) in enumerate(zip(throughputs, queues))]


# ---- completion times and the routing mask ----

def test_completion_time_counts_the_calls_ahead():
    np.testing.assert_allclose(completion_times([10.0, 10.0, 2.0], [0, 3, 0]), [0.1, 0.4, 0.5])
    # an unmeasured replica counts as the mean of the measured ones; all unmeasured: alike
    np.testing.assert_allclose(completion_times([10.0, 30.0, 0.0], [0, 0, 0]), [0.1, 1 / 30, 0.05])
    np.testing.assert_allclose(completion_times([0.0, 0.0], [1, 0]), [2.0, 1.0])
    with pytest.raises(ValueError):
        completion_times([1.0, math.nan], [0, 0])
    with pytest.raises(ValueError):
        completion_times([1.0], [-1])
    with pytest.raises(ValueError):
        completion_times([1.0, 2.0], [0])


def test_a_50x_slower_replica_is_not_waited_for_until_the_others_back_up():
    assert worth_waiting_for([50.0, 50.0, 1.0], [0, 0, 0]).tolist() == [True, True, False]
    assert worth_waiting_for([50.0, 50.0, 10.0], [0, 0, 0]).tolist() == [True, True, False]  # 5x
    # a 5x slower replica: a call only once it would finish first (stage-mates with 4 calls queued each);
    # being within 2x of stage-mates with 2 queued is not enough for a replica that slow
    assert worth_waiting_for([50.0, 50.0, 10.0], [4, 4, 0]).tolist() == [True, True, True]
    assert worth_waiting_for([50.0, 50.0, 10.0], [2, 2, 0]).tolist() == [True, True, False]
    assert worth_waiting_for([50.0, 50.0, 10.0], [1, 1, 0]).tolist() == [True, True, False]
    # replicas within 2x of each other's speed keep the slack: 1.5x slower, within 2x of the best completion
    assert worth_waiting_for([30.0, 20.0], [0, 0]).tolist() == [True, True]
    assert worth_waiting_for([30.0, 20.0], [1, 0]).tolist() == [True, True]
    # equal replicas: the one with two calls more ahead waits
    assert worth_waiting_for([5.0, 5.0], [0, 2]).tolist() == [True, False]
    assert worth_waiting_for([5.0, 5.0, 0.1], [0, 2, 0], tolerance=math.inf).all()
    assert worth_waiting_for([], []).size == 0
    for bad in (0.5, math.nan):
        with pytest.raises(ValueError):
            worth_waiting_for([1.0], [0], tolerance=bad)


def test_probes_of_an_unmeasured_replica_are_bounded():
    assert probe_allowed(0.0, 0) and not probe_allowed(0.0, 1)
    assert probe_allowed(0.0, 1, max_probes=2) and not probe_allowed(0.0, 2, max_probes=2)
    assert probe_allowed(3.0, 10)


# ---- the router ----

def test_router_leaves_out_the_slow_replica_and_takes_it_back_when_the_others_queue():
    router = Router(seed=0, slow_tolerance=SLOW_TOLERANCE)
    peers = _stage([50.0, 50.0, 1.0])
    shares = {p.peer_id: share for p, share in router.distribution(peers, 0.0)}
    assert shares["p2"] == 0.0 and shares["p0"] == pytest.approx(0.5)
    # other trainers' work queued at the fast replicas (announced): now the slow one finishes sooner
    busy = _stage([50.0, 50.0, 1.0], queues=[60, 60, 0])
    shares = {p.peer_id: share for p, share in router.distribution(busy, 0.0)}
    assert shares["p2"] > 0
    # this trainer's own calls count too
    shares = {p.peer_id: share for p, share in router.distribution(peers, 0.0, in_flight={"p0": 80, "p1": 80})}
    assert shares["p2"] > 0
    # without the policy the slow replica keeps its throughput share
    naive = Router(seed=0)
    shares = {p.peer_id: share for p, share in naive.distribution(peers, 0.0)}
    assert shares["p2"] == pytest.approx(1 / 101)


def test_router_probes_an_unmeasured_replica_once_at_a_time():
    router = Router(seed=1, slow_tolerance=SLOW_TOLERANCE)
    for peer_id in ("p0", "p1"):
        for _ in range(SETTLE_CALLS):
            router.report_success(peer_id, samples=8, elapsed_s=0.1)
    peers = _stage([0.0, 0.0, 0.0])  # nothing announced yet: routed by this trainer's own timing
    draws = Counter(router.choose(peers, 0.0, in_flight={"p2": 1}).peer_id for _ in range(500))
    assert draws["p2"] == 0 and draws["p0"] > 150 and draws["p1"] > 150
    draws = Counter(router.choose(peers, 0.0, in_flight={}).peer_id for _ in range(3000))
    assert draws["p2"] > 500  # free to probe: it gets the mean share, as any new replica
    # one call timed as 50x slower is not yet a verdict: it is still probed, one call at a time
    router.report_success("p2", samples=8, elapsed_s=5.0)
    assert any(router.choose(peers, 0.0, in_flight={}).peer_id == "p2" for _ in range(300))
    assert all(router.choose(peers, 0.0, in_flight={"p2": 1}).peer_id != "p2" for _ in range(300))
    # timed as 50x slower on every settling call: it is left out
    for _ in range(SETTLE_CALLS - 1):
        router.report_success("p2", samples=8, elapsed_s=5.0)
    assert all(router.choose(peers, 0.0, in_flight={}).peer_id != "p2" for _ in range(300))


def test_a_slow_first_call_does_not_shut_a_replica_out():
    """The first call to a fresh replica pays for its lazy initialisation; the calls after it decide."""
    router = Router(seed=3, slow_tolerance=SLOW_TOLERANCE)
    for peer_id in ("p0", "p1"):
        for _ in range(SETTLE_CALLS):
            router.report_success(peer_id, samples=8, elapsed_s=0.1)
    router.report_success("p2", samples=8, elapsed_s=2.0)  # cold
    for _ in range(SETTLE_CALLS - 1):
        router.report_success("p2", samples=8, elapsed_s=0.1)
    shares = {p.peer_id: share for p, share in router.distribution(_stage([0.0, 0.0, 0.0]), 0.0)}
    assert shares["p2"] == pytest.approx(1 / 3, rel=0.2)


def test_router_never_runs_out_of_replicas_by_the_slow_rule():
    router = Router(seed=2, slow_tolerance=SLOW_TOLERANCE)
    peers = _stage([0.0, 0.0])
    # both unmeasured and both already probed: the one with the earliest completion still serves
    assert router.choose(peers, 0.0, in_flight={"p0": 1, "p1": 2}).peer_id == "p0"
    # a preferred replica (the forward's, for its backward) is taken only if it is worth waiting for
    measured = _stage([50.0, 50.0, 1.0])
    assert router.choose(measured, 0.0, prefer="p2").peer_id != "p2"
    assert router.choose(measured, 0.0, prefer="p1").peer_id == "p1"
    with pytest.raises(ValueError):
        Router(slow_tolerance=0.5)
    with pytest.raises(ValueError):
        Router(max_probes=0)


# ---- standing by ----

def test_a_replica_much_slower_than_its_stage_mates_stands_by():
    snapshot = _stage([50.0, 50.0, 1.0]) + _stage([40.0, 40.0], stage=1)
    verdict = standby_verdict("p2", snapshot)
    assert verdict.standby and verdict.slowdown == pytest.approx(50.0)
    assert "standing by on stage 0" in verdict.reason and "50.0x" in verdict.reason
    assert not standby_verdict("p0", snapshot).standby
    # 5x slower, stage-mates idle: stands by; stage-mates with 4 calls queued: it helps, it serves
    assert standby_verdict("p2", _stage([50.0, 50.0, 10.0])).standby
    assert not standby_verdict("p2", _stage([50.0, 50.0, 10.0], queues=[4, 4, 0])).standby


def test_standby_has_hysteresis_and_needs_measurements():
    # 1.67x later than the best stage-mate: within the tolerance (2x) to keep serving, not within
    # the 1.6x a replica standing by must come back to
    snapshot = _stage([50.0, 50.0, 30.0])
    assert not standby_verdict("p2", snapshot, standing_by=False).standby
    assert standby_verdict("p2", snapshot, standing_by=True).standby
    assert not standby_verdict("p2", _stage([50.0, 50.0, 40.0]), standing_by=True).standby  # 1.25x
    assert standby_verdict("p2", _stage([50.0, 50.0, 20.0]), standing_by=False).standby  # 2.5x
    # alone on its stage, unmeasured, or with unmeasured mates: never
    assert not standby_verdict("p0", _stage([1.0])).standby
    assert not standby_verdict("p2", _stage([50.0, 50.0, 0.0])).standby
    assert not standby_verdict("p1", _stage([0.0, 1.0])).standby
    assert not standby_verdict("ghost", _stage([1.0, 2.0])).standby
    leaving = [PeerInfo("p0", 0, "leaving", 50.0), PeerInfo("p1", 0, "online", 1.0)]
    assert not standby_verdict("p1", leaving).standby


# ---- the simulator ----

def test_simulated_slow_peers_cost_nothing_with_the_policy_and_a_lot_without():
    with_policy = run_slow_peer_scenario(SlowPeerScenario())
    naive = run_slow_peer_scenario(SlowPeerScenario(slow_tolerance=math.inf))
    for result in with_policy:
        assert result["throughput_ratio_after_vs_before"] >= 0.98, with_policy
    for result in naive:
        if result["slowdown"] >= 5:
            assert result["throughput_ratio_after_vs_before"] < 0.95, naive
    assert naive[-1]["throughput_ratio_after_vs_before"] < 0.85, naive  # the 50x slower peer: a large loss


def test_the_peer_watch_changes_its_mind_only_past_the_margins():
    from types import SimpleNamespace

    from swarm.server.slow_replicas import StandbyWatch

    watch = StandbyWatch(SimpleNamespace(peer_id="p2"))
    assert watch.decide(_stage([50.0, 50.0, 1.0])).standby and watch.standing_by
    assert watch.decide(_stage([50.0, 50.0, 30.0])).standby  # 1.67x: not back within 1.6x yet
    assert not watch.decide(_stage([50.0, 50.0, 40.0])).standby and not watch.standing_by
    assert not watch.decide(_stage([50.0, 50.0, 30.0])).standby  # serving: 1.67x is within 2x


def test_the_peer_watch_times_the_replica_again_when_stale_or_standing_by():
    """A figure from one busy moment must not keep a replica standing by: standing by, it times itself
    again every ``RETIME_S``; serving, only once its served figure went stale."""
    import time
    from types import SimpleNamespace

    from swarm.server.slow_replicas import RETIME_S, StandbyWatch

    meter = ThroughputMeter(warmup_calls=0)
    watch = StandbyWatch(SimpleNamespace(peer_id="p2", runner=SimpleNamespace(meter=meter)))
    assert watch.retime_due(), "nothing measured yet"
    meter.set("forward_backward", 8, 0.8)
    watch.timed_at = time.monotonic()
    assert not watch.retime_due()
    watch.timed_at -= RETIME_S
    assert not watch.retime_due(), "serving: served calls keep the figure fresh"
    watch.decide(_stage([50.0, 50.0, 1.0]))
    assert watch.standing_by and watch.retime_due()


def test_a_replica_is_measured_by_its_slowest_kind_of_call():
    router = Router(seed=3, slow_tolerance=SLOW_TOLERANCE)
    for _ in range(4):
        router.report_success("p0", samples=8, elapsed_s=0.08, kind="forward")
        router.report_success("p0", samples=8, elapsed_s=0.16, kind="backward")
        router.report_success("p1", samples=8, elapsed_s=0.08, kind="forward")  # quick forwards,
        router.report_success("p1", samples=8, elapsed_s=4.0, kind="backward")  # 25x slower backwards
    assert router.measured_throughput("p0") == pytest.approx(50.0)
    assert router.measured_throughput("p1") == pytest.approx(2.0)
    assert all(router.choose(_stage([0.0, 0.0]), 0.0).peer_id == "p0" for _ in range(200))
    router.forget("p1")
    assert router.measured_throughput("p1") == 0.0


# ---- what a replica announces about itself ----

def test_the_meter_skips_the_cold_first_call_and_forgets_a_stale_measurement():
    """A first call that paid for lazy initialisation must not make a replica look slow, and a replica
    that got no work for ``stale_s`` announces 0 (unknown): a figure nobody refreshes would keep it
    standing by forever; with it gone, the replica times itself anew (``measure_speed``), and that decides."""
    now = [0.0]
    meter = ThroughputMeter(alpha=0.5, warmup_calls=1, stale_s=60.0, clock=lambda: now[0])
    meter.update("backward", 10, 5.0)  # cold: 0.5 s a sample
    assert meter.samples_per_s == 0.0
    meter.update("backward", 10, 0.1)
    assert meter.samples_per_s == pytest.approx(100.0)
    meter.update("backward", 10, 0.3)  # EMA: 0.02 s a sample
    assert meter.samples_per_s == pytest.approx(50.0)
    now[0] = 61.0
    assert meter.samples_per_s == 0.0
    snapshot = [PeerInfo("slow", 0, "online", meter.samples_per_s, 0), *_stage([1000.0, 1000.0])[1:]]
    assert not standby_verdict("slow", snapshot).standby
    meter.update("backward", 10, 0.01)  # afresh, not averaged with the stale figure
    assert meter.samples_per_s == pytest.approx(1000.0)


# ---- a replica's speed before it serves ----

def _runner_state(runner):
    return ([p.detach().clone() for p in runner.params], [g.clone() for g in runner.grad_sum], runner.samples_processed,
            runner.samples_pending, runner.num_forwards, runner.num_recomputed, len(runner.forward_cache),
            runner.digest, runner._entropy)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_replica_times_itself_without_changing_its_state(stage, monkeypatch):
    """Every stage (tokens in, hidden states in, the loss out) times made-up samples into its meter, the
    emulated device delay included, and nothing it serves or averages moves."""
    run = RunConfig(num_stages=3, target_batch_size=64, model=ModelConfig(num_layers=3, hidden_size=32, num_heads=2,
                                                                           seq_len=16))
    runner = SlowDeviceRunner(run, stage, delay_per_sample_s=0.02, forward_cache_bytes=2**20)
    slept = []
    real_sleep = slow_device_module.time.sleep
    monkeypatch.setattr(slow_device_module.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    monkeypatch.setattr(runner_module, "SPEED_TEST_ROUNDS", 2)
    monkeypatch.setattr(runner_module, "SPEED_TEST_BUDGET_S", 60.0)
    before = _runner_state(runner)
    speed = runner.measure_speed(4)
    after = _runner_state(runner)
    assert 0 < speed < 50.0, "0.02 s of emulated delay a sample caps it below 50 samples/s"
    assert slept == [pytest.approx(0.08)] * 2, "the warm-up round costs no delay, each timed round that of 4 samples"
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    assert before[2:] == after[2:]
    assert runner.meter.samples_per_s == speed
    with pytest.raises(ValueError):
        runner.measure_speed(0)


def test_a_replica_announcing_itself_slow_is_never_probed():
    """Its own timing, announced before it serves, is enough: trainers that timed its stage-mates leave
    it out without sending it a micro-batch to time, until those stage-mates back up."""
    router = Router(seed=4, slow_tolerance=SLOW_TOLERANCE)
    for peer_id in ("p0", "p1"):
        for _ in range(SETTLE_CALLS):
            router.report_success(peer_id, samples=8, elapsed_s=0.1)
    announced = _stage([90.0, 90.0, 1.8])  # p2 timed itself 50x slower
    assert all(router.choose(announced, 0.0, in_flight={}).peer_id != "p2" for _ in range(500))
    unknown = _stage([90.0, 90.0, 0.0])  # it announced nothing: it is probed
    assert any(router.choose(unknown, 0.0, in_flight={}).peer_id == "p2" for _ in range(500))
    backed_up = _stage([90.0, 90.0, 1.8], queues=[80, 80, 0])
    assert any(router.choose(backed_up, 0.0, in_flight={}).peer_id == "p2" for _ in range(500))


def test_the_fastest_timed_round_sets_the_speed_and_a_slow_device_times_one_round(monkeypatch):
    """Noise (a busy machine) only slows a round down, so the fastest one counts, and it replaces what the
    meter held; a device so slow that one round takes the whole budget is timed once."""
    run = RunConfig(num_stages=2, target_batch_size=64, model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2,
                                                                           seq_len=16))
    runner = StageRunner(run, 1)
    runner.meter.update("forward_backward", 4, 1.0)
    runner.meter.update("forward_backward", 4, 40.0)  # a served figure: 0.1 samples/s
    rounds = iter([{"forward_backward": 0.9}, {"forward_backward": 0.2}, {"forward_backward": 0.5}])
    monkeypatch.setattr(runner, "_speed_round", lambda inputs, targets, timed: next(rounds) if timed else {})
    monkeypatch.setattr(runner_module, "SPEED_TEST_BUDGET_S", 60.0)
    monkeypatch.setattr(runner_module, "SPEED_TEST_ROUNDS", 3)
    assert runner.measure_speed(4) == pytest.approx(20.0)
    calls = []
    monkeypatch.setattr(runner, "_speed_round", lambda inputs, targets, timed: calls.append(timed) or {"forward_backward": 90.0})
    monkeypatch.setattr(runner_module, "SPEED_TEST_BUDGET_S", 60.0)
    assert runner.measure_speed(4) == pytest.approx(4 / 90.0)
    assert calls == [False, True], "one warm-up round, then one timed round past the budget"


def test_a_slow_device_is_installed_from_outside_and_sleeps_per_sample_of_backward_work(monkeypatch):
    """``--delay_per_sample_s`` makes the peer build slow runners; the runner itself has no emulation in it."""
    from types import SimpleNamespace

    run = RunConfig(num_stages=2, target_batch_size=64, model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2,
                                                                           seq_len=16))
    peer = SimpleNamespace(runner_class=StageRunner)
    install_slow_device(peer, 0.01)
    runner = peer.runner_class(run, 1, "cpu", forward_cache_bytes=2**20)
    assert isinstance(runner, SlowDeviceRunner) and runner.delay_per_sample_s == 0.01
    slept = []
    monkeypatch.setattr(slow_device_module.time, "sleep", slept.append)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(4, 16, 32, generator=generator), torch.randint(0, 256, (4, 16), generator=generator)
    runner.backward("t:m0", inputs, None, targets)
    assert slept == [pytest.approx(0.04)], "0.01 s for each of the 4 samples"
    StageRunner(run, 1).backward("t:m0", inputs, None, targets)
    assert slept == [pytest.approx(0.04)], "a plain runner does not sleep"
    with pytest.raises(ValueError, match="delay_per_sample_s"):
        install_slow_device(peer, -1.0)


def test_a_failed_speed_test_leaves_the_replica_serving_with_no_speed_announced():
    import asyncio
    from types import SimpleNamespace

    from swarm.server.slow_replicas import StandbyWatch

    async def compute(fn, *args):
        raise RuntimeError("out of memory")

    peer = SimpleNamespace(peer_id="p0", stage=0, config=SimpleNamespace(speed_test_samples=8),
                           runner=SimpleNamespace(measure_speed=None), compute=compute)
    watch = StandbyWatch(peer)
    assert asyncio.run(watch.measure_speed()) == 0.0
    assert watch.timed_at > 0, "not tried again before RETIME_S"
