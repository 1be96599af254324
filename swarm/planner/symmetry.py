"""Interchangeable devices: price allocations as counts per device type, not device lists.

In every scenario of the paper, devices of one site are indistinguishable: each has the same
links to every other device. Swapping two such "twins" never changes the cost, so an
equal-size allocation is fully described by a count matrix X (groups x types), X[g, t] =
how many devices of type t serve stage g. The search space shrinks by orders of magnitude
(world-wide: 64!/(8!^8) device partitions collapse to 8 x 8 count matrices with fixed row
and column sums), swaps of twins -- pure no-ops that flatten the landscape -- disappear, and
lower bounds can enumerate every possible group composition.

Twins are found from the cost model itself (all-reduce, pipeline and compute terms), so the
reduction is exact for any network: a network without twins has one type per device and the
count model is the device model. Types with a single device still work (their intra-type
link is never used).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations
from typing import Sequence

import numpy as np

from swarm.planner.cost import CostModel

__all__ = ["TypedCost", "device_types", "counts_to_groups", "groups_to_counts"]


def _device_terms(model: CostModel) -> list[np.ndarray]:
    matrices = [model.dp_latency, model.dp_transfer, model.pp_link]
    return [np.where(np.isfinite(m), m, 0.0) for m in matrices]


def _twins(matrices: list[np.ndarray], speed: np.ndarray | None, i: int, j: int) -> bool:
    """Whether swapping devices i and j leaves every cost term unchanged."""
    if speed is not None and speed[i] != speed[j]:
        return False
    keep = np.ones(matrices[0].shape[0], dtype=bool)
    keep[[i, j]] = False
    for m in matrices:
        if not (
            np.array_equal(m[i, keep], m[j, keep]) and np.array_equal(m[keep, i], m[keep, j]) and m[i, j] == m[j, i]
        ):
            return False
    return True


def device_types(model: CostModel) -> np.ndarray:
    """Type label (0..T-1) of each device; equal labels are twins (an equivalence relation)."""
    n = model.num_devices
    matrices, speed = _device_terms(model), model.seconds_per_flop
    labels = np.full(n, -1)
    count = 0
    for i in range(n):
        if labels[i] >= 0:
            continue
        labels[i] = count
        for j in range(i + 1, n):
            if labels[j] < 0 and _twins(matrices, speed, i, j):
                labels[j] = count
        count += 1
    return labels


@lru_cache(maxsize=None)
def _subsets(size: int) -> np.ndarray:
    """All non-empty subsets of ``size`` items as a 0/1 (2^size - 1, size) matrix."""
    masks = np.arange(1, 1 << size)
    return ((masks[:, None] >> np.arange(size)) & 1).astype(np.int64)


class TypedCost:
    """Cost of count rows and count matrices for one cost model (the paper's equal groups).

    Row costs and row-to-row pipeline edges are cached: a search revisits the same few
    thousand group compositions over and over.
    """

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.labels = device_types(model)
        self.num_types = int(self.labels.max()) + 1
        self.type_sizes = np.bincount(self.labels, minlength=self.num_types)
        self.size = model.nominal_replicas
        self.num_groups = model.num_stages
        reps = [int(np.flatnonzero(self.labels == t)[0]) for t in range(self.num_types)]
        partner = [int(np.flatnonzero(self.labels == t)[-1]) for t in range(self.num_types)]
        t_count = self.num_types
        self.member_pair = np.zeros((t_count, t_count))  # all-reduce term of one (t, u) pair
        self.link = np.zeros((t_count, t_count))  # pipeline link cost between a t and a u device
        pair_dp = model.dp_latency + model.dp_transfer / self.size
        for t in range(t_count):
            for u in range(t_count):
                j = partner[u] if t == u else reps[u]
                if t == u and self.type_sizes[t] == 1:
                    self.member_pair[t, u], self.link[t, u] = 0.0, np.inf
                else:
                    self.member_pair[t, u], self.link[t, u] = pair_dp[reps[t], j], model.pp_link[reps[t], j]
        spf = model.seconds_per_flop
        self.compute = (
            np.zeros(t_count) if spf is None else np.array([spf[r] * model.stage_flops / self.size for r in reps])
        )
        self._stage_cache: dict[bytes, float] = {}
        self._edge_cache: dict[tuple[bytes, bytes], float] = {}

    def row_stage_s(self, row: np.ndarray) -> float:
        """All-reduce (+ compute) time of a group with ``row[t]`` devices of each type t."""
        key = row.tobytes()
        value = self._stage_cache.get(key)
        if value is None:
            present = row > 0
            members = self.member_pair[present] @ row - self.member_pair[present, present]
            value = float((members + self.compute[present]).max())
            self._stage_cache[key] = value
        return value

    def row_edge_s(self, first: np.ndarray, second: np.ndarray) -> float:
        """Bottleneck pipeline time between two groups given as count rows (see ``_bottleneck``)."""
        a, b = first.tobytes(), second.tobytes()
        key = (a, b) if a <= b else (b, a)
        value = self._edge_cache.get(key)
        if value is None:
            value = self._bottleneck(first, second)
            self._edge_cache[key] = value
        return value

    def _bottleneck(self, first: np.ndarray, second: np.ndarray) -> float:
        """Smallest threshold whose links admit a transportation plan from ``first`` to ``second``.

        Hall's condition on types: every set U of the first group's types must reach, through
        links at or below the threshold, at least as many devices of the second as U holds.
        """
        sx, sy = first.nonzero()[0], second.nonzero()[0]
        cost = self.link[sx[:, None], sy[None, :]]
        subsets = _subsets(len(sx))
        need, have = subsets @ first[sx], second[sy]

        def feasible(limit: float) -> bool:
            return bool((((subsets @ (cost <= limit)) > 0) @ have >= need).all())

        # The "everyone has some link" bound is usually the answer; else bisect above it.
        lower = max(cost.min(1).max(), cost.min(0).max())
        if feasible(lower):
            return float(lower)
        limits = np.unique(cost[cost > lower])
        lo, hi = 0, len(limits) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(limits[mid]):
                hi = mid
            else:
                lo = mid + 1
        return float(limits[lo])

    def edge_matrix(self, counts: np.ndarray) -> np.ndarray:
        s = counts.shape[0]
        weights = np.zeros((s, s))
        for g, h in combinations(range(s), 2):
            weights[g, h] = weights[h, g] = self.row_edge_s(counts[g], counts[h])
        return weights


def groups_to_counts(labels: np.ndarray, num_types: int, groups: np.ndarray) -> np.ndarray:
    """Count matrix of device groups: row g counts the types of ``groups[g]``."""
    counts = np.zeros((len(groups), num_types), dtype=np.int64)
    for g, members in enumerate(groups):
        np.add.at(counts[g], labels[np.asarray(members, dtype=np.int64)], 1)
    return counts


def counts_to_groups(labels: np.ndarray, counts: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """Concrete device groups for a count matrix (any twins will do), and the devices left over."""
    free = {t: list(np.flatnonzero(labels == t)) for t in range(counts.shape[1])}
    groups: list[list[int]] = []
    for row in counts:
        members: list[int] = []
        for t, k in enumerate(row):
            members += [int(d) for d in free[t][:k]]
            free[t] = free[t][k:]
        groups.append(members)
    unused = sorted(int(d) for rest in free.values() for d in rest)
    return groups, unused


def validate_counts(counts: np.ndarray, type_sizes: Sequence[int], size: int) -> None:
    """Raise ValueError unless every row holds ``size`` devices within the type sizes."""
    if (counts < 0).any() or (counts.sum(1) != size).any():
        raise ValueError(f"every group must hold exactly {size} devices")
    if (counts.sum(0) > np.asarray(type_sizes)).any():
        raise ValueError("a count matrix uses more devices of a type than the network has")
