"""Our allocation search: simulated annealing over device swaps, then unequal-group descent.

Phase 1 works in the paper's space (S groups of D = N // S devices; extra devices wait in a
pool). Constructive starts (clustered, striped, and block-striped placements over several
device orders, plus any supplied) are priced and the best few seed annealing chains. When
the network has interchangeable devices (every scenario of the paper), chains anneal count
matrices (``counts``): twin swaps, which change nothing, vanish from the move set. Otherwise
they propose swapping two devices between groups (or with the pool), repriced
incrementally by ``SwapState``. Temperatures are relative to the starting cost and cooled
geometrically over a fixed number of evaluations. Every chain stops as soon as it reaches
the proven lower bound (``bounds``): nothing can beat that allocation.

Phase 2 (our extension, on by default) leaves the equal-size space: a best-improvement
descent that may drop a device, move one to another group, or bring a dropped one back,
taken only while it lowers the iteration time.

When the lower bound is not reached, ``certificate`` tries to prove the phase-1 result optimal
(it is, in every scenario of the paper), so a tie with another search is known to be the
optimum, not a shared trap.

Pure and deterministic for a seed: budgets are evaluation counts and convergence; the wall
time budget is only a safety cap (a run that hits it says so in ``SearchResult.hit_time_cap``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from swarm.planner.balanced import FastCost, SwapState
from swarm.planner.cost import CostBreakdown, CostModel
from swarm.planner.bounds import lower_bound
from swarm.planner.certificate import certified_lower_bound, certify_optimal
from swarm.planner.counts import AnnealSchedule, CountState, anneal_counts
from swarm.planner.seeds import block_striped_groups, grid_groups, type_orders
from swarm.planner.symmetry import TypedCost, counts_to_groups, groups_to_counts

__all__ = ["SearchConfig", "SearchResult", "search"]

Placement = tuple[np.ndarray, np.ndarray]  # (S, D) groups, leftover pool


@dataclass(frozen=True)
class SearchConfig:
    """How long and how to search.

    time_budget_s: wall-clock safety cap in seconds for the whole search (both phases); the
        search normally ends earlier, on its evaluation budget or at the lower bound.
    seed: seeds every random choice.
    allow_uneven: phase 2 may leave devices out or make groups unequal (beyond the paper).
    num_chains: independent annealing chains, each from a different start.
    start_temperature / end_temperature: as fractions of the starting cost.
    max_evaluations: moves priced per chain (the deterministic budget).
    use_lower_bound: compute the lower bound and stop a chain that reaches it.
    """

    time_budget_s: float = 60.0
    seed: int = 0
    allow_uneven: bool = True
    num_chains: int = 3
    start_temperature: float = 0.1
    end_temperature: float = 0.001
    max_evaluations: int = 1500
    use_lower_bound: bool = True

    def __post_init__(self) -> None:
        if not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be positive, got {self.time_budget_s!r}")
        if self.num_chains < 1:
            raise ValueError(f"num_chains must be at least 1, got {self.num_chains!r}")
        if not 0 < self.end_temperature <= self.start_temperature:
            raise ValueError("end_temperature must be positive and at most start_temperature")
        if self.max_evaluations < 1:
            raise ValueError(f"max_evaluations must be positive, got {self.max_evaluations!r}")


@dataclass(frozen=True)
class SearchResult:
    """The best allocation found, and what finding it took."""

    breakdown: CostBreakdown
    solve_s: float
    num_evaluations: int
    lower_bound_s: Optional[float] = None  # proven bound for equal groups (None: not computed)
    hit_time_cap: bool = False  # the wall-time cap cut the search short (result may vary by machine)
    proven_optimal: bool = False  # no equal-group allocation beats the phase-1 result (``certificate``)


def _anneal(
    state: SwapState, rng: np.random.Generator, config: SearchConfig, deadline: float, target: float
) -> tuple[Placement, float, int]:
    """One device-swap chain; returns the best placement seen, its cost and the swaps priced."""
    num_groups, size = state.groups.shape
    pool_size = state.pool.size
    t_start, t_end = config.start_temperature * state.total, config.end_temperature * state.total
    best = (state.groups.copy(), state.pool.copy())
    best_total, evaluations = state.total, 0
    while evaluations < config.max_evaluations and best_total > target:
        if evaluations % 64 == 0 and time.perf_counter() >= deadline:
            break
        temperature = t_start * (t_end / t_start) ** (evaluations / config.max_evaluations)
        a = int(rng.integers(num_groups))
        if pool_size and rng.random() < pool_size / (pool_size + state.groups.size):
            b, q = -1, int(rng.integers(pool_size))
        else:
            b = int(rng.integers(num_groups - 1))
            b += b >= a
            q = int(rng.integers(size))
        # Metropolis with the random draw moved into a threshold, so a swap whose all-reduce
        # term alone already exceeds it is rejected before its pipeline edges are priced.
        threshold = state.total - temperature * math.log(1.0 - rng.random())
        evaluations += 1
        if state.price_swap(a, int(rng.integers(size)), b, q, reject_above=threshold) < threshold:
            state.commit()
            if state.total < best_total - 1e-12:
                best, best_total = (state.groups.copy(), state.pool.copy()), state.total
    return best, best_total, evaluations


def _starts(model: CostModel, labels: np.ndarray, initial: Sequence[Placement]) -> list[Placement]:
    """Supplied placements, then block-striped ones for every block size and device order."""
    blocks = [b for b in range(1, model.num_stages + 1) if model.num_stages % b == 0]
    orders = [None] + (type_orders(labels) if labels.max() + 1 < labels.size else [])
    starts = list(initial) + [grid_groups(model)]
    starts += [block_striped_groups(model, b, order) for order in orders for b in blocks]
    return starts


def _count_chains(
    typed: TypedCost, starts: list[Placement], config: SearchConfig, rng: np.random.Generator, target: float
) -> tuple[Placement | None, float, int]:
    """Count-matrix annealing from the best distinct starts (see ``counts``); None where no chain ran."""
    schedule = AnnealSchedule(config.max_evaluations, config.start_temperature, config.end_temperature, target)
    best: Placement | None = None
    best_total, evaluations, seen = np.inf, 0, set[bytes]()
    for groups, pool in starts:
        if len(seen) == config.num_chains or best_total <= target:
            break
        counts = groups_to_counts(typed.labels, typed.num_types, groups)
        key = np.sort([row.tobytes() for row in counts]).tobytes()
        if key in seen:
            continue
        seen.add(key)
        unused = np.bincount(typed.labels[np.asarray(pool, dtype=np.int64)], minlength=typed.num_types)
        found, _, total, count = anneal_counts(CountState(typed, counts, unused), schedule, rng)
        evaluations += count
        if total < best_total:
            device_groups, left = counts_to_groups(typed.labels, found)
            best, best_total = (np.array(device_groups), np.array(left, dtype=np.int64)), total
    return best, best_total, evaluations


def _device_chains(
    fast: FastCost,
    starts: list[Placement],
    config: SearchConfig,
    rng: np.random.Generator,
    deadline: float,
    target: float,
) -> tuple[Placement, float, int]:
    best, best_total, evaluations = starts[0], fast.total(starts[0][0]), 0
    for groups, pool in starts[: config.num_chains]:
        if best_total <= target:
            break
        found, total, count = _anneal(SwapState(fast, groups, pool), rng, config, deadline, target)
        evaluations += count
        if total < best_total:
            best, best_total = found, total
    return best, best_total, evaluations


def _prove(
    model: CostModel, typed: TypedCost, bound: Optional[float], target: float, best_total: float, deadline: float
) -> tuple[bool, Optional[float]]:
    """Whether the phase-1 cost is proven optimal for equal groups, and the best proven bound;
    the certificate needs interchangeable devices (it works on count rows)."""
    if bound is None:
        return False, None
    if best_total <= target:
        return True, bound
    if typed.num_types == model.num_devices or time.perf_counter() >= deadline:
        return False, bound
    if certify_optimal(typed, best_total, deadline):
        return True, best_total
    return False, certified_lower_bound(typed, bound, best_total, deadline=deadline)


def search(model: CostModel, config: SearchConfig, initial: Sequence[Placement] = ()) -> SearchResult:
    """Find a low-cost allocation; never worse than ``initial`` or the constructive starts."""
    from swarm.planner.uneven import improve_uneven  # phase 2 lives in its own module

    began = time.perf_counter()
    deadline = began + config.time_budget_s
    fast = FastCost(model)
    rng = np.random.default_rng(config.seed)
    typed = TypedCost(model)
    bound = lower_bound(model, typed) if config.use_lower_bound else None
    target = -np.inf if bound is None else bound * (1.0 + 1e-9)
    starts = sorted(_starts(model, typed.labels, initial), key=lambda p: fast.total(p[0]))
    if typed.num_types < model.num_devices:
        best, best_total, evaluations = _count_chains(typed, starts, config, rng, target)
    else:
        best, best_total, evaluations = _device_chains(fast, starts, config, rng, deadline, target)
    if best is None or fast.total(starts[0][0]) <= best_total:
        best, best_total = starts[0], fast.total(starts[0][0])
    groups, unused = [list(map(int, row)) for row in best[0]], [int(d) for d in best[1]]
    if config.allow_uneven:
        groups, unused, count = improve_uneven(model, groups, unused, deadline)
        evaluations += count
    hit_cap = time.perf_counter() >= deadline  # the allocation is final; what follows only proves
    proven, bound = _prove(model, typed, bound, target, best_total, deadline)
    breakdown = model.evaluate(groups, unused)
    return SearchResult(breakdown, time.perf_counter() - began, evaluations, bound, hit_cap, proven)
