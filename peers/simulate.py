"""``swarm simulate``: the swarm under churn at scale, with and without rebalancing, vs the optimum."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List

from swarm.policy.rebalance import RebalanceConfig
from swarm.simulate import SimConfig, run_experiment
from swarm.config.simulation import DEFAULT_SIM_REBALANCE, JOIN_POLICY_NAMES, StepSimConfig


def _floats(text: str) -> tuple:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="swarm simulate", description=__doc__)
    p.add_argument("--peers", type=int, default=d.num_peers, help="peers at start (joins keep the mean there)")
    p.add_argument("--stages", type=int, default=d.num_stages, help="pipeline stages")
    p.add_argument("--hours", type=float, default=d.hours, help="simulated hours")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds hardware, churn, routing, jitter")
    p.add_argument("--throughputs", type=_floats, default=(), help="comma list of compute samples/s, cycled over peers")
    p.add_argument("--lifetime_h", type=float, default=d.mean_lifetime_h, help="mean hours until preemption")
    p.add_argument("--join_rate_per_h", type=float, default=None, help="joins per hour (default: steady state)")
    p.add_argument("--crash_fraction", type=float, default=d.crash_fraction, help="preemptions without notice")
    p.add_argument("--trainers", type=int, default=d.num_trainers, help="number of trainers")
    p.add_argument("--trace", default=None, help="churn trace CSV: time_s,event,peer_id[,compute]")
    r = DEFAULT_SIM_REBALANCE
    p.add_argument("--period_s", type=float, default=r.period_s, help="mean seconds between rebalancing decisions")
    p.add_argument("--min_gain", type=float, default=r.min_gain, help="relative gain a move must clear")
    p.add_argument("--max_movers", type=int, default=r.max_movers_per_period, help="movers per period")
    p.add_argument(
        "--static_join",
        choices=JOIN_POLICY_NAMES,
        default=d.static_join_policy,
        help="how joining peers choose a stage in the baseline run without rebalancing: 'random' = "
        "uniformly, no load awareness (the SWARM paper's baseline); 'auto' = the live --stage auto "
        "policy (the rebalanced run always uses it)",
    )
    st = d.steps
    p.add_argument(
        "--target_batch_size",
        type=int,
        default=st.target_batch_size,
        help="samples per global step (the step protocol runs in the rebalanced run)",
    )
    p.add_argument(
        "--stage_param_mib",
        type=float,
        default=st.stage_param_mib,
        help="MiB of gradients each replica averages per step",
    )
    p.add_argument(
        "--overlap_averaging",
        choices=("true", "false"),
        default="true" if st.overlap_averaging else "false",
        help="replicas accumulate the next step while a step is averaged (the live --overlap_averaging)",
    )
    p.add_argument("--steps", choices=("true", "false"), default="true", help="simulate the global-step protocol")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line (last line)")
    return p


def main(argv: List[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config = SimConfig(
            num_peers=args.peers,
            num_stages=args.stages,
            hours=args.hours,
            seed=args.seed,
            throughput_list=args.throughputs,
            mean_lifetime_h=args.lifetime_h,
            join_rate_per_h=args.join_rate_per_h,
            crash_fraction=args.crash_fraction,
            num_trainers=args.trainers,
            trace_path=args.trace,
            static_join_policy=args.static_join,
            steps=StepSimConfig(
                enabled=args.steps == "true",
                target_batch_size=args.target_batch_size,
                stage_param_mib=args.stage_param_mib,
                overlap_averaging=args.overlap_averaging == "true",
            ),
            rebalance=RebalanceConfig(
                period_s=args.period_s,
                period_jitter=DEFAULT_SIM_REBALANCE.period_jitter,
                min_gain=args.min_gain,
                max_movers_per_period=args.max_movers,
            ),
        )
    except ValueError as error:
        print(f"swarm simulate: {error}", file=sys.stderr)
        return 2
    summary = run_experiment(config)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"{config.num_peers} peers, {config.num_stages} stages, {config.hours:g} h, seed {config.seed}; "
        f"rebalanced: auto join + moves every {config.rebalance.period_s:g} s; "
        f"static: {config.static_join_policy} join, no moves"
    )
    print("hour  optimal  rebalanced  static  (samples/s)")
    step = max(1, len(summary["series_hours"]) // 24)
    for i in range(0, len(summary["series_hours"]), step):
        print(
            f"{summary['series_hours'][i]:5.1f} {summary['series_optimal'][i]:8.1f} "
            f"{summary['series_rebalanced'][i]:10.1f} {summary['series_static'][i]:7.1f}"
        )
    print(
        f"fraction of optimal: rebalanced {summary['fraction_of_optimal_rebalanced']:.3f}, "
        f"static {summary['fraction_of_optimal_static']:.3f}; {summary['moves']} moves; {summary['wall_s']} s"
    )
    steps = summary["steps"]
    if steps is not None:
        print(
            f"global steps (rebalanced run): {steps['global_steps_per_hour']:.1f}/h; samples per step "
            f"{steps['samples_per_step_mean']:.0f} +- {steps['samples_per_step_std']:.0f} (p5 "
            f"{steps['samples_per_step_p5']:.0f}, p95 {steps['samples_per_step_p95']:.0f}) for a target of "
            f"{steps['target_batch_size']}; waiting {steps['wait_replica_s']:.0f} replica-s "
            f"({100 * steps['wait_fraction_of_replica_time']:.1f}% of replica time: "
            + ", ".join(f"{k} {v:.0f}" for k, v in steps["wait_replica_s_by_cause"].items())
            + f"); {steps['steps_alone']} steps alone, {steps['resyncs']} resyncs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
