"""Cheapest open path through all stage groups (open-loop travelling salesman), exactly.

Once devices are grouped into stages, the pipeline order is free: the paper picks the order
whose summed group-to-group costs is smallest, which is an open travelling-salesman path. For
the handful of stages a pipeline has (S <= 16) Held-Karp dynamic programming is exact and,
vectorised one subset size at a time with precomputed transition tables, fast enough to run
inside the search loop (about 0.1 ms for S = 8).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["MAX_EXACT_STAGES", "path_cost", "cheapest_path"]

MAX_EXACT_STAGES = 16


@lru_cache(maxsize=None)
def _layers(num_nodes: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, int], ...]:
    """Transition tables: for each subset size k+1, target states and their k predecessors.

    A state is ``mask * n + last``. For a target (mask, j) the predecessors are
    (mask without j, i) for every other i in mask, entered over edge i -> j.
    """
    n = num_nodes
    masks = np.arange(1 << n)
    popcount = np.array([bin(m).count("1") for m in masks])
    layers = []
    for size in range(2, n + 1):
        targets: list[int] = []
        sources: list[int] = []
        edges: list[int] = []
        for mask in masks[popcount == size]:
            members = [b for b in range(n) if mask >> b & 1]
            for j in members:
                prev = mask ^ (1 << j)
                targets.append(mask * n + j)
                sources.extend(prev * n + i for i in members if i != j)
                edges.extend(i * n + j for i in members if i != j)
        layers.append(
            (
                np.array(targets),
                np.array(sources).reshape(len(targets), size - 1),
                np.array(edges).reshape(len(targets), size - 1),
                size - 1,
            )
        )
    return tuple(layers)


def _held_karp(weights: np.ndarray, keep_parents: bool) -> tuple[np.ndarray, list[np.ndarray]]:
    """Fill dp[mask * n + last] = cheapest path over ``mask`` ending at ``last``."""
    n = weights.shape[0]
    flat = weights.reshape(-1)
    dp = np.full((1 << n) * n, np.inf)
    dp[[(1 << j) * n + j for j in range(n)]] = 0.0
    parents = []
    for targets, sources, edges, _ in _layers(n):
        candidates = dp[sources] + flat[edges]
        if keep_parents:
            best = candidates.argmin(axis=1)
            parents.append(sources[np.arange(len(targets)), best])
            dp[targets] = candidates[np.arange(len(targets)), best]
        else:
            dp[targets] = candidates.min(axis=1)
    return dp, parents


def _check(weights: np.ndarray) -> np.ndarray:
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2 or weights.shape[0] != weights.shape[1]:
        raise ValueError(f"weights must be a square matrix, got shape {weights.shape}")
    if weights.shape[0] > MAX_EXACT_STAGES:
        raise ValueError(f"weights has {weights.shape[0]} nodes; exact search supports {MAX_EXACT_STAGES}")
    return weights


def path_cost(weights: np.ndarray) -> float:
    """Cost of the cheapest path visiting every node once (edge i -> j costs weights[i, j])."""
    weights = _check(weights)
    n = weights.shape[0]
    if n <= 1:
        return 0.0
    dp, _ = _held_karp(weights, keep_parents=False)
    full = (1 << n) - 1
    return float(dp[full * n : full * n + n].min())


def cheapest_path(weights: np.ndarray) -> tuple[float, list[int]]:
    """The cheapest open path and its node order (first stage first)."""
    weights = _check(weights)
    n = weights.shape[0]
    if n <= 1:
        return 0.0, list(range(n))
    dp, parents = _held_karp(weights, keep_parents=True)
    full = (1 << n) - 1
    last = int(dp[full * n : full * n + n].argmin())
    cost = float(dp[full * n + last])
    state, order = full * n + last, [last]
    for layer, parent in zip(reversed(_layers(n)), reversed(parents)):
        targets = layer[0]
        state = int(parent[np.searchsorted(targets, state)])
        order.append(state % n)
    return cost, order[::-1]
