"""Peer hardware and the network: what a peer can serve, and what trainers can keep in flight.

Model (documented simplifications): each peer has a compute throughput (samples/s for
forward+backward), an access bandwidth and an access latency; a micro-batch entering a peer
pays that peer's access latency on the way in and out, forward and backward. A peer serving x
samples/s moves 4 activation-sized tensors per sample (inputs and outputs, forward and backward), so
its bandwidth caps it at bw / (4 * activation size).
Its *effective* throughput is the smaller of the two, rounded to the throughput quantum;
this is what it measures, announces, and what the optimum assigns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from swarm.config.simulation import SimConfig

__all__ = ["Hardware", "draw_hardware", "effective_units", "trainer_cap", "hop_time_s"]

_MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class Hardware:
    """One peer's machine."""

    compute: float  # samples/s, forward + backward
    bandwidth_mbps: float  # access bandwidth, Mbit/s
    latency_s: float  # access latency, one way, seconds


def draw_hardware(config: SimConfig, rng: np.random.Generator, index: int) -> Hardware:
    """A peer's machine: compute from the list (cycled) or the class mixture with jitter."""
    if config.throughput_list:
        compute = float(config.throughput_list[index % len(config.throughput_list)])
    else:
        weights = np.asarray(config.throughput_weights, dtype=float)
        klass = rng.choice(len(weights), p=weights / weights.sum())
        compute = (
            float(config.throughput_choices[klass] * rng.lognormal(0.0, config.throughput_jitter))
            if config.throughput_jitter > 0
            else float(config.throughput_choices[klass])
        )
    bandwidth = (
        float(config.bandwidth_mbps_median * rng.lognormal(0.0, config.bandwidth_sigma))
        if config.bandwidth_sigma > 0
        else config.bandwidth_mbps_median
    )
    low_ms, high_ms = config.latency_ms_range
    return Hardware(compute, bandwidth, float(rng.uniform(low_ms, high_ms)) / 1000.0)


def effective_units(hardware: Hardware, config: SimConfig) -> int:
    """Effective throughput in integer quanta: min(compute, bandwidth-bound rate), at least one quantum."""
    bytes_per_s = hardware.bandwidth_mbps * 1e6 / 8.0
    network_bound = bytes_per_s / (4.0 * config.activation_mib_per_sample * _MIB)
    return max(1, int(round(min(hardware.compute, network_bound) / config.throughput_quantum)))


def hop_time_s(hardware: Hardware, throughput: float, config: SimConfig) -> float:
    """Seconds a micro-batch spends at one peer: compute + two latencies + transfers, fwd and bwd."""
    bits = config.microbatch_size * config.activation_mib_per_sample * _MIB * 8.0
    transfer_s = bits / (hardware.bandwidth_mbps * 1e6)
    return config.microbatch_size / throughput + 2.0 * hardware.latency_s + 2.0 * transfer_s


def trainer_cap(expected_hop_times_s: Sequence[float], config: SimConfig) -> Tuple[float, float]:
    """Little's law: trainers keeping M micro-batches in flight over a round trip R reach M*B/R samples/s.

    Queueing is not included in R: when trainers are the limit, peers are not saturated.
    Returns (cap in samples/s, round trip in seconds).
    """
    round_trip_s = float(sum(expected_hop_times_s))
    in_flight = config.num_trainers * config.max_inflight_per_trainer * config.microbatch_size
    return (in_flight / round_trip_s if round_trip_s > 0 else float("inf")), round_trip_s
