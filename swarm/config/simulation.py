"""Configuration of a simulated swarm: hardware, network, trainers, churn, rebalancing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from swarm.policy.rebalance import RebalanceConfig

__all__ = ["SimConfig", "StepSimConfig", "DEFAULT_SIM_REBALANCE", "JOIN_POLICY_NAMES"]

JOIN_POLICY_NAMES = ("auto", "random")  # see static_join_policy

# A simulated swarm of 1,000 peers has ~125 per stage, so one move changes a stage by <1%:
# the live default min_gain (5%) forbids every move (0 moves in 24 simulated hours with
# --min_gain 0.05). 0.1% still prevents flapping: every accepted move strictly improves the
# sorted stage capacities.
DEFAULT_SIM_REBALANCE = RebalanceConfig(period_s=300.0, period_jitter=0.2, min_gain=0.001, max_movers_per_period=1)


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")


@dataclass(frozen=True)
class StepSimConfig:
    """The global-step protocol in the simulator (:mod:`swarm.simulate.stepping`); defaults follow the live peer."""

    enabled: bool = True  # run the step protocol (in the rebalanced run)
    target_batch_size: int = 4096  # samples per global step, summed over the clock stage's replicas
    poll_period_s: float = 0.25  # seconds between a replica's checks near the target (live poll_period_s)
    announce_period_s: float = 1.0  # seconds between checks (and announcements) far from the target
    idle_check_period_s: float = 60.0  # most seconds between two checks of a stage
    matchmaking_time_s: float = 2.0  # seconds replicas wait to form an all-reduce group; a failed round costs 3x
    stage_param_mib: float = 100.0  # MiB of gradients a replica averages (it sends and receives ~2x this)
    max_failed_rounds: int = 2  # rounds without a group before a replica applies a step alone (live value)
    distrust_s: float = 120.0  # seconds claims are ignored after a proven lie; the cap for failures (live value)
    resync_time_s: float = 60.0  # seconds a replica spends downloading the stage's state when out of sync
    stalled_peers: Tuple[str, ...] = ()  # peers that announce themselves online but never average (frozen replicas)
    overlap_averaging: bool = (
        False  # replicas accumulate the next step while a step is averaged (live --overlap_averaging)
    )

    def __post_init__(self) -> None:
        for name in ("target_batch_size", "max_failed_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"steps.{name} must be an int >= 1, got {value!r}")
        for name in ("poll_period_s", "announce_period_s", "idle_check_period_s", "matchmaking_time_s", "distrust_s"):
            _positive(f"steps.{name}", getattr(self, name))
        for name in ("stage_param_mib", "resync_time_s"):
            _positive(f"steps.{name}", getattr(self, name), allow_zero=True)
        if not isinstance(self.overlap_averaging, bool):
            raise ValueError(f"steps.overlap_averaging must be true or false, got {self.overlap_averaging!r}")
        if not all(isinstance(p, str) and p for p in self.stalled_peers):
            raise ValueError(f"steps.stalled_peers must be peer ids, got {self.stalled_peers!r}")


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation run depends on; two runs with the same config are identical."""

    num_peers: int = 1000  # peers at start; joins keep the mean population there
    num_stages: int = 8  # pipeline stages
    hours: float = 24.0  # simulated duration
    seed: int = 0  # seeds hardware draws, churn, routing and decision jitter
    throughput_choices: Tuple[float, ...] = (1.0, 2.2, 5.0)  # samples/s of compute per GPU class
    throughput_weights: Tuple[float, ...] = (0.5, 0.35, 0.15)  # share of each class among peers
    throughput_jitter: float = 0.1  # lognormal sigma of per-instance variation
    throughput_list: Tuple[float, ...] = ()  # explicit compute throughputs, cycled (overrides the above)
    throughput_quantum: float = 0.01  # samples/s; throughputs are integer multiples (exact optimum)
    bandwidth_mbps_median: float = 300.0  # per-peer access bandwidth, lognormal median, Mbit/s
    bandwidth_sigma: float = 0.5  # lognormal sigma of bandwidth
    latency_ms_range: Tuple[float, float] = (10.0, 150.0)  # per-peer access latency, uniform, ms
    activation_mib_per_sample: float = 1.0  # activations (and their gradients) per sample per hop, MiB
    num_trainers: int = 128
    max_inflight_per_trainer: int = 16  # micro-batches each trainer keeps in flight
    microbatch_size: int = 4  # samples per micro-batch
    mean_lifetime_h: float = 4.0  # mean time until a peer is preempted (exponential)
    join_rate_per_h: Optional[float] = None  # new peers per hour; None = num_peers / mean_lifetime_h
    crash_fraction: float = 0.3  # share of preemptions without notice (SIGKILL-like)
    notice_s: float = 30.0  # preemption notice: peer is "leaving" for this long, then gone
    join_time_s: float = 120.0  # a new peer downloads its stage's state before serving
    move_time_s: float = 60.0  # a moving peer downloads the new stage's state before serving
    measure_s: float = 60.0  # until a new peer announces a measured throughput
    request_timeout_s: float = 15.0  # trainers detect a crashed peer after this long
    dht_expiration_s: float = 60.0  # a crashed peer's record lingers this long
    snapshot_refresh_s: float = 30.0  # peers re-read the DHT for rebalancing at most this often
    sample_period_s: float = 300.0  # resolution of the reported time series
    trace_path: Optional[str] = None  # churn trace file (CSV) instead of generated churn
    rebalance: RebalanceConfig = field(default_factory=lambda: DEFAULT_SIM_REBALANCE)
    # How peers joining the baseline run (no rebalancing) choose a stage: "random" =
    # uniformly, with no load awareness (the SWARM paper's no-rebalancing baseline, so churn
    # unbalances the stages over time); "auto" = the live --stage auto policy, which alone
    # keeps a large swarm nearly balanced. The rebalanced run always joins with "auto".
    static_join_policy: str = "random"
    steps: StepSimConfig = field(default_factory=StepSimConfig)
    # trainers route only to replicas whose expected completion is within this multiple of the stage's best
    # (swarm.policy.slow_replicas; the fluid model has no queues, so this leaves out slower replicas
    # outright); inf = throughput-proportional routing alone
    slow_replica_tolerance: float = math.inf

    def __post_init__(self) -> None:
        if not self.slow_replica_tolerance >= 1.0:
            raise ValueError(f"slow_replica_tolerance must be >= 1, got {self.slow_replica_tolerance!r}")
        for name in ("num_peers", "num_stages", "num_trainers", "max_inflight_per_trainer", "microbatch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in (
            "hours",
            "throughput_quantum",
            "bandwidth_mbps_median",
            "activation_mib_per_sample",
            "mean_lifetime_h",
            "request_timeout_s",
            "snapshot_refresh_s",
            "dht_expiration_s",
            "sample_period_s",
        ):
            _positive(name, getattr(self, name))
        for name in ("throughput_jitter", "bandwidth_sigma", "notice_s", "join_time_s", "move_time_s", "measure_s"):
            _positive(name, getattr(self, name), allow_zero=True)
        if self.join_rate_per_h is not None:
            _positive("join_rate_per_h", self.join_rate_per_h, allow_zero=True)
        if not 0.0 <= self.crash_fraction <= 1.0:
            raise ValueError(f"crash_fraction must be in [0, 1], got {self.crash_fraction!r}")
        if not self.throughput_list:
            if not self.throughput_choices or len(self.throughput_choices) != len(self.throughput_weights):
                raise ValueError("throughput_choices and throughput_weights must be non-empty and of equal length")
            for value in self.throughput_choices:
                _positive("throughput_choices", value)
            if any(w < 0 for w in self.throughput_weights) or sum(self.throughput_weights) <= 0:
                raise ValueError("throughput_weights must be >= 0 with a positive sum")
        for value in self.throughput_list:
            _positive("throughput_list", value)
        low, high = self.latency_ms_range
        if not (0 <= low <= high and math.isfinite(high)):
            raise ValueError(
                f"latency_ms_range must be (low, high) with 0 <= low <= high, got {self.latency_ms_range!r}"
            )
        if self.static_join_policy not in JOIN_POLICY_NAMES:
            raise ValueError(f"static_join_policy must be one of {JOIN_POLICY_NAMES}, got {self.static_join_policy!r}")
        if not isinstance(self.rebalance, RebalanceConfig):
            raise ValueError("rebalance must be a RebalanceConfig")
        if not isinstance(self.steps, StepSimConfig):
            raise ValueError("steps must be a StepSimConfig")

    @property
    def duration_s(self) -> float:
        return self.hours * 3600.0

    @property
    def effective_join_rate_per_h(self) -> float:
        """Joins per hour; by default the rate that keeps the population steady under preemption."""
        if self.join_rate_per_h is not None:
            return self.join_rate_per_h
        return self.num_peers / self.mean_lifetime_h
