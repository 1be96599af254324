"""The iteration-time cost model of Yuan et al. (NeurIPS 2022), plus two extensions.

Paper (exactly, when every device is used, groups are equal and speeds are unknown):
- DP cost of a group g of D members: max over members i of sum over other members j of
  2 * (A_ij + c_dp / (B_ij * D)); the allocation's DP cost is the max over groups.
- Pipeline edge between groups g and h: bottleneck assignment of their members over link
  costs A_ij + c_pp / B_ij (see ``matching``); the pipeline cost is the cheapest open path
  through all groups (see ``path``).
- Total = DP + 2 * pipeline (activations forward, their gradients backward).

Extensions (ours):
- Compute: with per-device speeds, a stage also takes its slowest member's compute time
  (stage work / D / speed), and a stage's all-reduce starts when its compute ends, so the
  stage term becomes max over groups of (compute_g + DP_g).
- Unequal groups / unused devices: a group of D_g members uses D_g in its DP term; the
  activations of the whole batch (c_pp * nominal D bytes) are cut into max(D_g, D_h)
  chunks and a member of the smaller group carries up to ceil(max / min) of them.
Pipeline links use the slower direction of each pair, since both activations (forward) and
their gradients (backward) cross it; for symmetric networks this is the paper's cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from swarm.planner.matching import bottleneck_value, chunks_per_member
from swarm.planner.network import Network
from swarm.planner.path import cheapest_path, path_cost
from swarm.planner.workload import Workload

__all__ = ["Allocation", "CostBreakdown", "CostModel"]

Groups = Sequence[Sequence[int]]


@dataclass(frozen=True)
class Allocation:
    """Which devices serve which stage: ``stages[k]`` serves the k-th slice of layers."""

    stages: tuple[tuple[int, ...], ...]
    unused: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stages or any(len(group) == 0 for group in self.stages):
            raise ValueError("stages must be a non-empty list of non-empty device groups")
        seen = [d for group in self.stages for d in group] + list(self.unused)
        if len(set(seen)) != len(seen):
            raise ValueError("stages and unused must not share or repeat devices")


@dataclass(frozen=True)
class CostBreakdown:
    """Seconds per iteration of one allocation, split the way the paper reports it."""

    total_s: float  # stage_s + 2 * pipeline_s
    dp_s: float  # slowest group's gradient all-reduce
    pipeline_s: float  # one pass of activations through the cheapest stage order
    compute_s: float  # slowest group's compute (0 when device speeds are unknown)
    stage_s: float  # max over groups of compute + all-reduce (= dp_s without speeds)
    allocation: Allocation  # stages listed in pipeline order


class CostModel:
    """Precomputed per-pair terms for one network and workload; evaluates groupings fast."""

    def __init__(self, network: Network, workload: Workload) -> None:
        n, s = network.num_devices, workload.num_stages
        if n < s:
            raise ValueError(f"network has {n} devices, fewer than num_stages ({s})")
        self.network, self.workload = network, workload
        self.num_devices, self.num_stages = n, s
        self.nominal_replicas = n // s
        latency, inv_bw = network.latency_s, 1.0 / network.bandwidth_bytes_per_s
        self.dp_latency = 2.0 * latency
        self.dp_transfer = 2.0 * workload.stage_dp_bytes() * inv_bw
        self.pp_latency = np.maximum(latency, latency.T)
        self.pp_inv_bw = np.maximum(inv_bw, inv_bw.T)
        replica_bytes = workload.replica_pp_bytes(self.nominal_replicas)
        self.pp_batch_bytes = replica_bytes * self.nominal_replicas
        self.pp_link = self.pp_latency + replica_bytes * self.pp_inv_bw
        self.stage_flops = workload.stage_flops()
        speed = network.compute_tflops
        self.seconds_per_flop = None if speed is None else 1.0 / (speed * 1e12)

    def group_dp_s(self, members: Sequence[int]) -> float:
        """All-reduce time of one group: its slowest member's summed exchanges."""
        idx = np.asarray(members)
        if idx.size <= 1:
            return 0.0
        per_member = self.dp_latency[np.ix_(idx, idx)].sum(1) + self.dp_transfer[np.ix_(idx, idx)].sum(1) / idx.size
        return float(per_member.max())

    def group_compute_s(self, members: Sequence[int]) -> float:
        """Compute time of one group: its slowest member on its share of the batch."""
        if self.seconds_per_flop is None:
            return 0.0
        idx = np.asarray(members)
        return float(self.seconds_per_flop[idx].max() * self.stage_flops / idx.size)

    def edge_s(self, group_a: Sequence[int], group_b: Sequence[int]) -> float:
        """Pipeline time between two groups: bottleneck over their matched links."""
        a, b = np.asarray(group_a), np.asarray(group_b)
        if a.size == b.size == self.nominal_replicas:
            return bottleneck_value(self.pp_link[np.ix_(a, b)])
        chunk = self.pp_batch_bytes / max(a.size, b.size)
        per_link = chunks_per_member(a.size, b.size) * chunk
        cost = self.pp_latency[np.ix_(a, b)] + per_link * self.pp_inv_bw[np.ix_(a, b)]
        return bottleneck_value(cost)

    def edge_matrix(self, groups: Groups) -> np.ndarray:
        """Symmetric matrix of pipeline times between every pair of groups."""
        count = len(groups)
        weights = np.zeros((count, count))
        for x in range(count):
            for y in range(x + 1, count):
                weights[x, y] = weights[y, x] = self.edge_s(groups[x], groups[y])
        return weights

    def total_s(self, groups: Groups) -> float:
        """Iteration time of a grouping (the pipeline order is chosen optimally)."""
        stage = max(self.group_dp_s(g) + self.group_compute_s(g) for g in groups)
        return stage + 2.0 * path_cost(self.edge_matrix(groups))

    def evaluate(self, groups: Groups, unused: Sequence[int] = ()) -> CostBreakdown:
        """Full breakdown of a grouping, with its groups put in the cheapest pipeline order."""
        dp = [self.group_dp_s(g) for g in groups]
        compute = [self.group_compute_s(g) for g in groups]
        pipeline_s, order = cheapest_path(self.edge_matrix(groups))
        stage_s = max(d + c for d, c in zip(dp, compute))
        allocation = Allocation(
            stages=tuple(tuple(sorted(int(d) for d in groups[k])) for k in order),
            unused=tuple(sorted(int(d) for d in unused)),
        )
        return CostBreakdown(
            total_s=stage_s + 2.0 * pipeline_s,
            dp_s=max(dp),
            pipeline_s=pipeline_s,
            compute_s=max(compute),
            stage_s=stage_s,
            allocation=allocation,
        )
