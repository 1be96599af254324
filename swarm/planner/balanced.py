"""Fast, vectorised cost of equal-size groupings: the inner loop of every search.

Searches spend nearly all their time re-evaluating a grouping after swapping two devices.
Only the two touched groups' all-reduce terms and their 2(S-1)-1 pipeline edges change, so
``SwapState`` keeps the per-group terms and the edge matrix and recomputes just those, with
the bottleneck assignments of all changed edges batched through numpy (the exact Kuhn check
only runs on the candidate threshold each edge's lower bound gives, falling back to the
full threshold search in ``matching`` when that bound is not tight). The genetic baseline
and our search share this evaluator, so a time budget buys both the same number of
evaluations per second.
"""

from __future__ import annotations

import numpy as np

from swarm.planner.cost import CostModel
from swarm.planner.path import path_cost

__all__ = ["FastCost", "SwapState"]


def _try_augment(row: int, cost: list[list[float]], limit: float, owner: list[int], seen: list[bool]) -> bool:
    for col, value in enumerate(cost[row]):
        if value <= limit and not seen[col]:
            seen[col] = True
            if owner[col] < 0 or _try_augment(owner[col], cost, limit, owner, seen):
                owner[col] = row
                return True
    return False


def _raise_to_perfect(cost: list[list[float]], limit: float) -> float:
    """Exact bottleneck value of a square block, starting from a lower bound ``limit``.

    Keeps one matching while raising the limit: when no augmenting path exists, the next
    limit is the cheapest link leaving the alternating tree (rows and columns reachable from
    the unmatched row), which is the least increase that can extend the matching.
    """
    size = len(cost)
    owner = [-1] * size
    for row in range(size):
        while True:
            seen = [False] * size
            if _try_augment(row, cost, limit, owner, seen):
                break
            tree_rows = {row} | {owner[c] for c in range(size) if seen[c]}
            limit = min(cost[r][c] for r in tree_rows for c in range(size) if not seen[c])
    return limit


class FastCost:
    """Cost of (S, D) integer arrays of device indices, each row one group of D replicas."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.size = model.nominal_replicas
        speed = model.seconds_per_flop
        self.compute_per_device = None if speed is None else speed * model.stage_flops / self.size

    def stage_s(self, groups: np.ndarray) -> np.ndarray:
        """All-reduce (+ compute, if speeds are known) time of each row group."""
        m = self.model
        rows, cols = groups[:, :, None], groups[:, None, :]
        per_member = m.dp_latency[rows, cols].sum(2) + m.dp_transfer[rows, cols].sum(2) / self.size
        stage = per_member.max(1)
        if self.compute_per_device is not None:
            stage = stage + self.compute_per_device[groups].max(1)
        return stage

    def edges(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """Bottleneck pipeline time between left[k] and right[k] for every k."""
        blocks = self.model.pp_link[left[:, :, None], right[:, None, :]]
        lower = np.maximum(blocks.min(2).max(1), blocks.min(1).max(1))
        return np.array([_raise_to_perfect(b, t) for b, t in zip(blocks.tolist(), lower.tolist())])

    def edge_lower_bounds(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """Cheap lower bounds of ``edges`` (every replica needs some link): for early rejection."""
        blocks = self.model.pp_link[left[:, :, None], right[:, None, :]]
        return np.maximum(blocks.min(2).max(1), blocks.min(1).max(1))

    def edge_matrix(self, groups: np.ndarray) -> np.ndarray:
        s = groups.shape[0]
        upper_x, upper_y = np.triu_indices(s, 1)
        weights = np.zeros((s, s))
        values = self.edges(groups[upper_x], groups[upper_y])
        weights[upper_x, upper_y] = values
        weights[upper_y, upper_x] = values
        return weights

    def total(self, groups: np.ndarray) -> float:
        return float(self.stage_s(groups).max() + 2.0 * path_cost(self.edge_matrix(groups)))


class SwapState:
    """A grouping plus its cached terms, able to price and apply a swap of two devices.

    Row ``pool`` (if any) holds devices left out; it has no cost of its own.
    """

    def __init__(self, fast: FastCost, groups: np.ndarray, pool: np.ndarray) -> None:
        self.fast = fast
        self.groups = np.array(groups, dtype=np.int64)
        self.pool = np.array(pool, dtype=np.int64)
        self.num_groups = self.groups.shape[0]
        self.stage = fast.stage_s(self.groups)
        self.weights = fast.edge_matrix(self.groups)
        self.total = float(self.stage.max() + 2.0 * path_cost(self.weights))
        self._pending: tuple | None = None

    def price_swap(self, a: int, p: int, b: int, q: int, reject_above: float = float("inf")) -> float:
        """Total after swapping groups[a, p] with groups[b, q] (b == -1: with pool[q]).

        Returns inf without finishing the pricing when the new all-reduce/compute term alone
        already reaches ``reject_above`` (the search would reject the swap anyway).
        """
        groups = self.groups.copy()
        if b >= 0:
            groups[a, p], groups[b, q] = groups[b, q], groups[a, p]
            touched = [a, b]
        else:
            groups[a, p] = self.pool[q]
            touched = [a]
        stage = self.stage.copy()
        stage[touched] = self.fast.stage_s(groups[touched])
        if stage.max() >= reject_above:
            self._pending = None
            return float("inf")
        weights = self.weights.copy()
        others = [(t, x) for t in touched for x in range(self.num_groups) if x != t and not (x in touched and x < t)]
        left = groups[[t for t, _ in others]]
        right = groups[[x for _, x in others]]
        values = self.fast.edges(left, right)
        for (t, x), value in zip(others, values):
            weights[t, x] = weights[x, t] = value
        total = float(stage.max() + 2.0 * path_cost(weights))
        self._pending = (groups, stage, weights, total, b, q, a, p)
        return total

    def commit(self) -> None:
        """Apply the swap last priced."""
        if self._pending is None:
            raise RuntimeError("commit() needs a swap priced first")
        groups, stage, weights, total, b, q, a, p = self._pending
        if b < 0:
            self.pool[q] = self.groups[a, p]
        self.groups, self.stage, self.weights, self.total = groups, stage, weights, total
        self._pending = None
