"""Alignment benchmark: what the robust round's alignment check sees, catches and costs, on real gradients.

Why: a replica that negates its gradient at its own norm passes every distance test; the alignment check
(:mod:`swarm.policy.alignment`) judges the cosines between groupmates' gradients over many rounds instead.
Its threshold must hold for the cosines honest replicas really have, which only real gradients show; and its
cost, computed on every round, must stay small next to the aggregation it sits in.

What runs (in this process, no network: the aggregation, the check, the faults and the optimizer are the
swarm's own; the pipeline and the wire are left out):

  training    R emulated replicas (``--replicas`` per attack) of the test model (2 layers, hidden 32,
              2 stages; as ``tests/test_convergence.py``) train ``--steps`` steps data-parallel: each replica
              computes its gradient on its own ``--batch_size`` samples, the attackers' gradients go through
              :class:`swarm.server.faults.GradientFault` as a faulty replica's averager sends them, every stage's
              gradients are combined by :func:`swarm.policy.aggregation.robust_aggregate`, the cosines go to an
              :class:`swarm.policy.alignment.AlignmentRecord` (one per stage, as each honest averager keeps
              it), and a replica it accuses leaves the rounds of every stage from the next step on; its share of
              each step's samples is then computed by the honest replicas (as trainers route around a banned
              replica), so every run trains on the same samples. Each attack runs with the check on and off, beside a
              clean run of R honest replicas, on the same samples and initialisation; mean over ``--seeds``.
  cost        the time of :func:`robust_aggregate` with the check and without it, side by side, for
              ``--cost_sizes`` gradient values and R in ``--cost_replicas`` (median of ``--cost_repeats``).

Figures, per attack: ``accused_at_step`` (per seed: the step after which the attackers were all out; null =
never), ``honest_accused`` (honest replicas accused, summed over seeds and runs, clean runs included: must be
0), ``loss_clean``, ``loss_check_on``, ``loss_check_off`` (validation loss at the end) and
``loss_vs_clean_check_on``/``_off`` (mean relative excess over the clean run of the same seed). Honest
cosines: mean, standard deviation and share below zero of every honest pair's cosine in the clean runs.
Cost, per size and R: ``aggregate_ms_without_check``, ``check_ms`` (:func:`pair_cosines` alone, on the same
gradients, measured in turns with the aggregation), ``check_share`` (of both) and ``extra_bytes`` (0: the check
reads the gradients the round already exchanged and sends nothing).

Usage: python benchmarks/alignment.py [--attacks same_norm_sign_flip,...] [--steps 60] [--seeds 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _records import add_record_arguments, write_record  # noqa: E402

from swarm.model.gpt import ModelConfig  # noqa: E402
from swarm.model.stages import FullModel  # noqa: E402
from swarm.policy.aggregation import AggregationConfig, robust_aggregate  # noqa: E402
from swarm.policy.alignment import AlignmentRecord, pair_cosines  # noqa: E402
from swarm.server.faults import GradientFault  # noqa: E402
from swarm.training.data import load_corpus, validation_batches  # noqa: E402
from swarm.training.optimizer import OptimizerConfig, make_optimizer, optimizer_step  # noqa: E402
from swarm.training.single_process import evaluate  # noqa: E402
from swarm.training.tokenized import make_sampler  # noqa: E402

TEST_MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)  # as tests/test_convergence.py
NUM_STAGES = 2


@dataclass(frozen=True)
class Attack:
    name: str
    fault: str  # the attackers' GradientFault
    replicas: int
    attackers: int


ATTACKS = {a.name: a for a in (
    Attack("same_norm_sign_flip", "same_norm_sign_flip", 3, 1),
    Attack("colluding_pair_sign_flip", "same_norm_sign_flip", 5, 2),
    Attack("colluding_pair_little_is_enough", "little_is_enough", 5, 2),
)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    p.add_argument("--steps", type=int, default=60, help="steps of each training run")
    p.add_argument("--seeds", default="1,2,3", help="one training run per seed, attack and setting")
    p.add_argument("--batch_size", type=int, default=16, help="samples per replica per step")
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--cost_sizes", default="100000,1000000,10000000", help="gradient values for the cost figures")
    p.add_argument("--cost_replicas", default="3,5,8", help="replicas per round for the cost figures")
    p.add_argument("--cost_repeats", type=int, default=3)
    add_record_arguments(p)
    args = p.parse_args()
    unknown = [a for a in args.attacks.split(",") if a not in ATTACKS]
    if unknown:
        p.error(f"unknown attacks {unknown}; known: {list(ATTACKS)}")
    return args


@dataclass
class Outcome:
    loss: float
    accused_at_step: Optional[int]  # the step after which every attacker was out; None = not all were
    honest_accused: int
    honest_cosines: List[float]


def train(replicas: int, attackers: int, fault: str, check: bool, seed: int, args, corpus, batches) -> Outcome:
    """Validation loss after ``--steps`` steps of ``replicas`` emulated replicas, the first ``attackers`` faulty."""
    torch.manual_seed(seed)
    model = FullModel(TEST_MODEL, NUM_STAGES, 0)
    stage_params = [list(stage.parameters()) for stage in model.stages]
    optimizer_config = OptimizerConfig(lr=args.lr)
    optimizers = [make_optimizer(params, optimizer_config) for params in stage_params]
    names = [f"{'x' if r < attackers else 'h'}{r}" for r in range(replicas)]
    samplers = {name: make_sampler(corpus, TEST_MODEL.seq_len, args.batch_size, 10 * seed + r)
                for r, name in enumerate(names)}
    faults = {name: [GradientFault(fault if name.startswith("x") else "none", seed=r) for _ in stage_params]
              for r, name in enumerate(names)}
    aggregation = AggregationConfig(alignment_rounds=AggregationConfig().alignment_rounds if check else 0)
    records = [AlignmentRecord(aggregation.alignment) for _ in stage_params]
    out: Dict[str, int] = {}  # accused replica -> the step it was accused at
    honest_cosines: List[float] = []
    for step in range(args.steps):
        active = [n for n in names if n not in out]
        hosts = [n for n in active if n.startswith("h")]
        honest_sums: Dict[str, List[torch.Tensor]] = {}  # active replica -> its stages' summed honest gradients
        claims: Dict[str, float] = dict.fromkeys(active, 0.0)
        for index, name in enumerate(names):  # every replica's samples, an excluded one's computed by an honest host
            host = name if name in claims else hosts[index % len(hosts)]
            inputs, targets = samplers[name].sample()
            model.zero_grad(set_to_none=True)
            model(inputs, targets).backward()
            grads = [torch.cat([p.grad.reshape(-1) for p in params]) for params in stage_params]
            summed = honest_sums.get(host)
            honest_sums[host] = grads if summed is None else [s + g for s, g in zip(summed, grads)]
            claims[host] += float(args.batch_size)
        sent: List[Dict[str, torch.Tensor]] = [{} for _ in stage_params]
        for name in active:
            batches_held = claims[name] / args.batch_size
            for stage in range(len(stage_params)):
                mean = honest_sums[name][stage] / batches_held
                sent[stage][name] = faults[name][stage].corrupt([mean])[0]
        for stage, params in enumerate(stage_params):
            aggregate = robust_aggregate(sent[stage], claims, aggregation)
            if aggregate.vector is None:
                raise RuntimeError("the aggregation left every replica out")
            honest_cosines += [c for (a, b), c in pair_cosines(sent[stage]).items() if a[0] == b[0] == "h"]
            if check:
                records[stage].add(aggregate.cosines)
                for accused in records[stage].opposed():
                    out.setdefault(accused, step + 1)
                records[stage].forget(out)
            offset = 0
            for p in params:
                p.grad = aggregate.vector[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
                offset += p.numel()
            optimizer_step(params, optimizers[stage], optimizer_config)
    attackers_out = [out.get(n) for n in names if n.startswith("x")]
    accused_at = max(attackers_out) if attackers_out and None not in attackers_out else None
    return Outcome(evaluate(model, batches), accused_at, sum(1 for n in out if n.startswith("h")), honest_cosines)


def cost_row(size: int, replicas: int, repeats: int) -> Dict[str, Any]:
    """The aggregation's time without the check and the check's own (:func:`pair_cosines` on the same gradients,
    what it adds to a round), measured side by side, for ``replicas`` gradients of ``size`` values."""
    generator = torch.Generator().manual_seed(size + replicas)
    truth = torch.randn(size, generator=generator)
    grads = {f"r{i}": truth + torch.randn(size, generator=generator) for i in range(replicas)}
    claims = dict.fromkeys(grads, 16.0)
    config = AggregationConfig(alignment_rounds=0)
    timings: Dict[str, List[float]] = {"aggregate": [], "check": []}
    for _ in range(repeats):  # taking turns
        started = time.perf_counter()
        robust_aggregate(grads, claims, config)
        timings["aggregate"].append(1000 * (time.perf_counter() - started))
        started = time.perf_counter()
        pair_cosines(grads)
        timings["check"].append(1000 * (time.perf_counter() - started))
    aggregate, check = statistics.median(timings["aggregate"]), statistics.median(timings["check"])
    return {"size": size, "replicas": replicas, "aggregate_ms_without_check": round(aggregate, 1),
            "check_ms": round(check, 1), "check_share": round(check / (aggregate + check), 4), "extra_bytes": 0,
            "raw_ms": {k: [round(t, 2) for t in v] for k, v in timings.items()}}


def main(args) -> Tuple[List[dict], Dict[str, list]]:
    torch.set_num_threads(1)
    corpus = load_corpus(None, max_bytes=2 * 2**20)
    batches = validation_batches(corpus.validation, TEST_MODEL.seq_len, batch_size=32, num_batches=8)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: List[dict] = []
    raw: Dict[str, list] = {}
    clean: Dict[Tuple[int, int], Outcome] = {}
    for name in args.attacks.split(","):
        attack = ATTACKS[name]
        runs: Dict[str, List[Outcome]] = {"on": [], "off": [], "clean": []}
        for seed in seeds:
            if (attack.replicas, seed) not in clean:
                clean[(attack.replicas, seed)] = train(attack.replicas, 0, "none", True, seed, args, corpus, batches)
            runs["clean"].append(clean[(attack.replicas, seed)])
            for setting, check in (("on", True), ("off", False)):
                runs[setting].append(train(attack.replicas, attack.attackers, attack.fault, check, seed, args, corpus,
                                           batches))
            print(f"{name} seed {seed}: loss clean {runs['clean'][-1].loss:.4f}, check on {runs['on'][-1].loss:.4f} "
                  f"(attackers out after step {runs['on'][-1].accused_at_step}), off {runs['off'][-1].loss:.4f}",
                  flush=True)
        excess = {s: [(o.loss - c.loss) / c.loss for o, c in zip(runs[s], runs["clean"])] for s in ("on", "off")}
        cosines = [c for o in runs["clean"] for c in o.honest_cosines]
        rows.append({
            "attack": name, "replicas": attack.replicas, "attackers": attack.attackers, "steps": args.steps,
            "accused_at_step": [o.accused_at_step for o in runs["on"]],
            "honest_accused": sum(o.honest_accused for s in runs.values() for o in s),
            "loss_clean": round(statistics.mean(o.loss for o in runs["clean"]), 4),
            "loss_check_on": round(statistics.mean(o.loss for o in runs["on"]), 4),
            "loss_check_off": round(statistics.mean(o.loss for o in runs["off"]), 4),
            "loss_vs_clean_check_on": round(statistics.mean(excess["on"]), 5),
            "loss_vs_clean_check_off": round(statistics.mean(excess["off"]), 5),
            "honest_cosine_mean": round(statistics.mean(cosines), 4),
            "honest_cosine_std": round(statistics.stdev(cosines), 4),
            "honest_cosine_below_zero": round(sum(c < 0 for c in cosines) / len(cosines), 4),
        })
        for s in ("on", "off"):
            raw[f"loss_vs_clean[{name}, check {s}]"] = [round(e, 5) for e in excess[s]]
    for size in [int(s) for s in args.cost_sizes.split(",")]:
        for replicas in [int(r) for r in args.cost_replicas.split(",")]:
            row = cost_row(size, replicas, args.cost_repeats)
            for kind, values in row.pop("raw_ms").items():
                raw[f"{kind}_ms[{size} values, R={replicas}]"] = values
            rows.append(row)
            print(f"cost: {size} values, R={replicas}: aggregation {row['aggregate_ms_without_check']} ms, the check "
                  f"{row['check_ms']} ms more ({row['check_share']:.1%} of both)", flush=True)
    return rows, raw


if __name__ == "__main__":
    arguments = parse_args()
    summary, raw_values = main(arguments)
    write_record("alignment", arguments, summary, raw=raw_values, notes=[
        "Emulated data-parallel training in one process: the swarm's aggregation, alignment check, faults and "
        "optimizer; no network, no pipeline.",
        "accused_at_step is per seed; honest_accused sums over every run of the attack, clean runs included.",
        "check_ms is the median time of pair_cosines on the round's gradients, measured in turns with the "
        "aggregation without the check."])
    print(json.dumps(summary), flush=True)
