"""The DHT traffic model: what grows with the swarm, the largest message, calibration."""

import math

import pytest

from swarm.policy.directory import SHARD_CAPACITY
from swarm.simulate.dht_traffic import MESSAGE_CAP_BYTES, TrafficModel, calibrate, per_peer_bytes_per_s, shard_value_bytes


def test_the_largest_message_is_one_shard_far_below_the_cap_at_ten_thousand_peers():
    model = TrafficModel(record_bytes=2048.0, num_stages=2)
    assert shard_value_bytes(model, 8) == 4 * 2048.0  # a small stage: one key, every replica
    assert shard_value_bytes(model, 16) == 4 * 2048.0  # 8 replicas a stage: two shards of 4
    for peers in (1000, 10_000):
        assert shard_value_bytes(model, peers) <= 2 * SHARD_CAPACITY * 2048.0
    assert shard_value_bytes(model, 10_000) < MESSAGE_CAP_BYTES / 50


def test_per_peer_traffic_grows_at_most_logarithmically():
    model = TrafficModel(record_bytes=1500.0, num_stages=2)
    sizes = [16, 64, 256, 1000, 10_000]
    rates = [per_peer_bytes_per_s(model, n)["total"] for n in sizes]
    for (small, low), (large, high) in zip(zip(sizes, rates), zip(sizes[1:], rates[1:])):
        assert high / low <= math.log2(large) / math.log2(small) * 1.05, (small, large, low, high)
    parts = per_peer_bytes_per_s(model, 1000)
    assert parts["total"] == pytest.approx(parts["store"] + parts["read"] + parts["probe"])


def test_calibration_recovers_the_overhead():
    truth = TrafficModel(record_bytes=900.0, num_stages=4, overhead=2.5)
    measured = [(n, per_peer_bytes_per_s(truth, n)["total"]) for n in (16, 64)]
    fitted = calibrate(TrafficModel(record_bytes=900.0, num_stages=4), measured)
    assert fitted.overhead == pytest.approx(2.5, rel=1e-6)
    with pytest.raises(ValueError):
        TrafficModel(record_bytes=0.0, num_stages=4)


def test_progress_calls_are_bounded_per_replica_whatever_the_stage_size():
    from swarm.simulate.dht_traffic import ProgressModel, progress_bytes_per_s

    model = ProgressModel(exchange_bytes=700.0)
    small = progress_bytes_per_s(model, 16, 2)["peer"]
    assert progress_bytes_per_s(model, 10_000, 8)["peer"] == pytest.approx(
        progress_bytes_per_s(model, 1_000, 8)["peer"], rel=0.05), "asks are capped, not one per stage-mate"
    assert small < progress_bytes_per_s(model, 1_000, 8)["peer"]  # 7 mates against the cap of 8 (and watchers)
    # longer steps: the near window is a smaller share of the time
    assert progress_bytes_per_s(ProgressModel(exchange_bytes=700.0, step_s=120.0), 1_000, 8)["peer"] < (
        progress_bytes_per_s(model, 1_000, 8)["peer"])
    # the clock's replicas are asked by every other stage's watchers: more when stages are many and small
    many = progress_bytes_per_s(model, 1_000, 64)
    assert many["clock_peer"] > many["peer"]
    # ... but they ask it less often as stages grow (clock_watch_period_s), and a trainer's hint makes only the
    # watchers ask (once per step): a clock replica stays near the others
    assert many["clock_peer"] < 1.5 * many["peer"]


def test_a_peer_that_reads_two_stages_costs_less_than_one_that_reads_them_all():
    from swarm.simulate.dht_traffic import TrafficModel, per_peer_bytes_per_s, trainer_bytes_per_s

    every = TrafficModel(record_bytes=1200, num_stages=64, announce_period_s=30.0, read_period_s=30.0)
    two = TrafficModel(record_bytes=1200, num_stages=64, announce_period_s=30.0, read_period_s=30.0, stages_read=2)
    assert per_peer_bytes_per_s(two, 1_000)["total"] < per_peer_bytes_per_s(every, 1_000)["total"] / 10
    # a trainer that reads every stage every refresh: its bytes grow with the number of stages
    assert trainer_bytes_per_s(every, 1_000, 30.0, 400.0) > 6 * trainer_bytes_per_s(
        TrafficModel(record_bytes=1200, num_stages=8, announce_period_s=30.0, read_period_s=30.0), 1_000, 30.0, 400.0)


def test_a_trainer_that_reads_a_few_stages_a_refresh_costs_alike_at_8_and_64_stages():
    from swarm.dht.directory import probe_period_for
    from swarm.simulate.dht_traffic import TrafficModel, trainer_bytes_per_s

    def trainer(num_stages: int, per_refresh=None) -> float:
        model = TrafficModel(record_bytes=1200, num_stages=num_stages, announce_period_s=60.0, read_period_s=60.0)
        cycle_s = 60.0 * math.ceil(num_stages / (per_refresh or num_stages))
        return trainer_bytes_per_s(model, 1_000, 60.0, 400.0, per_refresh, probe_period_for(cycle_s))

    assert trainer(64) > 6 * trainer(8), "reading every stage, a trainer's traffic grows with the stages"
    assert trainer(64, 8) < 1.2 * trainer(8, 8) and trainer(8, 8) == trainer(8)
