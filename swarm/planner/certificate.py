"""Proof that an allocation is optimal, from how often the pipeline changes group composition.

Why: when our search and the paper's GA land on the same cost, either both are stuck or the
cost is the optimum; the threshold bound (``bounds``) is often too loose to tell. This
certificate settles it for the scenarios where it matters (regional: the GA's 35.29 s is the
optimum, so no search can beat it).

The argument, for the paper's equal groups. Describe an allocation by its count rows (see
``symmetry``) and let k be how many distinct rows it has. The cheapest path through the S
groups visits every row, so it changes row at least k - 1 times. A hop between two equal
rows x, x costs at least ``same`` = min edge(x, x) over admissible rows; a hop between
different rows x != y costs at least ``cross``: some type t has x_t > y_t, so a t-device
of x is matched to a device of another type in y, over a link between two types that appear
in admissible rows (``pair_floor``). Hence

    pipeline >= min over m in [k-1, S-1] of (S-1-m) * same + m * cross.

An allocation cheaper than the incumbent U needs every row's stage time below
U - 2 * pipeline; shrinking the admissible rows can only raise ``same`` and ``cross``, so
the threshold is tightened to a fixed point. Then a small integer program (HiGHS through
scipy) finds the fewest distinct admissible rows that fill S groups within the device
counts. If that is more than k for every k, nothing beats U: U is optimal.
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix, diags, hstack

from swarm.planner.bounds import enumerate_rows, forced_counts
from swarm.planner.symmetry import TypedCost

__all__ = ["certify_optimal", "certified_lower_bound", "pair_floor", "fewest_distinct_rows"]

MILP_TIME_LIMIT_S = 20.0


def pair_floor(typed: TypedCost, rows: np.ndarray) -> float:
    """A lower bound on edge(x, y) over every pair of distinct rows (inf for a single row): a
    device of some type is matched to one of another type, both present in these rows."""
    if len(rows) < 2:
        return float("inf")
    present = (rows > 0).any(0)
    links = typed.link[np.ix_(present, present)]
    cross = links[~np.eye(len(links), dtype=bool)]
    return float(cross.min()) if cross.size else float("inf")


def _pipeline_floor(k: int, s: int, same: float, cross: float) -> float:
    return min((s - 1 - m) * same + m * cross for m in range(k - 1, s))


def fewest_distinct_rows(typed: TypedCost, rows: np.ndarray, time_limit_s: float = MILP_TIME_LIMIT_S) -> float:
    """Fewest distinct rows (a proven lower bound on it) that fill S groups within the device counts.

    Variables: n_r, the groups given row r (integer), and z_r, whether row r is used (binary);
    sum_r n_r = S, forced <= sum_r n_r * row_r <= type sizes, n_r <= cap_r * z_r; minimise sum z_r.
    Returns inf when no choice of these rows fills the groups.
    """
    s, count = typed.num_groups, len(rows)
    if count == 0:
        return float("inf")
    sizes = typed.type_sizes
    cap = np.minimum(s, np.where(rows > 0, sizes[None, :] // np.maximum(rows, 1), s).min(1)).astype(float)
    zeros = csr_matrix((1, count))
    constraints = [
        LinearConstraint(hstack([csr_matrix(rows.T.astype(float)), csr_matrix((typed.num_types, count))]),
                         forced_counts(typed), sizes),
        LinearConstraint(hstack([csr_matrix(np.ones((1, count))), zeros]), s, s),
        LinearConstraint(hstack([diags(np.ones(count)), diags(-cap)]), -np.inf, 0.0),
    ]
    cost = np.concatenate([np.zeros(count), np.ones(count)])
    result = milp(cost, constraints=constraints, integrality=np.ones(2 * count),
                  bounds=Bounds(0.0, np.concatenate([cap, np.ones(count)])),
                  options={"time_limit": time_limit_s})
    if result.status == 2:  # infeasible
        return float("inf")
    if result.status == 0:
        return float(result.fun)
    bound = getattr(result, "mip_dual_bound", None)
    return float(bound) if bound is not None and np.isfinite(bound) else 0.0


def certify_optimal(typed: TypedCost, incumbent_s: float, time_limit_s: float = MILP_TIME_LIMIT_S) -> bool:
    """True when no equal-group allocation costs less than ``incumbent_s`` (relative slack 1e-9)."""
    try:
        rows = enumerate_rows(typed.type_sizes, typed.size)
    except OverflowError:
        return False
    s = typed.num_groups
    limit = incumbent_s * (1.0 - 1e-9)
    stage = np.array([typed.row_stage_s(r) for r in rows])
    candidates = rows[stage < limit]
    stage = stage[stage < limit]
    same_of = np.array([typed.row_edge_s(r, r) for r in candidates])
    for k in range(1, s + 1):
        threshold = limit
        while True:
            keep = stage < threshold
            if not keep.any():
                break
            same = float(same_of[keep].min())
            cross = pair_floor(typed, candidates[keep]) if k > 1 else same
            tightened = limit - 2.0 * _pipeline_floor(k, s, same, cross)
            if tightened >= threshold - 1e-12:
                break
            threshold = tightened
        keep = stage < threshold
        if keep.any() and fewest_distinct_rows(typed, candidates[keep], time_limit_s) <= k + 1e-6:
            return False
    return True


def certified_lower_bound(typed: TypedCost, low_s: float, high_s: float, steps: int = 10,
                          deadline: float = float("inf")) -> float:
    """Raise a proven lower bound ``low_s`` towards ``high_s`` by bisection: every U the
    certificate accepts is a lower bound on the equal-group optimum."""
    for _ in range(steps):
        if high_s - low_s <= 1e-3 * high_s or time.perf_counter() >= deadline:
            break
        middle = 0.5 * (low_s + high_s)
        if certify_optimal(typed, middle):
            low_s = middle
        else:
            high_s = middle
    return low_s
