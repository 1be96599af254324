"""Planner benchmark: the paper's five scenarios (24 layers, batch 1024), ours vs baselines vs GA.

Prints a table, then as its last line a JSON list with one object per scenario. Our search
runs on its deterministic evaluation budget (stopping early at the proven lower bound); the
paper's genetic algorithm gets a fixed wall-clock budget at least as long as ours took, same
seed. ``lower_bound_s`` is a proven bound on the optimum of the paper's equal-group problem.
Usage: python benchmarks/planner.py [--ga_budget 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from swarm.planner import (  # noqa: E402
    SCENARIOS, CostModel, GeneticConfig, SearchConfig, Workload, best_of_random, genetic_search,
    grid_placement, load_scenario, random_costs, search,
)


def run_scenario(name: str, ga_budget_s: float, seed: int) -> dict:
    model = CostModel(load_scenario(name), Workload(num_layers=24, global_batch=1024))
    random_mean = float(np.mean(random_costs(model, 100, seed)))
    best_placement, best_s = best_of_random(model, 1000, seed + 1)
    ours = search(model, SearchConfig(seed=seed), initial=[best_placement])
    ga = genetic_search(model, GeneticConfig(time_budget_s=max(ga_budget_s, ours.solve_s), seed=seed))
    b = ours.breakdown
    return {
        "scenario": name, "ours_cost_s": round(b.total_s, 3), "ours_dp_s": round(b.dp_s, 3),
        "ours_pipeline_s": round(b.pipeline_s, 3), "ours_unused": len(b.allocation.unused),
        "random_cost_s": round(random_mean, 3), "best_of_1000_random_cost_s": round(best_s, 3),
        "grid_cost_s": round(grid_placement(model).total_s, 3), "ga_cost_s": round(ga.breakdown.total_s, 3),
        "lower_bound_s": round(ours.lower_bound_s, 3), "ours_proven_optimal": ours.proven_optimal,
        "ours_hit_time_cap": ours.hit_time_cap,
        "ours_solve_s": round(ours.solve_s, 2), "ga_solve_s": round(ga.solve_s, 2),
        "ours_vs_random": round(b.total_s / random_mean, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ga_budget", type=float, default=20.0, help="GA seconds (at least ours)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    began = time.perf_counter()
    rows = [run_scenario(name, args.ga_budget, args.seed) for name in SCENARIOS]
    head = (f"{'scenario':<24}{'ours':>8}{'GA':>8}{'random':>8}{'best1k':>8}{'grid':>8}{'bound':>8}"
            f"{'ours/rnd':>9}{'solve_s':>8}  optimal")
    print(head)
    for r in rows:
        print(f"{r['scenario']:<24}{r['ours_cost_s']:>8.2f}{r['ga_cost_s']:>8.2f}{r['random_cost_s']:>8.2f}"
              f"{r['best_of_1000_random_cost_s']:>8.2f}{r['grid_cost_s']:>8.2f}{r['lower_bound_s']:>8.2f}"
              f"{r['ours_vs_random']:>9.3f}"
              f"{r['ours_solve_s']:>8.1f}  {'proven' if r['ours_proven_optimal'] else '-'}")
    print(f"(seconds per iteration; GA budget max({args.ga_budget:g} s, ours); bound = proven lower bound, "
          f"equal groups; optimal = proven optimal for equal groups; total {time.perf_counter() - began:.0f} s)")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
