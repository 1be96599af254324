"""Compression benchmark: bytes per sample on the wire, and loss at equal samples, per compression setting.

Why: at model scale the bytes are the activations between stages and the gradients of each stage's
all-reduce; a codec is worth its bytes only if the run still learns as well on the same samples.

What runs, per setting (the run's ``compression`` for activations and ``gradient_compression`` for the
all-reduce):

  activation_bytes_per_sample  the payload of one sample's activation and its gradient across one stage
                               boundary, encoded by :func:`swarm.net.compression.compress` (float32: 4 bytes
                               a value), for the model of ``--hidden``/``--seq_len``; a ``boundaryN`` setting
                               narrows it to ``hidden / N`` values a token (``model.boundary_dim``).
  allreduce_bytes_per_sample   what one replica sends and receives in a robust round (its gradient to each of
                               the R - 1 others, theirs from them: ``2 (R - 1)`` packed gradients, bytes as
                               :func:`swarm.server.robust_allreduce.pack` makes them) per sample of the step
                               (R replicas x ``--batch_size``), for the stage of the model of ``--hidden``.
  loss                         validation loss after ``--steps`` steps of data-parallel training of the test
                               model (2 layers, hidden 32, 2 stages) by R emulated replicas in this process:
                               each replica computes its gradient on its own micro-batch, sends it through the
                               setting's codec, the decoded gradients are combined by :func:`swarm.policy.aggregation.robust_aggregate`
                               and every stage steps its AdamW. The network and the pipeline are left out: the
                               codecs, the aggregation and the optimizer are the swarm's own. Mean over
                               ``--seeds``; ``loss_vs_uncompressed`` is the mean of each seed's relative excess
                               over the fp32 run of the same seed (same samples, same initialisation).
                               The activations and their gradients go through the setting's codec at the stage
                               boundary as they do on the wire, and a ``boundaryN`` setting trains the test model
                               (``--loss_hidden`` wide) with ``boundary_dim = loss_hidden / N``: its loss is the narrow model's, on the same samples.
                               An ``overlap`` setting applies each step's averaged gradient one step late, as
                               ``--overlap_averaging`` does: the replicas compute step t+1's gradients on the
                               parameters before step t's update; the last step's lands at the end, so it trains
                               on the same samples and applies as many steps.

  tokens_per_s_50mbit          not measured by this script (null): a live 2+2 swarm at 50 Mbit/s is
                               ``benchmarks/wan.py``'s (activations only, one replica a stage).

An emulated run reproduces the live convergence test closely: top-k at 16 of 256 gave +25.9% here at 18
steps and +26.6% in the live 2x2 swarm at 17; ternary -0.04% here (mean of 3 seeds, 20 steps) and -0.34% to +0.07%
live (3 runs of 14-18 steps).

Output: progress lines, then one JSON list, one object per setting: {"setting", "compression",
"gradient_compression", "steps", "boundary_dim", "overlap_averaging", "activation_bytes_per_sample",
"allreduce_bytes_per_sample", "loss", "loss_vs_uncompressed", "tokens_per_s_50mbit"}.

Usage: python benchmarks/compression.py [--settings fp32,int8,int8+ternary] [--steps 20,100,300] [--seeds 1,2,3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _records import add_record_arguments, write_record  # noqa: E402

from swarm.model.gpt import ModelConfig  # noqa: E402
from swarm.model.stages import FullModel, stage_skeleton  # noqa: E402
from swarm.net.compression import compress, decompress, gradient_codec  # noqa: E402
from swarm.policy.aggregation import AggregationConfig, robust_aggregate  # noqa: E402
from swarm.server.robust_allreduce import pack  # noqa: E402
from swarm.training.data import load_corpus, validation_batches  # noqa: E402
from swarm.training.optimizer import OptimizerConfig, make_optimizer, optimizer_step  # noqa: E402
from swarm.training.single_process import evaluate  # noqa: E402
from swarm.training.tokenized import make_sampler  # noqa: E402

# (compression, gradient_compression, how many times the boundary narrows: 1 = not, overlapped averaging)
Setting = Tuple[str, str, int, bool]
SETTINGS: Dict[str, Setting] = {
    "fp32": ("none", "none", 1, False),
    "fp16": ("fp16", "fp16", 1, False),
    "int8": ("int8", "int8", 1, False),
    "fp32+ternary": ("none", "ternary", 1, False),
    "int8+ternary": ("int8", "ternary", 1, False),
    "int8+boundary2": ("int8", "int8", 2, False),
    "int8+boundary4": ("int8", "int8", 4, False),
    "int8+boundary4+ternary": ("int8", "ternary", 4, False),
    "int4": ("int4", "int8", 1, False),
    "int4+boundary2": ("int4", "int8", 2, False),
    "int4+boundary4": ("int4", "int8", 4, False),
    "fp32+overlap": ("none", "none", 1, True),
    "int8+overlap": ("int8", "int8", 1, True),
    "int8+ternary+overlap": ("int8", "ternary", 1, True),
}
TEST_MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)  # as tests/test_convergence.py
BLOCK_SIZE = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--steps", default="20,100,300", help="steps of each training run, comma-separated")
    p.add_argument("--seeds", default="1,2,3", help="one training run per seed and step count")
    p.add_argument("--replicas", type=int, default=2, help="replicas of each stage (R)")
    p.add_argument("--batch_size", type=int, default=36, help="samples per replica per step")
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--hidden", type=int, default=1024, help="width of the model whose bytes per sample are counted")
    p.add_argument("--loss_hidden", type=int, default=TEST_MODEL.hidden_size,
                   help="width of the test model whose loss is measured (heads of 16; 32 = the convergence test's)")
    p.add_argument("--seq_len", type=int, default=64, help="tokens per sample of that model")
    add_record_arguments(p)
    args = p.parse_args()
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    if args.replicas < 2:
        p.error("--replicas: an all-reduce needs at least 2")
    return args


def activation_bytes(codec: str, width: int, seq_len: int) -> int:
    """One sample's activation and its gradient across one boundary ``width`` values a token wide, in ``codec`` (the
    gradient in :func:`~swarm.net.compression.gradient_codec` of it: int8 under int4)."""
    tensor = torch.randn(1, seq_len, width, generator=torch.Generator().manual_seed(0))
    if codec == "none":
        return 2 * 4 * tensor.numel()
    return sum(compress(tensor, c, BLOCK_SIZE).nbytes for c in (codec, gradient_codec(codec)))


def allreduce_bytes(codec: str, hidden: int, seq_len: int, replicas: int, batch_size: int, narrowing: int) -> float:
    """Bytes one replica sends and receives in a robust round, per sample of the step, for stage 0 of a 2-stage
    model of width ``hidden`` (gradient values drawn at random: the byte count depends only on the codec)."""
    config = ModelConfig(num_layers=2, hidden_size=hidden, num_heads=max(1, hidden // 64), seq_len=seq_len,
                         boundary_dim=0 if narrowing == 1 else hidden // narrowing)
    size = sum(p.numel() for p in stage_skeleton(config, 0, 2).parameters())
    packed = pack(torch.randn(size, generator=torch.Generator().manual_seed(0)), codec, BLOCK_SIZE)
    sent = sum(len(chunk.buffer) for chunk in packed.chunks)
    return 2 * (replicas - 1) * sent / (replicas * batch_size)


class _Wire(torch.autograd.Function):
    """The identity, with the value and its gradient each sent through a codec as they cross a stage boundary."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, codec: str) -> torch.Tensor:  # type: ignore[override]
        ctx.codec = codec
        return decompress(compress(hidden, codec, BLOCK_SIZE))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return decompress(compress(grad, gradient_codec(ctx.codec), BLOCK_SIZE)), None


def test_model(narrowing: int, hidden: int) -> ModelConfig:
    """The test model at width ``hidden``, its boundary ``narrowing`` times narrower than its residual stream (1: not
    narrowed)."""
    return dataclasses.replace(TEST_MODEL, hidden_size=hidden, num_heads=max(TEST_MODEL.num_heads, hidden // 16),
                               boundary_dim=0 if narrowing == 1 else hidden // narrowing)


def loss_of(model: FullModel, inputs: torch.Tensor, targets: torch.Tensor, codec: str) -> torch.Tensor:
    """The 2-stage model's loss with stage 0's output sent through ``codec`` to stage 1."""
    hidden = model.stages[0](inputs)
    if codec != "none":
        hidden = _Wire.apply(hidden, codec)
    return model.stages[1](hidden, targets)


def train(setting: Setting, steps: int, seed: int, args: argparse.Namespace, corpus, batches) -> float:
    """Validation loss after ``steps`` steps of R emulated replicas of ``setting``'s model whose activations and
    gradients go through its codecs."""
    activations, codec, narrowing, overlap = setting
    model = FullModel(test_model(narrowing, args.loss_hidden), 2, 0)
    stage_params = [list(stage.parameters()) for stage in model.stages]
    optimizer_config = OptimizerConfig(lr=args.lr)
    optimizers = [make_optimizer(params, optimizer_config) for params in stage_params]
    samplers = [make_sampler(corpus, TEST_MODEL.seq_len, args.batch_size, 10 * seed + r) for r in range(args.replicas)]
    aggregation = AggregationConfig()
    averaging: List[Optional[torch.Tensor]] = [None for _ in stage_params]  # overlapped: each stage's round under way

    def apply(stage: int, combined: torch.Tensor) -> None:
        offset = 0
        for p in stage_params[stage]:
            p.grad = combined[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
        optimizer_step(stage_params[stage], optimizers[stage], optimizer_config)

    for _ in range(steps):
        sent: List[Dict[str, torch.Tensor]] = [{} for _ in stage_params]
        for replica, sampler in enumerate(samplers):
            inputs, targets = sampler.sample()
            model.zero_grad(set_to_none=True)
            loss_of(model, inputs, targets, activations).backward()
            for stage, params in enumerate(stage_params):
                gradient = torch.cat([p.grad.reshape(-1) for p in params])
                sent[stage][f"replica{replica}"] = pack(gradient, codec, BLOCK_SIZE).vector
        for stage, params in enumerate(stage_params):
            claims = {name: float(args.batch_size) for name in sent[stage]}
            combined = robust_aggregate(sent[stage], claims, aggregation).vector
            if combined is None:
                raise RuntimeError("the aggregation left every replica out")
            if overlap:  # this step's average lands once the next step's gradients are computed
                combined, averaging[stage] = averaging[stage], combined
            if combined is not None:
                apply(stage, combined)
    for stage, combined in enumerate(averaging):  # the last round completes: every sample's gradient is applied
        if combined is not None:
            apply(stage, combined)
    return evaluate(model, batches)


def main(args: argparse.Namespace) -> Tuple[List[dict], Dict[str, List[float]]]:
    torch.set_num_threads(1)
    corpus = load_corpus(None, max_bytes=2 * 2**20)
    batches = validation_batches(corpus.validation, TEST_MODEL.seq_len, batch_size=32, num_batches=8)
    steps_list = [int(s) for s in args.steps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.settings.split(",")
    losses: Dict[Tuple[Setting, int, int], float] = {}
    uncompressed = SETTINGS["fp32"]
    for setting in dict.fromkeys([uncompressed, *(SETTINGS[name] for name in names)]):
        for steps in steps_list:
            for seed in seeds:
                started = time.monotonic()
                losses[(setting, steps, seed)] = train(setting, steps, seed, args, corpus, batches)
                print(f"{'/'.join(map(str, setting)):>24}, {steps:>4} steps, seed {seed}: loss "
                      f"{losses[(setting, steps, seed)]:.4f} ({time.monotonic() - started:.1f} s)", flush=True)
    rows, raw = [], {}
    for name in names:
        setting = SETTINGS[name]
        compression, gradients, narrowing, overlap = setting
        activations = activation_bytes(compression, args.hidden // narrowing, args.seq_len)
        allreduce = round(allreduce_bytes(gradients, args.hidden, args.seq_len, args.replicas, args.batch_size,
                                           narrowing), 1)
        for steps in steps_list:
            excess = [(losses[(setting, steps, s)] - losses[(uncompressed, steps, s)]) / losses[(uncompressed, steps, s)]
                      for s in seeds]
            raw[f"loss_vs_uncompressed[{name}, {steps} steps]"] = [round(e, 5) for e in excess]
            rows.append({
                "setting": name, "compression": compression, "gradient_compression": gradients, "steps": steps,
                "boundary_dim": args.hidden // narrowing if narrowing > 1 else 0, "overlap_averaging": overlap,
                "activation_bytes_per_sample": activations,
                "allreduce_bytes_per_sample": allreduce,
                "loss": round(statistics.mean(losses[(setting, steps, s)] for s in seeds), 4),
                "loss_vs_uncompressed": round(statistics.mean(excess), 5),
                "tokens_per_s_50mbit": None,
            })
    return rows, raw


if __name__ == "__main__":
    arguments = parse_args()
    summary, raw_values = main(arguments)
    fp32 = {r["steps"]: r for r in summary if r["setting"] == "fp32"}
    for row in summary:
        base = fp32.get(row["steps"])
        ratio = "" if base is None else (f"  activations {base['activation_bytes_per_sample'] / row['activation_bytes_per_sample']:.2f}x"
                                         f" fewer, all-reduce {base['allreduce_bytes_per_sample'] / row['allreduce_bytes_per_sample']:.2f}x fewer")
        print(f"{row['setting']:>13} {row['steps']:>4} steps: loss {row['loss']:.4f} ({row['loss_vs_uncompressed']:+.2%})"
              f"{ratio}", flush=True)
    write_record("compression", arguments, summary, raw=raw_values,
                 headline=[{k: r[k] for k in ("setting", "steps", "activation_bytes_per_sample",
                                              "allreduce_bytes_per_sample", "loss", "loss_vs_uncompressed")}
                           for r in summary],
                 notes=["Bytes per sample: the payloads the codecs make for a model of --hidden and --seq_len (no "
                        "framing); boundaryN settings at hidden / N values a token. Loss: emulated data-parallel "
                        "training of the test model (hidden --loss_hidden; boundaryN at boundary_dim --loss_hidden / N) with the swarm's "
                        "codecs on activations, their gradients and the all-reduce, robust aggregation and AdamW; no "
                        "network, no pipeline; mean over --seeds; raw values are each seed's relative excess over fp32.",
                        "tokens_per_s_50mbit is not measured here (null)."])
    print(json.dumps(summary))
