"""Pipeline benchmark: one process vs a 2-stage swarm on loopback, and where the time goes.

Why: a SWARM pipeline pays only if what it adds per micro-batch (serialization, the network
hops, waiting for the other stage, the recomputation of a backward that finds no cached forward)
is small next to the compute it spreads over machines. This script measures each of those on the same
model and data, and prints a breakdown, then one JSON line as its last line.

What runs (every process limited to one torch thread; every address is 127.0.0.1):
  (a) single: the whole model (FullModel, the swarm's initialisation) in this process:
      forward and backward per micro-batch, gradients accumulated, an optimizer step every
      ``target_batch_size`` samples, as the swarm does.
  (b) swarm: a bootstrap DHT and one stage peer per stage (``--num_threads 1``) as
      subprocesses (each with its direct port, unless ``--direct_port -1``: the trainer's calls then
      all cross two p2pd daemons), one Trainer in this process (``torch.set_num_threads(1)``), measured
      with max_in_flight 1 (one window) and 4 (``--rounds`` windows; ``swarm_tokens_per_s`` and
      ``ratio`` are for 4, the trainer's default). ``target_batch_size`` defaults to more samples than the benchmark
      ever sends, so no global step happens in a measured window on either side: both
      figures are forward+backward throughput. ``overlap_averaging`` stays off: with one
      replica per stage there is no all-reduce to overlap. Pass ``--target_batch_size 128`` to
      measure with global steps (the single process then steps every 128 samples too).
Each measurement is a warm-up, then a fixed number of samples; tokens/s = samples * seq_len /
seconds from the start of the window to the completion of its last micro-batch.
The windows alternate: one of the single process (half as many samples) before every swarm window and one
after the last, with every process of the swarm stopped (SIGSTOP) meanwhile, so that the single process
has the machine to itself. This machine's speed drifts by tens of percent within a minute (one process's
CPU time per micro-batch ranged from 396 to 545 ms between runs); alternating gives both sides the same
machine. Each swarm window's ratio against the single windows around it is printed too.
  (c) same cores: the same single process given ``--single_threads`` torch threads (default: the stage
      peers' compute threads together, one per stage), measured right after each window of (a), the swarm
      stopped too: the swarm's peers compute on that many cores at once, so a sceptic asks whether one
      process on as many cores does as well. ``ratio_same_cores`` is the swarm's tokens/s over it
      (``--single_threads 0`` skips it). Its CPU time is the whole process's (every torch thread). Where
      other work shares the machine, its threads wait for each other at every parallel region (and spin
      meanwhile): its CPU ms per micro-batch far above the one-thread process's says so, and then it
      measures the machine's load more than what a second core buys.

The breakdown, per micro-batch of the benchmark's shape:
  compute         median CPU time of the StageRunner calls the peers run, timed in this process
                  with one thread (CPU time, so that other load on the machine does not inflate
                  it): stage 0 training forward (which keeps its graph), stage 1 forward+backward,
                  stage 0 backward from that graph (a cache hit: no recomputation). A backward
                  that misses the cache (another replica, an evicted entry, a step in between)
                  recomputes stage 0's forward: 'stage 0 backward (recomputing)' shows its cost.
  cache           the stage-0 peer's forward cache during the phase: hits (backward passes that
                  reused their forward's graph) and recomputations (backward passes that did not).
  serialization   swarm.net.wire.encode + decode of the six messages of one micro-batch (three
                  calls, a request and a reply each), timed in this process.
  transfer        each of those three calls replayed one at a time on the idle swarm:
                  median round trip - compute - serialization = sealing and loopback TCP on
                  the peers' direct ports (two p2pd daemons and protobuf with
                  ``--direct_port -1``, or until the trainer's direct connection is open), the
                  asyncio and executor hand-offs (and any contention while the probe ran).
  waiting         what is left of a micro-batch's latency during training: queueing
                  behind other micro-batches on a peer's single compute thread, and CPU
                  contention (two cores shared by both peers, three p2pd daemons, the trainer,
                  and whatever else the machine runs: the 'machine busy' figure shows it).
                  It comes out negative when the probe ran under heavier load than training.
                  'slowdown', split out of it, is how much longer compute took inside the
                  peers during training (their own throughput EMA) than alone in this process.
  CPU             CPU seconds of every process the benchmark runs (from /proc), per
                  micro-batch: on 2 cores, 2 * single-process CPU / swarm CPU bounds the ratio.
                  ``swarm_cpu_ms_per_micro_batch`` (all the swarm's processes) stands beside
                  ``single_cpu_ms_per_micro_batch`` (one thread) and ``single_same_cores_cpu_ms_per_micro_batch``
                  (``--single_threads`` threads): what the swarm spends for the same work.
  busy            samples/s of the phase x the peer's compute cost per sample (its EMA over
                  its last few calls, read at the end of the phase): approximate; above 100%
                  means compute got slower towards the end of the window.
  rpc_overhead_ms mean round trip of a ``forward`` call to the stage-1 peer carrying one
                  activation [batch, seq_len, hidden] float32 (+ targets) on the idle swarm,
                  minus the compute of that forward (StageRunner.forward on the same tensors,
                  timed in this process): the cost of one network hop carrying one activation.
The run's record (``benchmarks/_records.py``) keeps every window's figures and every probe's round trip.
Usage: python benchmarks/pipeline.py [--samples 384] [--batch_size 16] [--compression fp16] [--rounds 3]
       [--direct_port -1] [--single_threads 2] ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hivemind.p2p import PeerID  # noqa: E402

from _records import add_record_arguments, write_record  # noqa: E402
from _roles import Swarm, cpu_seconds_by_kind, machine_busy_seconds, paused  # noqa: E402
from swarm.net import wire  # noqa: E402
from swarm.client.trainer import Trainer  # noqa: E402
from swarm.config.settings import NetworkConfig, RunConfig, TrainerConfig  # noqa: E402
from swarm.training.data import BatchSampler, Corpus, load_corpus  # noqa: E402
from swarm.model.gpt import ModelConfig  # noqa: E402
from swarm.model.stages import FullModel  # noqa: E402
from swarm.training.optimizer import make_optimizer, optimizer_step  # noqa: E402
from swarm.net.rpc import call_peer  # noqa: E402
from swarm.server.runner import StageRunner  # noqa: E402

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TRAINER_SEED = 1  # the single process draws the same samples as the trainer
CALLS = ("forward0", "backward1", "backward0")  # the three calls of one micro-batch, in order
CACHE_BYTES = 512 * 2**20  # the peers' default --forward_cache_mb
NUM_STAGES = 2
PEER_THREADS = 1  # each stage peer's --num_threads


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--samples", type=int, default=384, help="samples per measured window")
    parser.add_argument("--in_flight", type=str, default="1,4", help="max_in_flight settings to measure")
    parser.add_argument("--rounds", type=int, default=3,
                        help="windows of the last max_in_flight setting, each after a window of the single process")
    parser.add_argument("--target_batch_size", type=int, default=1_000_000,
                        help="samples per global step; the default means no step while measuring")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each local timing and RPC probe")
    parser.add_argument("--compression", default="none", choices=("none", "fp16", "int8"),
                        help="the run's codec for activations and their gradients (the serialization figure "
                             "stays that of uncompressed messages)")
    parser.add_argument("--max_data_mb", type=float, default=2.0, help="corpus bytes read (MiB)")
    parser.add_argument("--direct_port", type=int, default=0, choices=(0, -1),
                        help="the peers' direct port: 0 (any free port, the default) or -1 (off: every call "
                             "goes through p2pd)")
    parser.add_argument("--single_threads", type=int, default=None,
                        help="torch threads of the same-cores baseline: one process on as many cores as the swarm's "
                             "peers compute on (default: one per stage); 0 skips it")
    add_record_arguments(parser)
    args = parser.parse_args()
    if args.single_threads is None:
        args.single_threads = NUM_STAGES * PEER_THREADS
    if args.single_threads < 0:
        parser.error(f"--single_threads must be 0 (skip) or positive, got {args.single_threads}")
    if args.samples < args.batch_size or args.rounds < 1 or args.reps < 1:
        parser.error("--samples must be at least --batch_size, --rounds and --reps at least 1")
    return args


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median CPU ms of this thread (torch runs here with one thread): unlike wall time, it does not grow
    when other processes take the cores, so local figures stay comparable across runs of a shared machine."""
    times = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        times.append((time.thread_time() - start) * 1000)
    return statistics.median(times)


# ---- local measurements: compute and serialization ----

@dataclasses.dataclass
class Tensors:
    """One micro-batch and what crosses the network for it."""

    tokens: torch.Tensor
    targets: torch.Tensor
    hidden: torch.Tensor  # stage 0's output
    grad: torch.Tensor  # stage 1's gradient w.r.t. hidden


def measure_compute(run: RunConfig, tokens: torch.Tensor, targets: torch.Tensor, reps: int
                    ) -> Tuple[Dict[str, float], Tensors]:
    """Median ms of each StageRunner call of one micro-batch, plus an optimizer step per stage."""
    first, last = StageRunner(run, 0, forward_cache_bytes=CACHE_BYTES), StageRunner(run, 1)
    hidden = first.forward(tokens)
    grad, _, _ = last.backward("warm-up", hidden, None, targets)
    first.backward("warm-up", tokens, grad)
    ids = iter(range(10**9))
    compute = {
        "forward0": median_ms(lambda: first.forward_train(f"f{next(ids)}", tokens), reps),
        "forward1": median_ms(lambda: last.forward(hidden, targets), reps),
        "backward1": median_ms(lambda: last.backward(f"b{next(ids)}", hidden, None, targets), reps),
        "backward0": cached_backward_ms(first, tokens, grad, reps),
        "backward0_recomputing": median_ms(lambda: first.backward(f"b{next(ids)}", tokens, grad), reps),
    }
    first.drop_cached_forwards()
    compute["optimizer_step"] = sum(median_ms(lambda: _step(runner), 1) for runner in (first, last))
    return compute, Tensors(tokens, targets, hidden, grad)


def cached_backward_ms(runner: StageRunner, tokens: torch.Tensor, grad: torch.Tensor, reps: int) -> float:
    """Median CPU ms of a stage-0 backward that finds its forward's graph (the forward runs off the clock)."""
    times = []
    for rep in range(reps):
        runner.forward_train(f"cached{rep}", tokens)
        start = time.thread_time()
        runner.backward(f"cached{rep}", tokens, grad)
        times.append((time.thread_time() - start) * 1000)
    if runner.forward_cache.hits < reps:
        raise RuntimeError("the benchmark's cached backward recomputed its forward: the figure would be wrong")
    return statistics.median(times)


def _step(runner: StageRunner) -> None:
    frozen = runner.freeze()
    runner.apply(frozen.mean_grads, max(frozen.samples, 1))


def call_messages(t: Tensors) -> Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]]:
    """(request, reply) of each call, as swarm.client.pipeline and the peers build them."""
    return {
        "forward0": ({"micro_batch_id": "x:0", "inputs": t.tokens, "stage": 0}, {"outputs": t.hidden}),
        "backward1": ({"micro_batch_id": "x:0", "inputs": t.hidden, "targets": t.targets, "stage": 1},
                      {"step": 0, "resets": 1, "grad_inputs": t.grad, "loss": 5.0}),
        "backward0": ({"micro_batch_id": "x:0", "inputs": t.tokens, "grad_outputs": t.grad, "stage": 0},
                      {"step": 0, "resets": 1}),
        "forward1": ({"inputs": t.hidden, "targets": t.targets, "stage": 1}, {"loss": 5.0}),
    }


def measure_serialization(messages: Dict[str, Tuple[Dict, Dict]], reps: int) -> Dict[str, float]:
    """Median ms to encode and decode each call's request and reply."""
    result = {}
    for name, pair in messages.items():
        total = 0.0
        for message in pair:
            payload = wire.encode(message)
            total += median_ms(lambda: wire.encode(message), reps) + median_ms(lambda: wire.decode(payload), reps)
        result[name] = total
    return result


class SingleProcess:
    """The whole model trained in this process, from the swarm's initialisation, on the trainer's samples."""

    def __init__(self, run: RunConfig, corpus: Corpus, batch_size: int, num_threads: int = 1):
        self.run, self.batch_size, self.num_threads = run, batch_size, num_threads
        self.model = FullModel(run.model, run.num_stages, run.seed)
        self.params = [list(stage.parameters()) for stage in self.model.stages]
        self.optimizers = [make_optimizer(p, run.optimizer) for p in self.params]
        self.sampler = BatchSampler(corpus.train, run.model.seq_len, batch_size, TRAINER_SEED)
        self.accumulated = 0

    def micro_batch(self) -> None:
        inputs, targets = self.sampler.sample()
        self.model(inputs, targets).backward()
        self.accumulated += self.batch_size
        if self.accumulated >= self.run.target_batch_size:  # the swarm's rule for a global step
            for params, optimizer in zip(self.params, self.optimizers):
                optimizer_step(params, optimizer, self.run.optimizer)
            self.accumulated = 0

    def measure(self, num_micro_batches: int) -> Dict[str, float]:
        """Wall and CPU seconds of ``num_micro_batches`` with ``num_threads`` torch threads (the caller's setting
        is restored after), tokens/s, and how busy the whole machine was meanwhile. ``cpu_s`` is this thread's
        CPU time (all of it with one torch thread), ``process_cpu_s`` the whole process's (every torch thread)."""
        previous = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            start, busy_start = time.perf_counter(), machine_busy_seconds()
            cpu_start, process_start = time.thread_time(), time.process_time()
            for _ in range(num_micro_batches):
                self.micro_batch()
            wall = time.perf_counter() - start
            cpu, process_cpu = time.thread_time() - cpu_start, time.process_time() - process_start
        finally:
            torch.set_num_threads(previous)
        return {"micro_batches": num_micro_batches, "wall_s": wall,
                "tokens_per_s": num_micro_batches * self.batch_size * self.run.model.seq_len / wall,
                "cpu_s": cpu, "process_cpu_s": process_cpu, "busy_s": machine_busy_seconds() - busy_start}


def combine_single(parts: Sequence[Dict[str, float]], cpu_key: str = "cpu_s") -> Dict[str, float]:
    """One figure from the windows measured between the swarm's (the machine's speed drifts); CPU from
    ``cpu_key`` ("process_cpu_s" for a baseline with several torch threads)."""
    num, wall = sum(p["micro_batches"] for p in parts), sum(p["wall_s"] for p in parts)
    return {"tokens_per_s": pooled_tokens_per_s(parts), "ms_per_micro_batch": wall * 1000 / num,
            "cpu_ms_per_micro_batch": sum(p[cpu_key] for p in parts) * 1000 / num,
            "machine_cores_busy": sum(p["busy_s"] for p in parts) / wall,
            "tokens_per_s_by_window": [p["tokens_per_s"] for p in parts],
            "cpu_ms_per_micro_batch_by_window": [p[cpu_key] * 1000 / p["micro_batches"] for p in parts]}


# ---- the swarm ----

class CallLog:
    """Times every stage call and every completed micro-batch of a trainer's PipelineClient."""

    def __init__(self, client) -> None:
        self.calls: List[Tuple[str, float]] = []  # (call name, ms)
        self.steps: List[Tuple[float, float]] = []  # (start, end) perf_counter of each micro-batch
        call_stage, train_step = client.call_stage, client.train_step

        async def timed_call(stage: int, method: str, message: Dict[str, Any], timeout: float, **kwargs: Any):
            start = time.perf_counter()
            reply = await call_stage(stage, method, message, timeout, **kwargs)
            self.calls.append((f"{method}{stage}", (time.perf_counter() - start) * 1000))
            return reply

        async def timed_step(*args, **kwargs):
            start = time.perf_counter()
            loss = await train_step(*args, **kwargs)
            self.steps.append((start, time.perf_counter()))
            return loss

        client.call_stage, client.train_step = timed_call, timed_step

    def reset(self) -> None:
        self.calls, self.steps = [], []

    def mean_call_ms(self) -> Dict[str, float]:
        names = {name for name, _ in self.calls}
        return {name: statistics.mean(ms for n, ms in self.calls if n == name) for name in names}


def peer_cli_args(run: RunConfig, direct_port: int = 0) -> List[str]:
    m = run.model
    return ["--direct_port", str(direct_port), "--run_id", run.run_id, "--num_stages", str(run.num_stages), "--seed", str(run.seed),
            "--target_batch_size", str(run.target_batch_size), "--num_layers", str(m.num_layers),
            "--hidden_size", str(m.hidden_size), "--num_heads", str(m.num_heads), "--seq_len", str(m.seq_len),
            "--vocab_size", str(m.vocab_size), "--num_threads", "1", "--compression", run.compression]


async def start_trainer(run: RunConfig, batch_size: int, initial_peers: Sequence[str], corpus: Corpus,
                        timeout: float = 60.0) -> Trainer:
    """A trainer in this process that sees an online peer for every stage."""
    config = TrainerConfig(batch_size=batch_size, trainer_seed=TRAINER_SEED, refresh_period_s=2.0, log_period_s=600.0,
                           run=run, network=NetworkConfig(initial_peers=list(initial_peers), host_maddrs=[LOOPBACK]))
    trainer = Trainer(config, corpus=corpus)
    await trainer.start()
    deadline = time.monotonic() + timeout
    while {p.stage for p in trainer._snapshot} != set(range(run.num_stages)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer saw no online peer for some stage within {timeout}s")
        await asyncio.sleep(0.5)
        await trainer.refresh()
    return trainer


async def train_samples(trainer: Trainer, in_flight: int, samples: int) -> None:
    trainer.config = dataclasses.replace(trainer.config, max_in_flight=in_flight, max_samples=samples)
    await trainer.train()


def cpu_snapshot(roles: Dict[str, int]) -> Dict[str, float]:
    return {**cpu_seconds_by_kind(roles), "machine": machine_busy_seconds()}


async def measure_phase(trainer: Trainer, log: CallLog, in_flight: int, samples: int, roles: Dict[str, int]
                        ) -> Dict[str, Any]:
    """Warm up, then train ``samples`` with ``in_flight`` micro-batches in flight; what it cost."""
    batch = trainer.config.batch_size
    await train_samples(trainer, in_flight, max(2, in_flight) * batch)  # fills the pipeline, off the clock
    log.reset()
    failed = trainer.metrics.micro_batches_failed
    cpu_before, start = cpu_snapshot(roles), time.perf_counter()
    await train_samples(trainer, in_flight, samples)
    elapsed = max(end for _, end in log.steps) - start
    cpu_after = cpu_snapshot(roles)
    num_micro_batches = len(log.steps)
    cpu = {key: (cpu_after.get(key, 0.0) - value) for key, value in cpu_before.items()}
    return {
        "in_flight": in_flight, "elapsed_s": elapsed, "samples": samples, "micro_batches": num_micro_batches,
        "tokens_per_s": samples * trainer.run.model.seq_len / elapsed,
        "latency_ms": statistics.mean((e - s) * 1000 for s, e in log.steps),
        "calls_ms": log.mean_call_ms(), "failed": trainer.metrics.micro_batches_failed - failed, "cpu_s": cpu,
    }


async def time_call(trainer: Trainer, peer_id: str, method: str, message: Dict[str, Any]) -> float:
    start = time.perf_counter()
    await call_peer(trainer.client.p2p, PeerID.from_base58(peer_id), method, message, timeout=60.0, direct=True)
    return (time.perf_counter() - start) * 1000


async def probe_rpc(trainer: Trainer, peers: Dict[int, str], messages: Dict[str, Tuple[Dict, Dict]], reps: int
                    ) -> Dict[str, Dict[str, float]]:
    """Mean and median round trip (ms) of each call on the idle swarm, one call at a time, and of 'info'."""
    times: Dict[str, List[float]] = {name: [] for name in (*CALLS, "forward1", "info")}
    for rep in range(reps + 1):  # the first round warms up the connections
        for name in times:
            stage = 1 if name == "info" else int(name[-1])
            method = name if name == "info" else name[:-1]
            message = {} if name == "info" else dict(messages[name][0])
            if "micro_batch_id" in message:
                # ids belong to their sender; one id per round, so that stage 0's backward finds its forward's graph
                message["micro_batch_id"] = f"{trainer.trainer_id}:probe:{rep}"
            elapsed = await time_call(trainer, peers[stage], method, message)
            if rep:
                times[name].append(elapsed)
    return {"mean": {name: statistics.mean(values) for name, values in times.items()},
            "median": {name: statistics.median(values) for name, values in times.items()}, "all": times}


async def peer_info(trainer: Trainer, peers: Dict[int, str]) -> Dict[int, Dict[str, Any]]:
    return {stage: await call_peer(trainer.client.p2p, PeerID.from_base58(peer_id), "info", {}, timeout=30.0)
            for stage, peer_id in peers.items()}


async def measure_swarm(run: RunConfig, args: argparse.Namespace, swarm: Swarm, peers: Dict[int, str],
                        corpus: Corpus, messages: Dict[str, Tuple[Dict, Dict]], baselines: Sequence["SingleProcess"]
                        ) -> Dict[str, Any]:
    """Every swarm window comes right after a window of each single-process baseline (and the last is followed
    by one), so that both see the machine in the same state: its speed drifts by tens of percent within a
    minute. While a single process runs, every process of the swarm (the trainer's p2pd and DHT process
    too) is stopped, so that it has the machine to itself, as before the swarm started. ``baselines[0]`` is
    the one-thread process; a second one, if given, has the swarm's cores."""
    trainer = await start_trainer(run, args.batch_size, swarm.initial_peers, corpus)
    try:
        log = CallLog(trainer.client)
        roles = {**{f"peer{stage}": swarm.processes[1 + stage].pid for stage in peers},
                 "bootstrap": swarm.processes[0].pid, "trainer": os.getpid()}
        single_micro_batches = max(1, args.samples // args.batch_size // 2)
        phases: List[Dict[str, Any]] = []
        windows_of: List[List[Dict[str, float]]] = [[] for _ in baselines]  # per baseline, in the order taken
        settings = [int(k) for k in args.in_flight.split(",")]
        for index, in_flight in enumerate(settings):
            before = await peer_info(trainer, peers)
            windows = []
            for _ in range(args.rounds if index == len(settings) - 1 else 1):
                for kept, window in zip(windows_of, single_windows(baselines, single_micro_batches, roles.values())):
                    kept.append(window)
                windows.append(await measure_phase(trainer, log, in_flight, args.samples, roles))
                windows[-1]["single_before"] = len(windows_of[0]) - 1
            phases.append(combine_windows(windows))
            phases[-1]["peer_info"] = await peer_info(trainer, peers)
            phases[-1]["cache"] = cache_counts(before[0], phases[-1]["peer_info"][0])
        for kept, window in zip(windows_of, single_windows(baselines, single_micro_batches, roles.values())):
            kept.append(window)
        for phase in phases:  # against the single-process windows just before and just after its own
            one = against(phase, windows_of[0])
            phase["single_tokens_per_s"], phase["ratio"], phase["ratio_by_window"] = (
                one["tokens_per_s"], one["ratio"], one["ratio_by_window"])
            phase["same_cores"] = against(phase, windows_of[1]) if len(windows_of) > 1 else None
        probe = await probe_rpc(trainer, peers, messages, args.reps)
        return {"phases": phases, "probe": probe, "singles": windows_of[0],
                "same_cores": windows_of[1] if len(windows_of) > 1 else []}
    finally:
        trainer.shutdown()


def single_windows(baselines: Sequence["SingleProcess"], micro_batches: int, swarm_roots: Sequence[int]
                   ) -> List[Dict[str, float]]:
    """A window of each single-process baseline, one after the other, with the swarm stopped; this blocks the
    trainer's event loop, which has nothing to do meanwhile."""
    with paused(list(swarm_roots)):
        return [baseline.measure(micro_batches) for baseline in baselines]


def against(phase: Dict[str, Any], baseline: Sequence[Dict[str, float]]) -> Dict[str, Any]:
    """A phase against a baseline's windows: the baseline's tokens/s pooled over the windows just before and
    just after each of the phase's windows, the phase's ratio to it, and each window's ratio to the two
    baseline windows around it."""
    around = sorted({w["single_before"] + k for w in phase["windows"] for k in (0, 1)})
    pooled = pooled_tokens_per_s([baseline[i] for i in around])
    by_window = [w["tokens_per_s"] / pooled_tokens_per_s(baseline[w["single_before"]:w["single_before"] + 2])
                 for w in phase["windows"]]
    return {"tokens_per_s": pooled, "ratio": phase["tokens_per_s"] / pooled, "ratio_by_window": by_window}


def pooled_tokens_per_s(windows: Sequence[Dict[str, float]]) -> float:
    """Tokens/s over several windows taken together: their tokens over their seconds."""
    return sum(w["tokens_per_s"] * w["wall_s"] for w in windows) / sum(w["wall_s"] for w in windows)


def combine_windows(windows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One phase from its measured windows: totals over all of them, means weighted by micro-batches."""
    elapsed, samples = sum(w["elapsed_s"] for w in windows), sum(w["samples"] for w in windows)
    micro_batches = sum(w["micro_batches"] for w in windows)
    tokens = sum(w["tokens_per_s"] * w["elapsed_s"] for w in windows)
    cpu = {key: sum(w["cpu_s"].get(key, 0.0) for w in windows) for key in windows[0]["cpu_s"]}
    weighted = lambda values: sum(v * w["micro_batches"] for v, w in zip(values, windows)) / micro_batches  # noqa: E731
    calls = {name: weighted([w["calls_ms"].get(name, float("nan")) for w in windows]) for name in windows[0]["calls_ms"]}
    return {
        "in_flight": windows[0]["in_flight"], "elapsed_s": elapsed, "samples": samples, "micro_batches": micro_batches,
        "tokens_per_s": tokens / elapsed, "samples_per_s": samples / elapsed,
        "latency_ms": weighted([w["latency_ms"] for w in windows]), "calls_ms": calls,
        "failed": sum(w["failed"] for w in windows), "cpu_s": cpu,
        "cpu_s_per_micro_batch": {k: v / micro_batches for k, v in cpu.items()},
        "cores_busy": {"ours": sum(v for k, v in cpu.items() if k != "machine") / elapsed,
                       "machine": cpu["machine"] / elapsed},
        "windows": [{"tokens_per_s": w["tokens_per_s"], "single_before": w["single_before"],
                     "cpu_ms_per_micro_batch": 1000 * sum(v for k, v in w["cpu_s"].items() if k != "machine")
                     / max(w["micro_batches"], 1)} for w in windows]}


def cache_counts(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, int]:
    """What the stage-0 peer's compute did between two 'info' replies (warm-up included): backward passes
    that reused their forward's graph, those that recomputed it, and entries evicted or invalidated."""
    def count(info: Dict[str, Any], key: str) -> int:
        compute = info.get("compute", {})
        return int(compute.get(key, compute.get("forward_cache", {}).get(key, 0)))
    return {key: count(after, key) - count(before, key) for key in ("hits", "recomputed", "evicted", "invalidated")}


# ---- report ----

def peer_compute_ms(phase: Dict[str, Any], batch: int) -> float:
    """Compute per micro-batch as the peers measured it during the phase (their throughput EMA), both stages."""
    throughputs = [info["throughput"] for info in phase["peer_info"].values()]
    return sum(batch * 1000 / t for t in throughputs) if all(throughputs) else float("nan")


def decompose(phase: Dict[str, Any], batch: int, compute: Dict[str, float], ser: Dict[str, float],
              transfer: Dict[str, float]) -> Dict[str, float]:
    """A micro-batch's mean latency, split into the parts the module docstring defines; 'slowdown' is how
    much longer the peers' compute took during the phase (their own EMA) than alone in this process."""
    local = sum(compute[c] for c in CALLS)
    parts = {"compute": local, "slowdown": peer_compute_ms(phase, batch) - local,
             "serialization": sum(ser[c] for c in CALLS), "transfer": sum(transfer[c] for c in CALLS)}
    parts["waiting"] = phase["latency_ms"] - sum(parts.values())
    return parts


def print_local(run: RunConfig, args: argparse.Namespace, compute: Dict[str, float], ser: Dict[str, float],
                activation_bytes: int) -> None:
    m = run.model
    print(f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, seq_len {m.seq_len}; "
          f"micro-batch {args.batch_size} ({args.batch_size * m.seq_len} tokens); {args.samples} samples per "
          f"measured window after a warm-up; target_batch_size {run.target_batch_size}")
    print("compute per micro-batch (StageRunner in this process, 1 thread, median CPU time):")
    print(f"  stage 0 forward (keeps its graph){compute['forward0']:8.1f} ms")
    print(f"  stage 0 backward (cache hit)     {compute['backward0']:8.1f} ms")
    print(f"  stage 0 backward (recomputing)   {compute['backward0_recomputing']:8.1f} ms (a cache miss)")
    print(f"  stage 1 forward+backward         {compute['backward1']:8.1f} ms")
    print(f"  stage 1 forward only             {compute['forward1']:8.1f} ms")
    print(f"  optimizer step, both stages      {compute['optimizer_step']:8.1f} ms (not in any measured window)")
    print(f"pipeline bound with zero overhead: (stage 0 forward+backward + stage 1 forward+backward) / max(stage 0 "
          f"{compute['forward0'] + compute['backward0']:.0f}, stage 1 {compute['backward1']:.0f} ms) = "
          f"{pipeline_bound(compute):.2f} with cache hits ({pipeline_bound(compute, hits=False):.2f} if every backward "
          f"recomputed its forward)")
    print(f"serialization per micro-batch (encode+decode of 6 messages, 4 of them carry an activation of "
          f"{activation_bytes / 2**20:.2f} MiB): {sum(ser[c] for c in CALLS):.1f} ms")


def pipeline_bound(compute: Dict[str, float], hits: bool = True) -> float:
    """Best swarm/single ratio of a 2-stage pipeline with free communication, from local timings only:
    one process runs stage 0's forward and backward and stage 1's forward+backward; the pipeline runs
    as fast as its slower stage. Without cache ``hits`` stage 0's backward also recomputes its forward."""
    single = compute["forward0"] + compute["backward0"] + compute["backward1"]
    stage0 = compute["forward0"] + compute["backward0" if hits else "backward0_recomputing"]
    return single / max(stage0, compute["backward1"])


def print_single(single: Dict[str, float], label: str = "single process") -> None:
    windows = ", ".join(f"{v:.0f}" for v in single["tokens_per_s_by_window"])
    print(f"{label}: {single['tokens_per_s']:.0f} tokens/s (windows between the swarm's: {windows}); "
          f"{single['ms_per_micro_batch']:.0f} ms per micro-batch ({single['cpu_ms_per_micro_batch']:.0f} CPU ms); the "
          f"whole machine had {single['machine_cores_busy']:.2f} of {os.cpu_count()} cores busy meanwhile")


def print_probe(probe: Dict[str, Dict[str, float]], compute: Dict[str, float], ser: Dict[str, float]) -> None:
    mean, median = probe["mean"], probe["median"]
    print("RPC on the idle swarm, one call at a time; mean (median) round trip = compute + serialization + "
          "transfer (from the median):")
    print(f"  info (a small record)            {mean['info']:7.1f} ({median['info']:.1f}) ms")
    for name in (*CALLS, "forward1"):
        transfer = median[name] - compute[name] - ser[name]
        print(f"  {name:<32} {mean[name]:7.1f} ({median[name]:.1f}) ms = {compute[name]:.1f} + {ser[name]:.1f} + "
              f"{transfer:.1f}")


def print_phase(phase: Dict[str, Any], single: Dict[str, float], parts: Dict[str, float], batch: int) -> None:
    print(f"swarm, max_in_flight={phase['in_flight']}: {phase['tokens_per_s']:.0f} tokens/s, ratio "
          f"{phase['ratio']:.2f} (against the single process's {phase['single_tokens_per_s']:.0f} tokens/s in the "
          f"windows around this phase's); {1000 * batch / phase['samples_per_s']:.0f} ms "
          f"per micro-batch; failed micro-batches {phase['failed']}")
    same = phase.get("same_cores")
    if same is not None:
        print(f"  against one process with the swarm's cores ({same['tokens_per_s']:.0f} tokens/s around this phase's "
              f"windows): ratio {same['ratio']:.2f}")
    if len(phase["windows"]) > 1:
        print(f"  {len(phase['windows'])} windows, each against the single-process windows around it: ratio "
              + ", ".join(f"{r:.2f}" for r in phase["ratio_by_window"])
              + ("" if same is None else "; same cores: " + ", ".join(f"{r:.2f}" for r in same["ratio_by_window"])))
    calls = ", ".join(f"{name} {phase['calls_ms'].get(name, float('nan')):.0f}" for name in CALLS)
    print(f"  mean call ms: {calls}")
    print(f"  latency {phase['latency_ms']:.0f} ms = " + " + ".join(f"{k} {v:.0f}" for k, v in parts.items()))
    cache = phase["cache"]
    print(f"  stage 0 forward cache: {cache['hits']} backward passes reused their forward's graph, "
          f"{cache['recomputed']} recomputed it ({cache['evicted']} entries evicted, {cache['invalidated']} "
          f"invalidated by a step)")
    for stage, info in phase["peer_info"].items():
        rate = info["throughput"] or float("nan")
        print(f"  stage {stage}: the peer's own compute EMA {batch / rate * 1000:.0f} ms per micro-batch, "
              f"busy {phase['samples_per_s'] / rate:.0%} of the window")
    cpu = {k: v * 1000 for k, v in phase["cpu_s_per_micro_batch"].items() if k != "machine"}
    print("  CPU ms per micro-batch: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items())))
    total, p2pd = sum(cpu.values()), sum(v for k, v in cpu.items() if k.endswith("p2pd"))
    dht = sum(v for k, v in cpu.items() if k.endswith("helpers") or k == "bootstrap python")
    print(f"  CPU per micro-batch, all our processes: {total:.0f} ms ({p2pd:.0f} in p2pd daemons, {dht:.0f} in "
          f"hivemind's DHT processes) vs "
          f"{single['cpu_ms_per_micro_batch']:.0f} single: on {os.cpu_count()} cores the ratio cannot exceed "
          f"{os.cpu_count() * single['cpu_ms_per_micro_batch'] / total:.2f}")
    cores = phase["cores_busy"]
    print(f"  cores busy: this benchmark's processes {cores['ours']:.2f}, the whole machine {cores['machine']:.2f} "
          f"(of {os.cpu_count()})")


# ---- main ----

def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that every finally block runs and stops what we started


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    started = time.perf_counter()
    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_heads,
                        seq_len=args.seq_len)
    run = RunConfig(run_id=f"bench_{uuid.uuid4().hex[:8]}", num_stages=2, target_batch_size=args.target_batch_size,
                    model=model, compression=args.compression)
    corpus = load_corpus(None, max_bytes=int(args.max_data_mb * 2**20))
    tokens, targets = BatchSampler(corpus.train, model.seq_len, args.batch_size, seed=99).sample()
    compute, tensors = measure_compute(run, tokens, targets, args.reps)
    messages = call_messages(tensors)
    ser = measure_serialization(messages, args.reps)
    baselines = [SingleProcess(run, corpus, args.batch_size)]
    if args.single_threads:
        baselines.append(SingleProcess(run, corpus, args.batch_size, num_threads=args.single_threads))
    for baseline in baselines:
        baseline.measure(2)  # warm-up (and the second baseline's thread pool), off the clock
    print_local(run, args, compute, ser, tensors.hidden.numel() * 4)
    sys.stdout.flush()

    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as log_dir:
        swarm = Swarm(Path(log_dir), peer_cli_args(run, args.direct_port))
        try:
            swarm.bootstrap()
            ready = swarm.peers([["--stage", "0"], ["--stage", "1"]])
            peers = {event["stage"]: event["peer_id"] for event in ready}
            result = asyncio.run(measure_swarm(run, args, swarm, peers, corpus, messages, baselines))
        finally:
            swarm.close()
    single_result = combine_single(result["singles"])
    same_cores = combine_single(result["same_cores"], "process_cpu_s") if result["same_cores"] else None
    return report(run, args, compute, ser, single_result, same_cores, result, time.perf_counter() - started)


def report(run: RunConfig, args: argparse.Namespace, compute: Dict[str, float], ser: Dict[str, float],
           single: Dict[str, float], same_cores: Optional[Dict[str, float]], result: Dict[str, Any],
           wall_s: float) -> int:
    probe = result["probe"]
    print_single(single)
    if same_cores is not None:
        print_single(same_cores, f"single process, {args.single_threads} torch threads (the swarm's cores)")
    print_probe(probe, compute, ser)
    median = probe["median"]
    transfer = {name: median[name] - compute[name] - ser[name] for name in median if name != "info"}
    rpc_overhead_ms = probe["mean"]["forward1"] - compute["forward1"]
    print(f"rpc_overhead_ms (mean forward to stage 1 carrying one activation, minus its compute): "
          f"{rpc_overhead_ms:.1f} (from the median: {median['forward1'] - compute['forward1']:.1f})")
    by_in_flight = {}
    for phase in result["phases"]:
        parts = decompose(phase, args.batch_size, compute, ser, transfer)
        print_phase(phase, single, parts, args.batch_size)
        by_in_flight[str(phase["in_flight"])] = {
            "tokens_per_s": round(phase["tokens_per_s"], 1), "ratio": round(phase["ratio"], 3),
            "single_tokens_per_s": round(phase["single_tokens_per_s"], 1),
            "latency_ms": round(phase["latency_ms"], 1), **{f"{k}_ms": round(v, 1) for k, v in parts.items()},
            "failed_micro_batches": phase["failed"], "machine_cores_busy": round(phase["cores_busy"]["machine"], 2),
            "cpu_ms_per_micro_batch": round(1000 * sum(v for k, v in phase["cpu_s_per_micro_batch"].items()
                                                       if k != "machine"), 1),
            "stage0_cache": phase["cache"],
            "ratio_by_window": [round(r, 3) for r in phase["ratio_by_window"]],
            "cpu_ms_per_micro_batch_by_window": [round(w["cpu_ms_per_micro_batch"], 1) for w in phase["windows"]],
            **same_cores_figures(phase)}
    main_phase = by_in_flight.get("4", list(by_in_flight.values())[-1])
    cpu_ratio = main_phase["cpu_ms_per_micro_batch"] / single["cpu_ms_per_micro_batch"]
    print(f"CPU ms per micro-batch: swarm (every process of it) {main_phase['cpu_ms_per_micro_batch']:.0f}, one "
          f"process {single['cpu_ms_per_micro_batch']:.0f} ({cpu_ratio:.2f}x)"
          + ("" if same_cores is None else f", one process on {args.single_threads} threads "
                                           f"{same_cores['cpu_ms_per_micro_batch']:.0f}"))
    print(f"wall time {wall_s:.0f} s")
    summary = {
        "single_tokens_per_s": main_phase["single_tokens_per_s"], "swarm_tokens_per_s": main_phase["tokens_per_s"],
        "single_tokens_per_s_all_windows": round(single["tokens_per_s"], 1),
        "ratio": main_phase["ratio"], "rpc_overhead_ms": round(rpc_overhead_ms, 1),
        "swarm_by_max_in_flight": by_in_flight,
        "compute_ms": {k: round(v, 1) for k, v in compute.items()},
        "serialization_ms_per_micro_batch": round(sum(ser[c] for c in CALLS), 1),
        "transfer_ms_per_micro_batch": round(sum(transfer[c] for c in CALLS), 1),
        "rpc_overhead_ms_median": round(median["forward1"] - compute["forward1"], 1),
        "rpc_info_ms": round(probe["mean"]["info"], 1),
        "pipeline_bound_ratio": round(pipeline_bound(compute), 3),
        "pipeline_bound_ratio_recomputing": round(pipeline_bound(compute, hits=False), 3),
        "single_cpu_ms_per_micro_batch": round(single["cpu_ms_per_micro_batch"], 1),
        "single_machine_cores_busy": round(single["machine_cores_busy"], 2),
        "single_tokens_per_s_by_window": [round(v, 1) for v in single["tokens_per_s_by_window"]],
        "swarm_cpu_ms_per_micro_batch": main_phase["cpu_ms_per_micro_batch"],
        "cpu_ratio_swarm_vs_single": round(cpu_ratio, 3),
        "single_threads": args.single_threads,
        "single_same_cores_tokens_per_s": main_phase.get("single_same_cores_tokens_per_s"),
        "ratio_same_cores": main_phase.get("ratio_same_cores"),
        "single_same_cores_cpu_ms_per_micro_batch": (round(same_cores["cpu_ms_per_micro_batch"], 1)
                                                     if same_cores else None),
        "single_same_cores_tokens_per_s_by_window": ([round(v, 1) for v in same_cores["tokens_per_s_by_window"]]
                                                     if same_cores else None),
        "model": dataclasses.asdict(run.model), "batch_size": args.batch_size, "samples": args.samples,
        "direct_port": args.direct_port, "target_batch_size": run.target_batch_size, "wall_s": round(wall_s, 1)}
    write_record("pipeline", args, summary, raw=record_raw(single, same_cores, by_in_flight, probe),
                 headline=record_headline(summary), notes=RECORD_NOTES)
    print(json.dumps(summary))
    return 0


def same_cores_figures(phase: Dict[str, Any]) -> Dict[str, Any]:
    same = phase.get("same_cores")
    if same is None:
        return {}
    return {"single_same_cores_tokens_per_s": round(same["tokens_per_s"], 1),
            "ratio_same_cores": round(same["ratio"], 3),
            "ratio_same_cores_by_window": [round(r, 3) for r in same["ratio_by_window"]]}


def record_raw(single: Dict[str, Any], same_cores: Optional[Dict[str, Any]], by_in_flight: Dict[str, Dict[str, Any]],
               probe: Dict[str, Any]) -> Dict[str, List[float]]:
    """Every window's figures and every probe's round trip, for the run's record."""
    raw = {"single_tokens_per_s": single["tokens_per_s_by_window"],
           "single_cpu_ms_per_micro_batch": single["cpu_ms_per_micro_batch_by_window"]}
    if same_cores is not None:
        raw["single_same_cores_tokens_per_s"] = same_cores["tokens_per_s_by_window"]
        raw["single_same_cores_cpu_ms_per_micro_batch"] = same_cores["cpu_ms_per_micro_batch_by_window"]
    for in_flight, phase in by_in_flight.items():
        raw[f"ratio[in_flight={in_flight}]"] = phase["ratio_by_window"]
        if "ratio_same_cores_by_window" in phase:
            raw[f"ratio_same_cores[in_flight={in_flight}]"] = phase["ratio_same_cores_by_window"]
        raw[f"swarm_cpu_ms_per_micro_batch[in_flight={in_flight}]"] = phase["cpu_ms_per_micro_batch_by_window"]
    for name, values in probe["all"].items():
        raw[f"rpc_round_trip_ms[{name}]"] = values
    return raw


def record_headline(summary: Dict[str, Any]) -> Dict[str, Any]:
    keys = ("swarm_tokens_per_s", "single_tokens_per_s", "ratio", "single_same_cores_tokens_per_s", "ratio_same_cores",
            "swarm_cpu_ms_per_micro_batch", "single_cpu_ms_per_micro_batch", "single_same_cores_cpu_ms_per_micro_batch",
            "cpu_ratio_swarm_vs_single", "pipeline_bound_ratio", "rpc_overhead_ms", "single_threads", "direct_port")
    return {key: summary.get(key) for key in keys}


RECORD_NOTES = [
    "ratio = the swarm's tokens/s (max_in_flight 4) over one process with one torch thread, in windows that "
    "alternate with the swarm's (the swarm stopped meanwhile); ratio_same_cores = over one process given "
    "single_threads torch threads, measured in the same pauses.",
    "CPU ms per micro-batch: the swarm's counts every process it runs (peers, p2pd daemons, DHT processes, the "
    "trainer); the one-thread process's is its thread's CPU time, the multi-thread one's its whole process's.",
    "Raw values: one per window (single_*, ratio*, swarm_cpu_*) or per probe call (rpc_round_trip_ms).",
    "On a machine shared with other work the multi-thread process's threads wait for each other (and spin) at "
    "every parallel region: when its CPU ms per micro-batch is far above the one-thread process's, ratio_same_cores "
    "measures that load rather than what the extra cores buy.",
]


if __name__ == "__main__":
    sys.exit(main())
