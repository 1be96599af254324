"""The paper's search, as a baseline: a genetic algorithm over balanced partitions.

Yuan et al. keep a population of partitions of the devices into S equal groups. Each step
picks two parents, crosses them over (every device takes its group from one parent or the
other, after the second parent's group labels are aligned to the first's by overlap), which
leaves groups of unequal size, then repairs sizes by moving devices from over-full to
under-full groups (preferring devices the other parent put there, the paper's cyclic moves),
runs a short swap local search, and replaces the worse parent if the child beats it.
It is priced with the same fast evaluator as our search, so equal budgets are fair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from swarm.planner.balanced import FastCost, SwapState
from swarm.planner.cost import CostModel
from swarm.planner.search import SearchResult

__all__ = ["GeneticConfig", "genetic_search"]


@dataclass(frozen=True)
class GeneticConfig:
    """time_budget_s: wall seconds; population_size: partitions kept; local_search_steps:
    swap attempts per child; seed: seeds every random choice."""

    time_budget_s: float = 20.0
    seed: int = 0
    population_size: int = 32
    local_search_steps: int = 64

    def __post_init__(self) -> None:
        if not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be positive, got {self.time_budget_s!r}")
        if self.population_size < 2:
            raise ValueError(f"population_size must be at least 2, got {self.population_size!r}")
        if self.local_search_steps < 0:
            raise ValueError(f"local_search_steps must be >= 0, got {self.local_search_steps!r}")


def _labels(groups: np.ndarray, n: int) -> np.ndarray:
    labels = np.full(n, -1)
    for g, row in enumerate(groups):
        labels[row] = g
    return labels


def _crossover(first: np.ndarray, second: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Child groups from two parents' (S, D) groups; devices outside both stay out."""
    s, size = first.shape
    a, b = _labels(first, n), _labels(second, n)
    used = a >= 0
    overlap = np.zeros((s, s))
    np.add.at(overlap, (a[used & (b >= 0)], b[used & (b >= 0)]), 1)
    rows, cols = linear_sum_assignment(-overlap)
    relabel = np.empty(s, dtype=int)
    relabel[cols] = rows
    b = np.where(b >= 0, relabel[np.maximum(b, 0)], -1)
    child = np.where(rng.random(n) < 0.5, a, np.where(b >= 0, b, a))
    child[~used] = -1
    members = [list(rng.permutation(np.flatnonzero(child == g))) for g in range(s)]
    # Repair: move devices out of over-full groups, preferring ones the other parent put
    # in an under-full group (the paper's cyclic moves keep the other parent's choices).
    for g in range(s):
        while len(members[g]) > size:
            short = [h for h in range(s) if len(members[h]) < size]
            liked = [d for d in members[g] if b[d] in short or a[d] in short]
            d = liked[0] if liked else members[g][0]
            target = b[d] if b[d] in short else (a[d] if a[d] in short else short[0])
            members[g].remove(d)
            members[target].append(d)
    return np.array(members, dtype=np.int64)


def _local_search(state: SwapState, steps: int, rng: np.random.Generator) -> None:
    s, size = state.groups.shape
    for _ in range(steps):
        a, b = rng.choice(s, 2, replace=False)
        if (
            state.price_swap(int(a), int(rng.integers(size)), int(b), int(rng.integers(size)), reject_above=state.total)
            < state.total
        ):
            state.commit()


def genetic_search(model: CostModel, config: GeneticConfig) -> SearchResult:
    """Run the paper's genetic algorithm for the time budget; return the best partition."""
    began = time.perf_counter()
    deadline = began + config.time_budget_s
    rng = np.random.default_rng(config.seed)
    fast = FastCost(model)
    n, s, size = model.num_devices, model.num_stages, model.nominal_replicas
    population, costs, pools = [], [], []
    for _ in range(config.population_size):
        order = rng.permutation(n)
        population.append(order[: s * size].reshape(s, size))
        pools.append(order[s * size :])
        costs.append(fast.total(population[-1]))
    evaluations = config.population_size
    while time.perf_counter() < deadline:
        i, j = rng.choice(config.population_size, 2, replace=False)
        child = _crossover(population[i], population[j], n, rng)
        state = SwapState(fast, child, pools[i])
        _local_search(state, config.local_search_steps, rng)
        evaluations += 1 + config.local_search_steps
        worse = i if costs[i] >= costs[j] else j
        if state.total < costs[worse]:
            population[worse], costs[worse], pools[worse] = state.groups, state.total, pools[i]
    best = int(np.argmin(costs))
    breakdown = model.evaluate(population[best].tolist(), pools[best].tolist())
    return SearchResult(breakdown, time.perf_counter() - began, evaluations)
