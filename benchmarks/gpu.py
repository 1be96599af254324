"""GPU benchmark: a Llama-class stage's training throughput and MFU, a 2-stage swarm against one process on the
same GPU, and each stage's peak memory against :func:`swarm.model.footprint.stage_memory`.

Why: a volunteer deciding whether to lend a GPU asks how fast a stage trains on it, how much of the GPU's peak
that is, what the swarm's machinery costs next to one process doing the same work, and whether the memory the
peer says it needs (and refuses to start without) is what it really takes.

What runs (bf16 autocast, float32 weights and optimizer state, as a ``--dtype bf16`` peer computes):
  (a) stage: a :class:`~swarm.server.runner.StageRunner` of a middle stage of the model (853M parameters:
      hidden 2048, 16 layers, 16 heads, 4 KV heads, seq 2048, vocab 32000, cut into 4 stages) runs
      ``backward`` on made-up micro-batches (a forward recomputed, then backward, as a peer serves it);
      tokens/s over ``--steps`` calls after ``--warmup``. MFU = tokens/s x model FLOPs per token / the device's
      peak dense bf16 FLOP/s, where a stage's FLOPs per token are 6 x its block parameters + 12 x layers x
      hidden x seq_len (attention's score and value products, counted without the causal half as PaLM does).
  (b) memory: every stage's runner (forward cache off) after two micro-batches, a frozen step and a third
      micro-batch (both gradient buffers live): peak ``torch.cuda.max_memory_allocated`` above what was
      allocated before it was built, against the estimate's device part; the error is the largest relative
      one over the stages. CUDA only.
  (c) swarm: two of those stages' worth of layers as a 2-stage run: a bootstrap DHT and one peer per stage
      (``--dtype bf16``; a backward request of 4 full sequences carries 128 MiB, so ``--max_message_mb 256``)
      as subprocesses and a trainer in this process, all on this device, against one
      process (:class:`~swarm.model.stages.FullModel` under the same autocast) doing forward and backward
      on the same micro-batches; no global step happens on either side (``target_batch_size`` is larger than
      what is sent). ``swarm_over_single`` = swarm tokens/s / single tokens/s.

``--tiny`` runs a tiny config on the CPU in seconds (what the tests run). The last line is JSON:
``{"device", "stage_tokens_per_s", "stage_mfu", "swarm_over_single", "memory_estimate_error"}`` (null where not
measured: MFU without a known peak, memory off CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import _records  # noqa: E402
from _roles import Swarm  # noqa: E402
from swarm.client.trainer import Trainer  # noqa: E402
from swarm.config.settings import NetworkConfig, RunConfig, TrainerConfig  # noqa: E402
from swarm.model.footprint import stage_memory  # noqa: E402
from swarm.model.gpt import ModelConfig  # noqa: E402
from swarm.model.stages import FullModel  # noqa: E402
from swarm.server.runner import StageRunner  # noqa: E402
from swarm.training.data import BatchSampler, load_corpus  # noqa: E402

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# peak dense bf16 tensor FLOP/s by a substring of torch.cuda.get_device_name (first match wins)
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0))
FULL = ModelConfig(architecture="llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4,
                   seq_len=2048, vocab_size=32000)
TINY = ModelConfig(architecture="llama", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=32,
                   vocab_size=300)
NUM_STAGES = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (seconds)")
    parser.add_argument("--device", default=None, help="default: cuda:0, or cpu with --tiny")
    parser.add_argument("--batch_size", type=int, default=None, help="samples per micro-batch (default 4; tiny 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed micro-batches of (a) (default 10; tiny 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed micro-batches first")
    parser.add_argument("--swarm_samples", type=int, default=None, help="samples each side of (c) trains on "
                        "(default 32; tiny 8)")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the device's peak dense bf16 TFLOP/s, for a device not in the table")
    _records.add_record_arguments(parser)
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda:0")
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.steps = args.steps or (3 if args.tiny else 10)
    args.swarm_samples = args.swarm_samples or (8 if args.tiny else 32)
    return args


def peak_flops(device: torch.device, given_tflops: Optional[float]) -> Optional[float]:
    """The device's peak dense bf16 FLOP/s: ``--peak_tflops``, else from the table by device name, else None."""
    if given_tflops:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def made_up(model: ModelConfig, runner: StageRunner, batch: int, seed: int):
    """(inputs, grad_outputs, targets) of a micro-batch for ``runner``'s stage."""
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda: torch.randint(0, model.vocab_size, (batch, model.seq_len), generator=gen)  # noqa: E731
    hidden = lambda: torch.randn(batch, model.seq_len, model.hidden_size, generator=gen)  # noqa: E731
    inputs = tokens() if runner.module.is_first else hidden()
    return inputs, None if runner.module.is_last else hidden() * 1e-3, tokens() if runner.module.is_last else None


def stage_flops_per_token(model: ModelConfig, runner: StageRunner) -> float:
    start, end = runner.module.layer_range
    block_params = sum(p.numel() for name, p in runner.module.named_parameters() if ".layers." in f".{name}")
    return 6.0 * block_params + 12.0 * (end - start) * model.hidden_size * model.seq_len


def measure_stage(run: RunConfig, args: argparse.Namespace) -> Dict[str, Any]:
    """(a): tokens/s and MFU of stage 1's training calls."""
    device = torch.device(args.device)
    runner = StageRunner(run, 1, args.device, dtype="bf16")
    batches = [made_up(run.model, runner, args.batch_size, seed) for seed in range(2)]
    for i in range(args.warmup):
        runner.backward(f"w:{i}", *batches[i % 2])
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.steps):
        runner.backward(f"t:{i}", *batches[i % 2])
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens_per_s = args.steps * args.batch_size * run.model.seq_len / seconds
    peak = peak_flops(device, args.peak_tflops)
    flops = stage_flops_per_token(run.model, runner)
    del runner
    return {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / peak if peak else None,
            "flops_per_token": flops, "seconds": seconds}


def measure_memory(run: RunConfig, args: argparse.Namespace) -> Dict[str, Any]:
    """(b): each stage's peak device memory against its estimate (CUDA only)."""
    device = torch.device(args.device)
    measured, estimated = [], []
    for stage in range(run.num_stages):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        runner = StageRunner(run, stage, args.device, dtype="bf16")
        for i in range(3):
            if i == 2:
                runner.freeze()
            runner.backward(f"m:{i}", *made_up(run.model, runner, args.batch_size, i))
        synchronize(device)
        measured.append(torch.cuda.max_memory_allocated(device) - base)
        estimated.append(stage_memory(run.model, run.num_stages, stage, batch_size=args.batch_size,
                                      forward_cache_mb=0, dtype="bf16", device=args.device).device_bytes)
        del runner
    errors = [(e - m) / m for e, m in zip(estimated, measured)]
    return {"measured_bytes": measured, "estimated_bytes": estimated, "errors": errors,
            "error": max(errors, key=abs)}


def swarm_run(model: ModelConfig) -> RunConfig:
    """Two stages of the 4-stage cut's size: half the layers, the same widths, as a 2-stage run."""
    half = ModelConfig(architecture="llama", hidden_size=model.hidden_size, num_layers=model.num_layers // 2,
                       num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, seq_len=model.seq_len,
                       vocab_size=model.vocab_size)
    return RunConfig(run_id=f"gpu_{uuid.uuid4().hex[:8]}", num_stages=2, target_batch_size=10**6, model=half)


def peer_args(run: RunConfig, device: str) -> List[str]:
    m = run.model
    return ["--run_id", run.run_id, "--num_stages", "2", "--target_batch_size", str(run.target_batch_size),
            "--architecture", "llama", "--num_layers", str(m.num_layers), "--hidden_size", str(m.hidden_size),
            "--num_heads", str(m.num_heads), "--num_kv_heads", str(m.num_kv_heads), "--seq_len", str(m.seq_len),
            "--vocab_size", str(m.vocab_size), "--device", device, "--dtype", "bf16", "--num_threads", "1",
            "--speed_test_samples", "1", "--max_message_mb", "256", "--max_mb_per_caller", "1024"]


def measure_single(run: RunConfig, sampler: BatchSampler, device: torch.device, micro_batches: int) -> float:
    """Tokens/s of one process's forward and backward passes over both stages under bf16 autocast."""
    model = FullModel(run.model, run.num_stages, run.seed).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    batches = [tuple(t.to(device) for t in sampler.sample()) for _ in range(micro_batches + 1)]
    with autocast:
        model(*batches[0]).backward()  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for tokens, targets in batches[1:]:
        with autocast:
            loss = model(tokens, targets)
        loss.backward()
    synchronize(device)
    seconds = time.perf_counter() - start
    del model
    return micro_batches * sampler.batch_size * run.model.seq_len / seconds


async def measure_trainer(run: RunConfig, initial_peers: List[str], corpus: Any, batch_size: int,
                          samples: int) -> float:
    """Tokens/s of a trainer in this process pushing ``samples`` through the swarm (after one warm-up batch)."""
    config = TrainerConfig(batch_size=batch_size, refresh_period_s=2.0, log_period_s=600.0, run=run,
                           network=NetworkConfig(initial_peers=initial_peers, host_maddrs=[LOOPBACK]))
    trainer = Trainer(config, corpus=corpus)
    await trainer.start()
    try:
        deadline = time.monotonic() + 120
        while {p.stage for p in trainer._snapshot} != {0, 1}:
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer saw no online peer for some stage within 120 s")
            await asyncio.sleep(0.5)
            await trainer.refresh()
        trainer.config.max_samples = batch_size
        await trainer.train()
        trainer.config.max_samples = samples
        start = time.perf_counter()
        await trainer.train()
        return samples * run.model.seq_len / (time.perf_counter() - start)
    finally:
        trainer.shutdown()


def measure_swarm(model: ModelConfig, args: argparse.Namespace) -> Dict[str, float]:
    """(c): the 2-stage swarm's tokens/s over one process's on the same device."""
    run = swarm_run(model)
    corpus = load_corpus(None, max_bytes=4 * 2**20)
    sampler = BatchSampler(corpus.train, run.model.seq_len, args.batch_size, seed=1)
    single = measure_single(run, sampler, torch.device(args.device), max(1, args.swarm_samples // args.batch_size))
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as log_dir:
        swarm = Swarm(Path(log_dir), peer_args(run, args.device))
        try:
            swarm.bootstrap()
            swarm.peers([["--stage", "0"], ["--stage", "1"]], timeout=300)
            tokens_per_s = asyncio.run(measure_trainer(run, swarm.initial_peers, corpus, args.batch_size,
                                                       args.swarm_samples))
        finally:
            swarm.close()
    return {"single_tokens_per_s": single, "swarm_tokens_per_s": tokens_per_s, "ratio": tokens_per_s / single}


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"device {device}: no CUDA device here; run with --tiny (CPU) or on a GPU")
    torch.set_num_threads(1 if args.tiny else torch.get_num_threads())
    model = TINY if args.tiny else FULL
    run = RunConfig(run_id="gpu_bench", num_stages=NUM_STAGES, target_batch_size=10**6, model=model, defences=False)
    stage = measure_stage(run, args)
    print(f"stage 1: {stage['tokens_per_s']:.0f} tokens/s, MFU {stage['mfu']}", flush=True)
    memory = measure_memory(run, args) if device.type == "cuda" else None
    if memory:
        for s, (m, e) in enumerate(zip(memory["measured_bytes"], memory["estimated_bytes"])):
            print(f"stage {s}: peak {m / 1e9:.2f} GB, estimated {e / 1e9:.2f} GB", flush=True)
    swarm = measure_swarm(model, args)
    print(f"swarm {swarm['swarm_tokens_per_s']:.0f} tokens/s, single {swarm['single_tokens_per_s']:.0f}", flush=True)
    summary = {"device": device_name(device), "stage_tokens_per_s": stage["tokens_per_s"], "stage_mfu": stage["mfu"],
               "swarm_over_single": swarm["ratio"], "memory_estimate_error": memory["error"] if memory else None}
    if "gpu" in _records.BENCHMARKS:
        raw = {"stage_tokens_per_s": [stage["tokens_per_s"]], "swarm_tokens_per_s": [swarm["swarm_tokens_per_s"]],
               "single_tokens_per_s": [swarm["single_tokens_per_s"]],
               "memory_measured_bytes": memory["measured_bytes"] if memory else [],
               "memory_estimated_bytes": memory["estimated_bytes"] if memory else []}
        _records.write_record("gpu", args, summary, raw, notes=[__doc__.split("\n\n")[2]])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
