"""Rebalancing benchmark: a 3+1 imbalanced swarm that rebalances itself, versus a balanced 2+2 start.

Why: SWARM moves capacity to the bottleneck stage. This script measures, on a live swarm of
subprocesses on loopback, how long the swarm takes to move from 3+1 to 2+2 and whether the
throughput it reaches then matches that of a swarm that was balanced from the start.

What runs (every address 127.0.0.1), twice with the same peers and settings:
  * 4 peers, all with ``--rebalance true --period_s P --period_jitter 0.1 --min_gain 0.05
    --max_movers_per_period 1``, on a model where compute, not per-request overhead, sets
    each stage's cost (``--num_layers 4 --hidden_size 96 --num_heads 4 --seq_len 32``) and
    ``--delay_per_sample_s`` (a sleep: a peer's capacity does not depend on free cores), so the
    peers, not the trainers, limit throughput; 2 trainers with ``--max_in_flight 8``;
    ``--target_batch_size`` huge so no global step (no averaging) happens: the figures are
    forward+backward throughput (the settings of tests/test_churn.py's imbalance test).
  * imbalanced run: 3 peers on stage 0 and 1 on stage 1. ``before``: stage 1's rate over
    ``--before_window_s`` right after training starts (the first rebalancing decision comes one
    period after a peer has measured its throughput). Then the probe waits for 2+2 (every peer
    online); ``seconds_to_rebalance`` = from training start (stage 1's first processed sample)
    to the first DHT read showing 2 online replicas on each stage. ``after``: stage 1's rate over
    ``--window_s``, ``--settle_s`` after that.
  * balanced run: 2 peers on each stage from the start; ``balanced``: stage 1's rate over
    ``--window_s``, ``--warmup_s`` after training starts.
Throughput = samples processed per second by stage 1 (the sum over its online replicas of
``samples_processed`` from their DHT records; every sample passes stage 1 exactly once per
micro-batch, forward and backward in one request), over the window. ``trainer_*`` figures are
the same windows measured on the trainers' samples_sent (their DHT records), as a cross-check.

``throughput_after_rebalance_ratio`` = after / balanced. The last line is one JSON object.
Defaults take about 3-4 minutes on a 2-core machine.

Usage: python benchmarks/rebalance.py [--period_s 20] [--window_s 12] [--log_dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import add_record_arguments, write_record  # noqa: E402
from _swarm import FAST_PEER, LiveSwarm, counts, install_signal_handlers, log, make_log_dir, online  # noqa: E402

MODEL = ["--num_layers", "4", "--hidden_size", "96", "--num_heads", "4", "--seq_len", "32"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--period_s", type=float, default=20.0, help="rebalancing period of every peer (seconds)")
    p.add_argument("--delay_per_sample_s", type=float, default=0.02, help="peers' emulated slow device: seconds of sleep per sample of backward work")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--max_in_flight", type=int, default=8)
    p.add_argument("--before_window_s", type=float, default=8.0, help="window of the before-rebalance rate")
    p.add_argument("--window_s", type=float, default=12.0, help="window of the after-rebalance and balanced rates")
    p.add_argument("--warmup_s", type=float, default=6.0, help="balanced run: seconds of training before its window")
    p.add_argument("--settle_s", type=float, default=6.0, help="imbalanced run: seconds after 2+2 before its window")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    return p.parse_args(argv)


def stage1_processed(records) -> Dict[str, int]:
    return {r.peer_id: r.samples_processed for r in online(records, 1)}


async def rate(swarm: LiveSwarm, window_s: float) -> Dict[str, Any]:
    """Stage 1's and the trainers' samples/s over a window, and the replicas per stage at both ends."""
    first = await swarm.snapshot()
    await asyncio.sleep(window_s)
    last = await swarm.snapshot()
    elapsed = last.t - first.t
    a, b = stage1_processed(first.peers), stage1_processed(last.peers)
    # a replica that joined stage 1 inside the window counts from zero
    processed = sum(value - a.get(peer_id, 0) for peer_id, value in b.items())
    sent = (sum(r.samples_sent for r in last.trainers.values()) - sum(r.samples_sent for r in first.trainers.values()))
    return {"stage1_samples_per_s": round(processed / elapsed, 2), "trainer_samples_per_s": round(sent / elapsed, 2),
            "window_s": round(elapsed, 1), "replicas_start": list(counts(first.peers)),
            "replicas_end": list(counts(last.peers)),
            "states_end": sorted(r.state for r in last.peers.values())}


async def wait_training(swarm: LiveSwarm, timeout: float) -> float:
    await swarm.wait_for(lambda r: sum(stage1_processed(r).values()) > 0, timeout, "training to start")
    return time.monotonic()


async def start_swarm(args, label: str, stages: List[int], log_dir: Path) -> Tuple[LiveSwarm, str]:
    run_id = f"bench_rebal_{label}_{uuid.uuid4().hex[:6]}"
    policy = ["--rebalance", "true", "--period_s", str(args.period_s), "--period_jitter", "0.1", "--min_gain", "0.05",
              "--max_movers_per_period", "1"]
    swarm = LiveSwarm(log_dir, run_id, run_args=["--num_stages", "2", "--target_batch_size", "100000", *MODEL],
                      peer_args=[*FAST_PEER, "--delay_per_sample_s", str(args.delay_per_sample_s), *policy],
                      trainer_args=["--max_data_mb", "2", "--refresh_period_s", "0.5", "--log_period_s", "0.5",
                                    "--duration_s", "600", "--max_in_flight", str(args.max_in_flight)])
    return swarm, run_id


async def bring_up(swarm: LiveSwarm, args, label: str, stages: List[int]) -> None:
    log(f"[{label}] bootstrap and {len(stages)} peers on stages {stages}; logs in {swarm.log_dir} (run {swarm.run_id})")
    swarm.bootstrap(60.0)
    processes = [swarm.peer(stage, f"s{stage}p{i}") for i, stage in enumerate(stages)]
    for process in processes:
        await swarm.event(process, "peer_ready", 120.0)
    want = tuple(stages.count(s) for s in (0, 1))
    await swarm.wait_for(lambda r: counts(r) == want and all(x.state == "online" for x in r.values()), 60.0,
                         f"a {want[0]}+{want[1]} swarm")
    trainers = [swarm.trainer(f"trainer{i}", ["--trainer_seed", str(i + 1)]) for i in range(args.trainers)]
    for trainer in trainers:
        await swarm.event(trainer, "trainer_ready", 120.0)


async def imbalanced(args, log_dir: Path) -> Dict[str, Any]:
    swarm, _ = await start_swarm(args, "3p1", [0, 0, 0, 1], log_dir)
    try:
        await bring_up(swarm, args, "3+1", [1, 0, 0, 0])
        started = await wait_training(swarm, 90.0)
        log("[3+1] training started; measuring the before-rebalance rate")
        before = await rate(swarm, args.before_window_s)
        log(f"[3+1] before: {before}")
        first_move: Optional[float] = None
        deadline = started + 2.2 * args.period_s + 45.0
        while time.monotonic() < deadline:
            records = await swarm.probe.records()
            if first_move is None and (counts(records) != (3, 1) or any(r.state != "online" for r in records.values())):
                first_move = time.monotonic()
                log(f"[3+1] a peer started moving: replicas {counts(records)}, states "
                    f"{sorted((r.stage, r.state) for r in records.values())}")
            if counts(records) == (2, 2) and len(records) == 4 and all(r.state == "online" for r in records.values()):
                break
            await asyncio.sleep(0.25)
        else:
            raise TimeoutError(f"the swarm did not become 2+2 within {deadline - started:.0f}s of training start")
        moved = time.monotonic()
        seconds_to_rebalance = moved - started
        log(f"[3+1] 2+2 after {seconds_to_rebalance:.1f}s of training"
            + (f" (the move began {first_move - started:.1f}s after training start)" if first_move else ""))
        await asyncio.sleep(args.settle_s)
        after = await rate(swarm, args.window_s)
        records = await swarm.probe.records()
        capacities = {s: [round(x.throughput, 1) for x in online(records, s)] for s in (0, 1)}
        log(f"[3+1] after: {after}; peer throughputs by stage {capacities}")
        return {"before": before, "after": after, "seconds_to_rebalance": round(seconds_to_rebalance, 1),
                "move_began_s": round(first_move - started, 1) if first_move else None,
                "still_2_2_at_end": counts(records) == (2, 2), "throughputs_by_stage": capacities}
    finally:
        await asyncio.to_thread(swarm.close)


async def balanced(args, log_dir: Path) -> Dict[str, Any]:
    swarm, _ = await start_swarm(args, "2p2", [0, 0, 1, 1], log_dir)
    try:
        await bring_up(swarm, args, "2+2", [0, 0, 1, 1])
        await wait_training(swarm, 90.0)
        log(f"[2+2] training started; measuring after {args.warmup_s:.0f}s of warm-up")
        await asyncio.sleep(args.warmup_s)
        result = await rate(swarm, args.window_s)
        records = await swarm.probe.records()
        capacities = {s: [round(x.throughput, 1) for x in online(records, s)] for s in (0, 1)}
        log(f"[2+2] balanced: {result}; peer throughputs by stage {capacities}")
        return {"balanced": result, "throughputs_by_stage": capacities}
    finally:
        await asyncio.to_thread(swarm.close)


async def main(args) -> Dict[str, Any]:
    log_dir = make_log_dir(args.log_dir, "bench_rebalance_")
    wall = time.monotonic()
    imb = await imbalanced(args, log_dir)
    bal = await balanced(args, log_dir)
    after, before, base = (imb["after"]["stage1_samples_per_s"], imb["before"]["stage1_samples_per_s"],
                           bal["balanced"]["stage1_samples_per_s"])
    return {
        "throughput_after_rebalance_ratio": round(after / base, 3) if base else None,
        "seconds_to_rebalance": imb["seconds_to_rebalance"],
        "move_began_s": imb["move_began_s"],
        "throughput_before_rebalance": before,
        "throughput_after_rebalance": after,
        "throughput_balanced_from_start": base,
        "throughput_unit": "stage-1 samples/s",
        "before_over_balanced": round(before / base, 3) if base else None,
        "trainer_samples_per_s": {"before": imb["before"]["trainer_samples_per_s"],
                                  "after": imb["after"]["trainer_samples_per_s"],
                                  "balanced": bal["balanced"]["trainer_samples_per_s"]},
        "replicas_in_windows": {"before": [imb["before"]["replicas_start"], imb["before"]["replicas_end"]],
                                "after": [imb["after"]["replicas_start"], imb["after"]["replicas_end"]],
                                "balanced": [bal["balanced"]["replicas_start"], bal["balanced"]["replicas_end"]]},
        "still_2_2_at_end": imb["still_2_2_at_end"],
        "peer_throughputs_after": imb["throughputs_by_stage"], "peer_throughputs_balanced": bal["throughputs_by_stage"],
        "period_s": args.period_s, "wall_s": round(time.monotonic() - wall, 1), "log_dir": str(log_dir),
    }


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    write_record("rebalance", arguments, result,
                 raw={"stage1_samples_per_s_before": [result["throughput_before_rebalance"]],
                      "stage1_samples_per_s_after": [result["throughput_after_rebalance"]],
                      "stage1_samples_per_s_balanced": [result["throughput_balanced_from_start"]],
                      "seconds_to_rebalance": [result["seconds_to_rebalance"]]},
                 headline={key: result[key] for key in (
                     "throughput_after_rebalance_ratio", "seconds_to_rebalance", "move_began_s",
                     "throughput_before_rebalance", "throughput_after_rebalance", "throughput_balanced_from_start",
                     "before_over_balanced", "still_2_2_at_end", "period_s")},
                 notes=["One imbalanced (3+1) and one balanced (2+2) run, each a fresh swarm: one value each, "
                        "no spread.",
                        "Throughput = stage 1's samples/s over a window (every sample passes stage 1 once)."])
    print(json.dumps(result), flush=True)
