"""Placements that ignore the network, to measure the planner against.

- random: devices shuffled into S groups of D (the paper's "without scheduler");
- best of K random: the cheapest of K shuffles (what a little brute force buys);
- grid: devices in index order, D at a time, as a data-center scheduler would place them.
"""

from __future__ import annotations

import numpy as np

from swarm.planner.balanced import FastCost
from swarm.planner.cost import CostBreakdown, CostModel
from swarm.planner.seeds import grid_groups

__all__ = ["random_placements", "random_costs", "best_of_random", "grid_placement"]

Placement = tuple[np.ndarray, np.ndarray]


def random_placements(model: CostModel, count: int, seed: int) -> list[Placement]:
    """``count`` uniformly random balanced placements (leftover devices unused)."""
    rng = np.random.default_rng(seed)
    used = model.num_stages * model.nominal_replicas
    out = []
    for _ in range(count):
        order = rng.permutation(model.num_devices)
        out.append((order[:used].reshape(model.num_stages, -1), order[used:]))
    return out


def random_costs(model: CostModel, count: int, seed: int) -> np.ndarray:
    """Iteration time of each of ``count`` random placements."""
    fast = FastCost(model)
    return np.array([fast.total(groups) for groups, _ in random_placements(model, count, seed)])


def best_of_random(model: CostModel, count: int, seed: int) -> tuple[Placement, float]:
    """The cheapest of ``count`` random placements, and its iteration time."""
    fast = FastCost(model)
    placements = random_placements(model, count, seed)
    costs = [fast.total(groups) for groups, _ in placements]
    k = int(np.argmin(costs))
    return placements[k], float(costs[k])


def grid_placement(model: CostModel) -> CostBreakdown:
    """Cost of the region-blind grid placement."""
    groups, pool = grid_groups(model)
    return model.evaluate(groups.tolist(), pool.tolist())
