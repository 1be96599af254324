"""Network-aware allocation of pipeline stages and data-parallel groups.

Pure library (numpy/scipy, no I/O beyond its packaged data): the cost model of Yuan et al.,
NeurIPS 2022, with per-device compute and unequal groups as extensions; the paper's five
scenarios; baselines; the paper's genetic search; and our annealing search.
"""

from swarm.planner.baselines import best_of_random, grid_placement, random_costs, random_placements
from swarm.planner.cost import Allocation, CostBreakdown, CostModel
from swarm.planner.genetic import GeneticConfig, genetic_search
from swarm.planner.matching import bottleneck_value
from swarm.planner.network import Network
from swarm.planner.network_file import NetworkFileError, load_network_file
from swarm.planner.path import cheapest_path, path_cost
from swarm.planner.planning import PlanConfig, PlanReport, make_plan
from swarm.planner.scenarios import SCENARIOS, load_scenario, scenario_description
from swarm.planner.search import SearchConfig, SearchResult, search
from swarm.planner.workload import Workload

__all__ = [
    "Allocation",
    "CostBreakdown",
    "CostModel",
    "GeneticConfig",
    "Network",
    "NetworkFileError",
    "PlanConfig",
    "PlanReport",
    "SCENARIOS",
    "SearchConfig",
    "SearchResult",
    "Workload",
    "best_of_random",
    "bottleneck_value",
    "cheapest_path",
    "genetic_search",
    "grid_placement",
    "load_network_file",
    "load_scenario",
    "make_plan",
    "path_cost",
    "random_costs",
    "random_placements",
    "scenario_description",
    "search",
]
