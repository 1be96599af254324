"""The DHT traffic model: what grows with the swarm, the largest message, calibration."""

import math

import pytest

from swarm.simulate.dht_traffic import MESSAGE_CAP_BYTES, TrafficModel, calibrate, per_peer_bytes_per_s, stage_value_bytes


def test_stage_value_holds_every_replica_record():
    model = TrafficModel(record_bytes=1000.0, num_stages=8)
    assert stage_value_bytes(model, 16) == 2 * 1000.0
    assert stage_value_bytes(model, 10_000) == 1250 * 1000.0
    assert stage_value_bytes(model, 10_000) < MESSAGE_CAP_BYTES  # 8 stages: one stage's value fits
    assert stage_value_bytes(TrafficModel(record_bytes=1000.0, num_stages=2), 10_000) > MESSAGE_CAP_BYTES


def test_reads_of_every_stage_grow_linearly_and_stores_logarithmically():
    model = TrafficModel(record_bytes=1000.0, num_stages=8)
    small, large = per_peer_bytes_per_s(model, 1000), per_peer_bytes_per_s(model, 10_000)
    assert large["store"] / small["store"] < math.log2(10_000) / math.log2(1000) + 0.01
    assert large["read"] / small["read"] == pytest.approx(10.0, rel=0.05)
    assert large["total"] == pytest.approx(large["store"] + large["read"])


def test_calibration_recovers_the_overhead():
    truth = TrafficModel(record_bytes=900.0, num_stages=4, overhead=2.5)
    measured = [(n, per_peer_bytes_per_s(truth, n)["total"]) for n in (16, 64)]
    fitted = calibrate(TrafficModel(record_bytes=900.0, num_stages=4), measured)
    assert fitted.overhead == pytest.approx(2.5, rel=1e-6)
    with pytest.raises(ValueError):
        TrafficModel(record_bytes=0.0, num_stages=4)
