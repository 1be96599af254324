"""Bottleneck assignment: pair the members of two stage groups so the slowest link is fastest.

The paper's pipeline cost between two groups is not a sum-of-costs assignment (which is what
``scipy.optimize.linear_sum_assignment`` solves) but a *bottleneck* assignment: every replica
of stage g hands its activations to exactly one replica of stage h, all at the same time, so
the transfer takes as long as the slowest matched link. We solve it exactly by a search over
the sorted distinct link costs, checking at each threshold whether the links at or below it
admit a matching that covers the larger group (Kuhn's augmenting paths on bitmasks: groups
are small, typically 8 members).

Groups of unequal size (allowed by our extension) are matched with capacities: every member
of the larger group sends or receives one chunk, and every member of the smaller group may
take up to ``ceil(larger / smaller)`` chunks.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["bottleneck_value", "chunks_per_member", "has_covering_matching"]


def chunks_per_member(size_a: int, size_b: int) -> int:
    """How many chunks a member of the smaller group may have to carry (1 for equal sizes)."""
    small, large = sorted((size_a, size_b))
    if small < 1:
        raise ValueError("size_a and size_b must both be at least 1")
    return math.ceil(large / small)


def _augment(u: int, adj: list[int], owner: list[int], seen: list[int]) -> bool:
    """Kuhn's step: find an augmenting path from left vertex ``u`` (seen is a 1-element mask box)."""
    free = adj[u] & ~seen[0]
    while free:
        bit = free & -free
        free ^= bit
        seen[0] |= bit
        v = bit.bit_length() - 1
        if owner[v] < 0 or _augment(owner[v], adj, owner, seen):
            owner[v] = u
            return True
    return False


def _rows_covered(allowed: np.ndarray, capacity: int) -> bool:
    """Whether every row can be matched to a column, each column taking at most ``capacity`` rows."""
    rows, cols = allowed.shape
    if rows > cols * capacity:
        return False
    adj = []
    for r in range(rows):
        base = 0
        for c in np.flatnonzero(allowed[r]):
            base |= 1 << int(c)
        if base == 0:
            return False
        # Copy k of column c is right vertex k * cols + c.
        adj.append(sum(base << (k * cols) for k in range(capacity)))
    owner = [-1] * (cols * capacity)
    return all(_augment(r, adj, owner, [0]) for r in range(rows))


def has_covering_matching(allowed: np.ndarray, capacity: int = 1) -> bool:
    """Whether the allowed links can carry one chunk per row with every column used 1..capacity times.

    ``allowed`` is a boolean (rows x cols) matrix with rows the larger side. A matching that
    covers the rows (with capacities) and one that covers the columns exist together exactly
    when one assignment does both (Mendelsohn-Dulmage), so two plain checks suffice.
    """
    if not _rows_covered(allowed, capacity):
        return False
    return capacity == 1 or _rows_covered(allowed.T, 1)


def bottleneck_value(cost: np.ndarray) -> float:
    """Smallest t such that the links with cost <= t cover the larger side (see module doc).

    ``cost`` is (size_g x size_h); equal sizes give the paper's one-to-one bottleneck assignment.
    """
    cost = np.asarray(cost, dtype=float)
    if cost.shape[0] < cost.shape[1]:
        cost = cost.T
    capacity = chunks_per_member(*cost.shape)
    # Every row and every column needs at least one link: a lower bound that is usually tight.
    lower = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    if has_covering_matching(cost <= lower, capacity):
        return float(lower)
    values = np.unique(cost[cost > lower])
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if has_covering_matching(cost <= values[mid], capacity):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])
