"""Merged vs one-by-one requests on a stage's compute thread: CPU milliseconds per micro-batch.

Why: a peer merges concurrent requests into one module call (``swarm/server/batching.py``) when that
saves compute. This script measures, on the model and micro-batch size the examples use, what merging
saves or costs for each kind of request, so that the peer's defaults follow the figures.

What runs, in this process with one torch thread and no network (merging changes only compute): one
StageRunner per stage of the examples' model (``examples/peer.yaml``: 4 layers, hidden 128, 4 heads,
seq 64, 2 stages; defences on), and for each merge count N (``--merge_counts``) N micro-batches of
``--batch_size`` samples:
  last forward   the last stage's evaluation forward: N ``runner.forward`` calls alone vs one
                 ``forward_per_sample`` call on the concatenation (what ForwardBatcher runs).
  backward s     stage s's backward, recomputing its forward as a cache miss does (the last stage's
                 training call is always one): N ``runner.backward`` calls vs one ``backward_batch``
                 (one vectorised call, every micro-batch's gradient clipped and accounted alone).
  summed s       one backward of the concatenated micro-batches whose parameter gradients come out
                 summed: what a merge would cost if micro-batches needed no gradient of their own (they
                 do, for the per-micro-batch clip): the floor any exact merge could reach.
Each figure is CPU time (``time.process_time``) per micro-batch, the best of ``--repeats`` runs (the
machine is shared; the best run is the least disturbed), with fresh micro-batch ids every run. The run's
record (``benchmarks/_records.py``) keeps every repeat's time, so the spread behind each best is there too.

Usage: python benchmarks/batching.py [--merge_counts 2 4 8] [--batch_size 8] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _records import add_record_arguments, write_record  # noqa: E402
from swarm.config.settings import RunConfig  # noqa: E402
from swarm.model.gpt import ModelConfig  # noqa: E402
from swarm.server.runner import StageRunner  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--merge_counts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=64)
    add_record_arguments(parser)
    args = parser.parse_args()
    if args.repeats < 1 or not args.merge_counts or min(args.merge_counts) < 1 or args.batch_size < 1:
        parser.error("--repeats, --batch_size and every --merge_counts entry must be at least 1")
    return args


def best_ms(run: Callable[[int], None], repeats: int, count: int, every: Optional[List[float]] = None) -> float:
    """Best CPU time of ``run(repeat)`` over ``repeats`` runs, in ms per micro-batch (one warm-up run first);
    each run's figure is appended to ``every``."""
    run(-1)
    times = []
    for repeat in range(repeats):
        start = time.process_time()
        run(repeat)
        times.append(time.process_time() - start)
    if every is not None:
        every.extend(t * 1000 / count for t in times)
    return min(times) * 1000 / count


def requests(runner: StageRunner, count: int, batch: int, tag: str, generator: torch.Generator) -> List[tuple]:
    config = runner.run.model
    made = []
    for i in range(count):
        if runner.module.is_first:
            inputs = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)
        else:
            inputs = torch.randn(batch, config.seq_len, config.hidden_size, generator=generator)
        targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator) \
            if runner.module.is_last else None
        grad_outputs = None if runner.module.is_last else \
            1e-3 * torch.randn(batch, config.seq_len, config.hidden_size, generator=generator)
        made.append((f"trainer{i % 2}:{tag}:{i}", inputs, grad_outputs, targets))
    return made


def summed_backward(runner: StageRunner, batch: List[tuple]) -> None:
    inputs = torch.cat([r[1] for r in batch])
    leaf = inputs if runner.module.is_first else inputs.detach().requires_grad_(True)
    with torch.enable_grad():
        if runner.module.is_last:
            outputs = runner.module(leaf, torch.cat([r[3] for r in batch]))
            grad_outputs = None
        else:
            outputs, grad_outputs = runner.module(leaf), torch.cat([r[2] for r in batch])
        wrt = runner.params if runner.module.is_first else [leaf] + runner.params
        torch.autograd.grad(outputs, wrt, grad_outputs)


def measure(args: argparse.Namespace, raw: Dict[str, List[float]]) -> Dict[str, Dict[str, float]]:
    """The best figure of each kind of request per merge count; every repeat's figure goes to ``raw``
    (keyed ``<merge count>:<figure>``)."""
    run = RunConfig(num_stages=2, target_batch_size=10**9, model=ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_heads, seq_len=args.seq_len))
    runners = [StageRunner(run, stage) for stage in range(2)]
    generator = torch.Generator().manual_seed(0)
    figures: Dict[str, Dict[str, float]] = {}
    for count in args.merge_counts:
        row: Dict[str, float] = {}
        last = runners[1]
        fixed = requests(last, count, args.batch_size, "fwd", generator)

        def every(key: str, count: int = count) -> List[float]:
            return raw.setdefault(f"{count}:{key}", [])

        row["last_forward_alone"] = best_ms(lambda _: [last.forward(r[1], r[3]) for r in fixed], args.repeats, count,
                                            every("last_forward_alone"))
        row["last_forward_merged"] = best_ms(lambda _: [t.mean() for t in torch.split(last.forward_per_sample(
            torch.cat([r[1] for r in fixed]), torch.cat([r[3] for r in fixed])), args.batch_size)], args.repeats, count,
            every("last_forward_merged"))
        for stage, runner in enumerate(runners):
            batches = {}

            def fresh(repeat: int, kind: str, runner: StageRunner = runner) -> List[tuple]:
                return batches.setdefault((kind, repeat), requests(runner, count, args.batch_size, f"{kind}{repeat}", generator))

            for repeat in range(-1, args.repeats):  # drawn before timing: only compute is measured
                for kind in ("alone", "merged"):
                    fresh(repeat, kind)
            row[f"backward{stage}_alone"] = best_ms(
                lambda repeat: [runner.backward(*r) for r in fresh(repeat, "alone")], args.repeats, count,
                every(f"backward{stage}_alone"))
            row[f"backward{stage}_merged"] = best_ms(
                lambda repeat: runner.backward_batch(fresh(repeat, "merged")), args.repeats, count,
                every(f"backward{stage}_merged"))
            row[f"summed{stage}"] = best_ms(lambda repeat: summed_backward(runner, fresh(repeat, "alone")),
                                            args.repeats, count, every(f"summed{stage}"))
        figures[str(count)] = row
    return figures


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*batching rule.*")  # vmap's fallback for CPU attention: part of what is measured
    raw: Dict[str, List[float]] = {}
    figures = measure(args, raw)
    print(f"ms of CPU per micro-batch of {args.batch_size} samples (best of {args.repeats}), one torch thread:")
    columns = list(next(iter(figures.values())))
    print(f"{'merged':>6} " + " ".join(f"{c:>20}" for c in columns))
    for count, row in figures.items():
        print(f"{count:>6} " + " ".join(f"{row[c]:>20.2f}" for c in columns))
    summary = {"batch_size": args.batch_size, "repeats": args.repeats, "ms_per_micro_batch": figures}
    write_record("batching", args, summary, raw=raw,
                 headline=[{"merged": int(count), **{k: round(v, 2) for k, v in row.items()}}
                           for count, row in figures.items()],
                 notes=["CPU ms per micro-batch (time.process_time, one torch thread), the best of --repeats runs; the "
                        "raw values are every run's figure, keyed <merge count>:<request kind>.",
                        "alone = one call per micro-batch; merged = one call for all of them; summed = the floor an "
                        "exact merge could reach (no per-micro-batch gradients)."])
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
