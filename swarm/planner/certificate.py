"""Proof that an allocation is optimal, from how often the pipeline changes group composition.

Why: when our search and the paper's GA land on the same cost, either both are stuck or the
cost is the optimum; the threshold bound (``bounds``) is often too loose to tell. This
certificate settles it for every scenario of the paper (world-wide included: its 49.71 s is
the optimum of the equal-group problem, so no search can reach half the random mean there).

The argument, for the paper's equal groups. Describe an allocation by its count rows (see
``symmetry``). Split the device types into clusters where the links between types are
cheapest (single linkage, cut at the widest gap: Asia vs the rest in the world-wide case).
Let k be how many distinct rows the allocation has and j how many distinct cluster-level
rows (devices per cluster). The cheapest path through the S groups visits every row, so it
changes row at least k - 1 times and cluster-level row at least j - 1 times. A hop between
equal rows x, x costs at least ``same`` = min edge(x, x); a hop between rows that differ
costs at least ``cross`` (a device is matched to one of another type); a hop between rows
that differ per cluster costs at least ``cut`` (a device is matched across clusters). So

    pipeline >= min over m >= k-1, c >= j-1 of (S-1-m) * same + (m-c) * cross + c * cut,

and an allocation cheaper than the incumbent U needs every row's stage time below
U - 2 * pipeline (tightened to a fixed point, as fewer admissible rows raise the floors).
For each (k, j), a small integer program (HiGHS through scipy) looks for S admissible rows
with at most k distinct rows and j distinct cluster rows that fit the device counts. Each
row set it finds is priced exactly, over every multiplicity, and excluded by a cut; when the
program runs dry for every (k, j), nothing beats U.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix, diags, hstack, vstack

from swarm.planner.bounds import enumerate_rows, forced_counts
from swarm.planner.path import path_cost
from swarm.planner.symmetry import TypedCost

__all__ = [
    "certify_optimal",
    "certified_lower_bound",
    "type_clusters",
    "admissible_rows",
    "class_is_empty",
    "AdmissibleRows",
]

MILP_TIME_LIMIT_S = 20.0
MAX_CUTS_PER_CLASS = 200  # row sets priced exactly in one (k, j) class before giving up


def type_clusters(typed: TypedCost) -> np.ndarray:
    """Cluster label per type: single linkage over pipeline links, cut at the widest ratio gap."""
    t_count = typed.num_types
    labels = np.arange(t_count)
    pairs = sorted((typed.link[t, u], t, u) for t in range(t_count) for u in range(t + 1, t_count))
    merges: list[tuple[float, np.ndarray]] = []  # (merge height, labels before the merge)
    for height, t, u in pairs:
        if labels[t] != labels[u] and np.isfinite(height):
            merges.append((height, labels.copy()))
            labels[labels == labels[u]] = labels[t]
    if len(merges) < 2:
        return np.zeros(t_count, dtype=np.int64)
    gaps = [merges[i + 1][0] / max(merges[i][0], 1e-12) for i in range(len(merges) - 1)]
    before = merges[int(np.argmax(gaps)) + 1][1]
    return np.unique(before, return_inverse=True)[1].ravel()


@dataclass(frozen=True)
class AdmissibleRows:
    """Every admissible row with its stage time, self-edge and cluster-level row id."""

    rows: np.ndarray
    stage: np.ndarray
    same: np.ndarray
    cluster_row: np.ndarray
    clusters: np.ndarray


def _floors(typed: TypedCost, data: AdmissibleRows, keep: np.ndarray) -> tuple[float, float, float]:
    """(same, cross, cut) over the kept rows: see the module doc."""
    present = (data.rows[keep] > 0).any(0)
    link, clusters = typed.link[np.ix_(present, present)], data.clusters[present]
    other = ~np.eye(len(link), dtype=bool)
    apart = clusters[:, None] != clusters[None, :]
    cross = float(link[other].min()) if other.any() else np.inf
    cut = float(link[apart].min()) if apart.any() else np.inf
    return float(data.same[keep].min()), cross, cut


def _pipeline_floor(k: int, j: int, s: int, same: float, cross: float, cut: float) -> float:
    def times(count: int, cost: float) -> float:  # 0 hops of an impossible (inf) kind cost 0
        return 0.0 if count == 0 else count * cost

    return min(
        times(s - 1 - m, same) + times(m - c, cross) + times(c, cut)
        for m in range(k - 1, s)
        for c in range(j - 1, m + 1)
    )


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as an ordered sum of ``parts`` positive integers."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


def _cheapest_with_rows(typed: TypedCost, rows: np.ndarray) -> float:
    """Exact cost of the best allocation whose distinct rows are exactly ``rows``."""
    forced, best = forced_counts(typed), np.inf
    stage = max(typed.row_stage_s(r) for r in rows)
    for multiplicity in _compositions(typed.num_groups, len(rows)):
        used = (np.array(multiplicity)[:, None] * rows).sum(0)
        if (used > typed.type_sizes).any() or (used < forced).any():
            continue
        best = min(best, stage + 2.0 * path_cost(typed.edge_matrix(np.repeat(rows, multiplicity, axis=0))))
    return best


def class_is_empty(
    typed: TypedCost,
    data: AdmissibleRows,
    keep: np.ndarray,
    k: int,
    j: int,
    beat_s: float,
    deadline: float,
    price: bool = True,
) -> bool:
    """True when no allocation from the kept rows, with at most k distinct rows and j distinct
    cluster rows, costs below ``beat_s``; with ``price=False``, when no such allocation exists at
    all. Variables: n_r (groups given row r), z_r (row r used), w_q (cluster row q used)."""
    index = np.flatnonzero(keep)
    rows, count = data.rows[index], len(index)
    if count == 0:
        return True
    cluster_ids, cluster_of = np.unique(data.cluster_row[index], return_inverse=True)
    q_count, s, t_count = len(cluster_ids), typed.num_groups, typed.num_types
    cap = np.minimum(s, np.where(rows > 0, typed.type_sizes[None, :] // np.maximum(rows, 1), s).min(1)).astype(float)
    eye, none = diags(np.ones(count)), csr_matrix((count, count))
    to_cluster = csr_matrix((np.ones(count), (np.arange(count), cluster_of.ravel())), shape=(count, q_count))
    blocks = [
        (
            hstack([csr_matrix(rows.T.astype(float)), csr_matrix((t_count, count + q_count))]),
            forced_counts(typed),
            typed.type_sizes,
        ),
        (hstack([csr_matrix(np.ones((1, count))), csr_matrix((1, count + q_count))]), s, s),
        (hstack([eye, diags(-cap), csr_matrix((count, q_count))]), -np.inf, 0.0),  # n_r <= cap z_r
        (hstack([-eye, eye, csr_matrix((count, q_count))]), -np.inf, 0.0),  # z_r <= n_r
        (hstack([none, eye, -to_cluster]), -np.inf, 0.0),  # z_r <= w_q(r)
        (hstack([csr_matrix((1, count)), csr_matrix(np.ones((1, count))), csr_matrix((1, q_count))]), 0, k),
        (hstack([csr_matrix((1, 2 * count)), csr_matrix(np.ones((1, q_count)))]), 0, j),
    ]
    constraints = [LinearConstraint(a, lo, hi) for a, lo, hi in blocks]
    size = 2 * count + q_count
    bounds = Bounds(0.0, np.concatenate([cap, np.ones(count + q_count)]))
    cuts: list[np.ndarray] = []
    for _ in range(MAX_CUTS_PER_CLASS):
        left_s = min(MILP_TIME_LIMIT_S, deadline - time.perf_counter())
        if left_s <= 0:
            return False
        extra = (
            [
                LinearConstraint(
                    vstack([csr_matrix(c) for c in cuts]),
                    -np.inf,
                    np.array([c[count : 2 * count].clip(0).sum() - 1 for c in cuts]),
                )
            ]
            if cuts
            else []
        )
        result = milp(
            np.zeros(size),
            constraints=constraints + extra,
            integrality=np.ones(size),
            bounds=bounds,
            options={"time_limit": left_s},
        )
        if result.status == 2:  # infeasible: the class is empty
            return True
        if result.status != 0:
            return False
        used = np.flatnonzero(result.x[count : 2 * count] > 0.5)
        if not price or _cheapest_with_rows(typed, rows[used]) < beat_s:
            return False
        cut = np.zeros(size)  # exclude exactly this row set: sum_{used} z - sum_{others} z <= |used| - 1
        cut[count : 2 * count] = -1.0
        cut[count + used] = 1.0
        cuts.append(cut)
    return False


def admissible_rows(typed: TypedCost, limit: float) -> Optional[AdmissibleRows]:
    """Every group composition whose stage time is below ``limit`` (None: too many to list)."""
    try:
        rows = enumerate_rows(typed.type_sizes, typed.size)
    except OverflowError:
        return None
    stage = np.array([typed.row_stage_s(r) for r in rows])
    rows, stage = rows[stage < limit], stage[stage < limit]
    clusters = type_clusters(typed)
    per_cluster = np.stack([rows[:, clusters == c].sum(1) for c in range(clusters.max() + 1)], 1)
    cluster_row = np.unique(per_cluster, axis=0, return_inverse=True)[1].ravel()
    same = np.array([typed.row_edge_s(r, r) for r in rows])
    return AdmissibleRows(rows, stage, same, cluster_row, clusters)


def certify_optimal(
    typed: TypedCost, incumbent_s: float, deadline: float = float("inf"), price_candidates: bool = True
) -> bool:
    """True when no equal-group allocation costs less than ``incumbent_s`` (relative slack 1e-9).

    False when that cannot be shown, or not before ``deadline`` (``time.perf_counter()``).
    ``price_candidates=False`` skips the exact pricing of candidate row sets (faster, weaker)."""
    limit = incumbent_s * (1.0 - 1e-9)
    data = admissible_rows(typed, limit)
    if data is None:
        return False
    s = typed.num_groups
    for k in range(1, s + 1):
        # The fast form takes j = 1 only, the weakest floor, and lets the program use up to k
        # cluster rows: one check then covers every j.
        for j in range(1, k + 1) if price_candidates else (1,):
            cluster_rows = j if price_candidates else k
            threshold = limit
            while True:  # fixed point: fewer admissible rows, higher floors, lower threshold
                keep = data.stage < threshold
                if not keep.any():
                    break
                tightened = limit - 2.0 * _pipeline_floor(k, j, s, *_floors(typed, data, keep))
                if tightened >= threshold - 1e-12:
                    break
                threshold = tightened
            keep = data.stage < threshold
            if not keep.any():
                continue
            if not class_is_empty(typed, data, keep, k, cluster_rows, limit, deadline, price=price_candidates):
                return False
    return True


def certified_lower_bound(
    typed: TypedCost, low_s: float, high_s: float, steps: int = 10, deadline: float = float("inf")
) -> float:
    """Raise a proven lower bound ``low_s`` towards ``high_s`` by bisection: every U the
    (fast form of the) certificate accepts is a lower bound on the equal-group optimum."""
    for _ in range(steps):
        if high_s - low_s <= 1e-3 * high_s or time.perf_counter() >= deadline:
            break
        middle = 0.5 * (low_s + high_s)
        if certify_optimal(typed, middle, deadline, price_candidates=False):
            low_s = middle
        else:
            high_s = middle
    return low_s
