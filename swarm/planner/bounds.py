"""Lower bounds on the optimal iteration time in the paper's formulation (equal groups).

Why: a search that ties the paper's GA may simply have found the optimum, which no search
can beat; a bound proves it, and lets the search stop as soon as it gets there.

Two bounds, both over group compositions (count rows, see ``symmetry``):

- Enumeration: when the count matrices are few (few device types, e.g. two universities),
  every one is priced exactly and the bound is the optimum itself.
- Threshold bound: fix tau, the largest stage (all-reduce) time an allocation may have;
  only rows with stage cost <= tau may appear. A type t then fits at most m_t devices per
  group, so at least k_t = ceil(n_t / m_t) groups hold one, and every pipeline edge at such
  a group costs at least l_t, t's cheapest link to a type that may appear at all. In a path
  over S groups at least min(k_t, S - 1) edges touch those groups; every other edge costs at
  least the cheapest admissible link. The optimum is >= min over tau of tau + 2 * that path
  bound (an allocation whose stage cost is tau obeys the bound for tau).
"""

from __future__ import annotations

from itertools import combinations_with_replacement
from typing import Iterator, Optional

import numpy as np

from swarm.planner.cost import CostModel
from swarm.planner.path import path_cost
from swarm.planner.symmetry import TypedCost

__all__ = ["lower_bound", "enumerate_rows", "threshold_bound", "exact_optimum", "forced_counts"]

MAX_ROWS = 50_000  # compositions of one group; beyond this the bound is not attempted
MAX_MATRICES = 20_000  # count matrices priced by ``exact_optimum`` before it gives up


def enumerate_rows(type_sizes: np.ndarray, size: int) -> np.ndarray:
    """Every composition of a group of ``size`` devices over types with these many devices."""
    out: list[list[int]] = []

    def extend(prefix: list[int], left: int) -> None:
        t = len(prefix)
        if t == len(type_sizes) - 1:
            if left <= type_sizes[t]:
                out.append(prefix + [left])
            return
        for k in range(min(left, int(type_sizes[t])), -1, -1):
            extend(prefix + [k], left - k)
            if len(out) > MAX_ROWS:
                raise OverflowError

    extend([], size)
    return np.array(out, dtype=np.int64)


def forced_counts(typed: TypedCost) -> np.ndarray:
    """Devices of each type that every allocation must use (all, unless some are left over)."""
    spare = int(typed.type_sizes.sum()) - typed.num_groups * typed.size
    return np.maximum(typed.type_sizes - spare, 0)


def threshold_bound(typed: TypedCost, rows: np.ndarray) -> float:
    """The threshold bound of the module doc, minimised over every admissible tau."""
    s = typed.num_groups
    stage = np.array([typed.row_stage_s(r) for r in rows])
    order = np.argsort(stage, kind="stable")
    taus = stage[order]
    most = np.maximum.accumulate(rows[order], axis=0)  # m_t for each tau, shape (R, T)
    forced = forced_counts(typed)
    appears = most > 0
    cheapest = np.where(appears[:, None, :], typed.link[None, :, :], np.inf).min(2)  # l_t
    feasible = (appears | (forced == 0)).all(1) & (most * s >= forced).all(1)
    edge_min = np.where(appears, cheapest, np.inf).min(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        touched = np.minimum(np.ceil(forced / np.maximum(most, 1)), s - 1)
    per_type = touched * cheapest + (s - 1 - touched) * edge_min[:, None]
    per_type = np.where(forced > 0, per_type, (s - 1) * edge_min[:, None])
    path = np.nan_to_num(per_type.max(1), nan=np.inf, posinf=np.inf)
    totals = np.where(feasible, taus + 2.0 * path, np.inf)
    return float(totals.min())


def _matrices(rows: np.ndarray, forced: np.ndarray, caps: np.ndarray, s: int) -> Iterator[tuple[int, ...]]:
    """Multisets of S rows (row order is free: the pipeline order is optimised) within the caps."""
    for combo in combinations_with_replacement(range(len(rows)), s):
        used = rows[list(combo)].sum(0)
        if (used <= caps).all() and (used >= forced).all():
            yield combo


def exact_optimum(typed: TypedCost, rows: np.ndarray) -> Optional[float]:
    """Exact optimum over all count matrices, or None when there are too many to price."""
    s = typed.num_groups
    count = 1
    for k in range(s):  # number of S-multisets of the rows, a cheap upper estimate
        count = count * (len(rows) + k) // (k + 1)
    if count > 50 * MAX_MATRICES:
        return None
    forced, best, priced = forced_counts(typed), np.inf, 0
    for combo in _matrices(rows, forced, typed.type_sizes, s):
        priced += 1
        if priced > MAX_MATRICES:
            return None
        counts = rows[list(combo)]
        stage = max(typed.row_stage_s(r) for r in counts)
        if stage >= best:
            continue
        best = min(best, stage + 2.0 * path_cost(typed.edge_matrix(counts)))
    return float(best)


def lower_bound(model: CostModel, typed: Optional[TypedCost] = None) -> float:
    """A proven lower bound on the best equal-group allocation's iteration time (s).

    Exact (the optimum) when the count matrices are few enough to enumerate; otherwise the
    threshold bound; ``0.0`` when even the group compositions are too many to list.
    """
    typed = typed or TypedCost(model)
    try:
        rows = enumerate_rows(typed.type_sizes, typed.size)
    except OverflowError:
        return 0.0
    exact = exact_optimum(typed, rows)
    return exact if exact is not None else threshold_bound(typed, rows)
