"""``swarm plan``: allocate pipeline stages over a heterogeneous network and show the baselines.

Thin role: parse flags into configs, call ``swarm.planner.make_plan``, print. A bad network
file is refused with exit code 2 and a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import sys

from swarm.planner import (
    SCENARIOS,
    NetworkFileError,
    PlanConfig,
    SearchConfig,
    Workload,
    load_network_file,
    load_scenario,
    make_plan,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarm plan", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--scenario", choices=SCENARIOS, default="world-wide", help="one of the paper's networks")
    src.add_argument(
        "--network",
        help="your own network: .json (latency_ms, bandwidth_gbps, "
        "optional compute_tflops, names) or .csv (device_a,device_b,latency_ms,bandwidth_gbps)",
    )
    p.add_argument("--layers", type=int, default=24, help="transformer blocks")
    p.add_argument("--batch", type=int, default=1024, help="global batch, sequences")
    p.add_argument("--stages", type=int, default=8, help="pipeline stages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time_budget",
        type=float,
        default=60.0,
        help="wall-clock cap in seconds (the search and its proof usually end sooner)",
    )
    p.add_argument("--num_random", type=int, default=100, help="random placements averaged")
    p.add_argument("--best_of", type=int, default=1000, help="K of the best-of-K baseline")
    p.add_argument("--equal_groups", action="store_true", help="paper's formulation only: all devices, equal groups")
    p.add_argument("--genetic", action="store_true", help="also run the paper's genetic search for the same budget")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    return p


def _print_report(report, network) -> None:
    b = report.ours.breakdown
    print(f"pipeline order ({len(b.allocation.stages)} stages, first stage first):")
    for k, group in enumerate(b.allocation.stages):
        print(f"  stage {k}: " + ", ".join(network.names[d] for d in group))
    if b.allocation.unused:
        print("  left out: " + ", ".join(network.names[d] for d in b.allocation.unused))
    print(
        f"iteration time {b.total_s:.2f} s = stage {b.stage_s:.2f} s (all-reduce {b.dp_s:.2f} s, "
        f"compute {b.compute_s:.2f} s) + 2 x pipeline {b.pipeline_s:.2f} s; solved in {report.ours.solve_s:.1f} s"
    )
    if report.ours.proven_optimal:
        print(f"proven optimal among equal-group allocations (lower bound {report.ours.lower_bound_s:.2f} s)")
    elif report.ours.lower_bound_s is not None:
        print(f"proven lower bound for equal-group allocations: {report.ours.lower_bound_s:.2f} s")
    print(
        f"baselines: random mean {report.random_mean_s:.2f} s, best of K random {report.best_of_random_s:.2f} s, "
        f"grid {report.grid.total_s:.2f} s"
    )
    if report.genetic is not None:
        print(f"paper's genetic search, same budget: {report.genetic.breakdown.total_s:.2f} s")


def _summary(report, network) -> dict:
    b = report.ours.breakdown
    return {
        "stages": [[network.names[d] for d in g] for g in b.allocation.stages],
        "unused": [network.names[d] for d in b.allocation.unused],
        "total_s": b.total_s,
        "dp_s": b.dp_s,
        "pipeline_s": b.pipeline_s,
        "compute_s": b.compute_s,
        "solve_s": report.ours.solve_s,
        "random_mean_s": report.random_mean_s,
        "best_of_random_s": report.best_of_random_s,
        "grid_s": report.grid.total_s,
        "genetic_s": None if report.genetic is None else report.genetic.breakdown.total_s,
        "lower_bound_s": report.ours.lower_bound_s,
        "proven_optimal": report.ours.proven_optimal,
    }


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        network = load_network_file(args.network) if args.network else load_scenario(args.scenario)
        workload = Workload(num_layers=args.layers, global_batch=args.batch, num_stages=args.stages)
        search = SearchConfig(time_budget_s=args.time_budget, seed=args.seed, allow_uneven=not args.equal_groups)
        config = PlanConfig(
            search=search, num_random=args.num_random, num_best_of=args.best_of, run_genetic=args.genetic
        )
        report = make_plan(network, workload, config)
    except NetworkFileError as e:
        print(f"swarm plan: bad network file: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"swarm plan: {e}", file=sys.stderr)
        return 2
    _print_report(report, network)
    if args.json:
        print(json.dumps(_summary(report, network)))
    return 0
