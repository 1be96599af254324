"""One call that plans an allocation and prices the baselines next to it (used by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from swarm.planner.baselines import best_of_random, grid_placement, random_costs
from swarm.planner.cost import CostBreakdown, CostModel
from swarm.planner.genetic import GeneticConfig, genetic_search
from swarm.planner.network import Network
from swarm.planner.search import SearchConfig, SearchResult, search
from swarm.planner.workload import Workload

__all__ = ["PlanConfig", "PlanReport", "make_plan"]


@dataclass(frozen=True)
class PlanConfig:
    """num_random: placements averaged for the random baseline; num_best_of: K of best-of-K;
    run_genetic: also run the paper's GA for the same budget; search: our search's settings."""

    search: SearchConfig = SearchConfig()
    num_random: int = 100
    num_best_of: int = 1000
    run_genetic: bool = False

    def __post_init__(self) -> None:
        if self.num_random < 1:
            raise ValueError(f"num_random must be positive, got {self.num_random!r}")
        if self.num_best_of < 1:
            raise ValueError(f"num_best_of must be positive, got {self.num_best_of!r}")


@dataclass(frozen=True)
class PlanReport:
    ours: SearchResult
    random_mean_s: float
    best_of_random_s: float
    grid: CostBreakdown
    genetic: Optional[SearchResult]


def make_plan(network: Network, workload: Workload, config: PlanConfig) -> PlanReport:
    """Plan with our search (seeded with the best random placement) and price the baselines."""
    model = CostModel(network, workload)
    seed = config.search.seed
    mean = float(np.mean(random_costs(model, config.num_random, seed)))
    best_placement, best_s = best_of_random(model, config.num_best_of, seed + 1)
    ours = search(model, config.search, initial=[best_placement])
    genetic = None
    if config.run_genetic:
        genetic = genetic_search(model, GeneticConfig(time_budget_s=config.search.time_budget_s, seed=seed))
    return PlanReport(ours, mean, best_s, grid_placement(model), genetic)
