"""Simulated annealing over count matrices (groups x device types) -- see ``symmetry``.

A move exchanges one device of type t in group g for one of type u != t in group h (or in
the pool of unused devices), i.e. X[g,t] -= 1, X[g,u] += 1, X[h,u] -= 1, X[h,t] += 1. Every
move changes the composition of two groups, unlike a device swap, which is a no-op whenever
the two devices are twins (most swaps in a network of a few sites). Row costs and row-pair
edges come from ``TypedCost``'s caches, so after a short warm-up a move costs one path DP.

The schedule runs on evaluation counts, not wall time, so a seed gives the same answer on
any machine; a chain stops early once it reaches ``target`` (a proven lower bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from swarm.planner.path import path_cost
from swarm.planner.symmetry import TypedCost

__all__ = ["CountState", "AnnealSchedule", "anneal_counts"]


@dataclass(frozen=True)
class AnnealSchedule:
    """num_evaluations: moves priced; start/end_temperature: fractions of the start cost;
    target: stop as soon as a cost at or below it is found (a lower bound, or -inf)."""

    num_evaluations: int
    start_temperature: float
    end_temperature: float
    target: float = float("-inf")

    def __post_init__(self) -> None:
        if self.num_evaluations < 0:
            raise ValueError(f"num_evaluations must be >= 0, got {self.num_evaluations!r}")
        if not 0 < self.end_temperature <= self.start_temperature:
            raise ValueError("end_temperature must be positive and at most start_temperature")


class CountState:
    """A count matrix (plus the unused counts) with its cached row costs and edge matrix."""

    def __init__(self, typed: TypedCost, counts: np.ndarray, pool: np.ndarray) -> None:
        self.typed = typed
        self.counts = np.array(counts, dtype=np.int64)
        self.pool = np.array(pool, dtype=np.int64)
        self.stage = np.array([typed.row_stage_s(r) for r in self.counts])
        self.weights = typed.edge_matrix(self.counts)
        self.total = float(self.stage.max() + 2.0 * path_cost(self.weights))
        self._pending: tuple | None = None

    def price(self, g: int, t: int, h: int, u: int, reject_above: float) -> float:
        """Total after moving a type-t device of g to h (h == -1: the pool) for a type-u one."""
        counts = self.counts.copy()
        counts[g, t] -= 1
        counts[g, u] += 1
        pool = self.pool
        if h >= 0:
            counts[h, u] -= 1
            counts[h, t] += 1
            touched: tuple[int, ...] = (g, h)
        else:
            pool = pool.copy()
            pool[u] -= 1
            pool[t] += 1
            touched = (g,)
        stage = self.stage.copy()
        for k in touched:
            stage[k] = self.typed.row_stage_s(counts[k])
        if stage.max() >= reject_above:
            return float("inf")
        weights = self.weights.copy()
        for k in touched:
            for x in range(counts.shape[0]):
                if x != k:
                    weights[k, x] = weights[x, k] = self.typed.row_edge_s(counts[k], counts[x])
        total = float(stage.max() + 2.0 * path_cost(weights))
        self._pending = (counts, pool, stage, weights, total)
        return total

    def commit(self) -> None:
        """Apply the move last priced."""
        if self._pending is None:
            raise RuntimeError("commit() needs a move priced first")
        self.counts, self.pool, self.stage, self.weights, self.total = self._pending
        self._pending = None


def _pick_type(row: np.ndarray, rng: np.random.Generator) -> int:
    """Type of a uniformly drawn member (so a type is drawn in proportion to its count)."""
    return int(np.searchsorted(np.cumsum(row), rng.integers(row.sum()), side="right"))


def _propose(state: CountState, rng: np.random.Generator) -> tuple[int, int, int, int] | None:
    s, pool_size = state.counts.shape[0], int(state.pool.sum())
    g = int(rng.integers(s))
    if pool_size and rng.random() < pool_size / (pool_size + state.counts.sum()):
        h, u = -1, _pick_type(state.pool, rng)
    else:
        h = int(rng.integers(s - 1))
        h += h >= g
        u = _pick_type(state.counts[h], rng)
    t = _pick_type(state.counts[g], rng)
    return None if t == u else (g, t, h, u)


def anneal_counts(
    state: CountState, schedule: AnnealSchedule, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, float, int]:
    """One annealing chain from ``state``; returns the best (counts, pool, cost) and moves priced."""
    best = (state.counts.copy(), state.pool.copy(), state.total)
    t_start = schedule.start_temperature * state.total
    ratio = schedule.end_temperature / schedule.start_temperature
    evaluations = 0
    while evaluations < schedule.num_evaluations and best[2] > schedule.target:
        move = _propose(state, rng)
        if move is None:
            evaluations += 1  # a twin swap: free, but it still counts towards the schedule
            continue
        temperature = t_start * ratio ** (evaluations / schedule.num_evaluations)
        threshold = state.total - temperature * math.log(1.0 - rng.random())
        evaluations += 1
        if state.price(*move, reject_above=threshold) < threshold:
            state.commit()
            if state.total < best[2] - 1e-12:
                best = (state.counts.copy(), state.pool.copy(), state.total)
    return best[0], best[1], best[2], evaluations
