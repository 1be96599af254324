"""Slow-peer benchmark: does a much slower replica joining a balanced swarm slow it down?

What runs (every address 127.0.0.1): a bootstrap, a balanced 2+2 swarm (2 stages x 2 peers, each
with ``--delay_per_sample_s D``, a sleep per sample that costs no CPU, and a peer's default periods)
and 2 trainers, with global steps (``--target_batch_size``). The emulated devices, not the machine's
cores, bound the swarm: the benchmark asks what the slow replica costs the others through routing,
steps and averaging, which on machines of their own is all it can cost them. For each slowdown S (5 and 50 by default), in a fresh such swarm:
  * ``before``: the swarm's samples/s over ``--window_s``: samples the last stage's replicas processed (every
    sample passes it once; their DHT records, announced every 0.5 s), and the trainers' samples sent as a
    cross-check (their records can lag by seconds on a loaded machine);
  * a replica with ``--delay_per_sample_s S*D`` joins stage 0 (``--stage 0``), downloads the
    stage's state and goes online; after ``--settle_s`` (trainers time it, it may stand by):
  * ``after``: the same samples/s over ``--window_s``, and the share of stage 0's samples it
    processed;
Its log's stand-by line (``standing by on stage 0: ...``), if any, is reported. First, the simulator's
account of the same scenario (:mod:`swarm.simulate.slow_peer`), with and without the policy, is logged.

Policy on and off: every repeat runs the scenario with the trainers' standby policy on (``--slow_replica_tolerance``,
by default the trainers' own default) and off (``--slow_replica_tolerance 0``: throughput-proportional routing
alone, the behaviour before the policy), each in a fresh swarm, taking turns (on, off, then off, on, ...) so that
a slow spell of the shared machine hits both alike. ``--policies on`` or ``--policies off`` runs one of them.

The last line is a JSON list, one entry per slowdown:
``[{"slowdown": 5, "throughput_ratio_after_vs_before": ..., "throughput_ratio_after_vs_before_policy_off": ...,
"policy_off": {...}, "simulated": {...}, ...}, {"slowdown": 50, ...}]``: the top-level figures are those of the
policy-on run of median ratio (of the policy-off one with ``--policies off``), ``policy_off`` the policy-off run of
median ratio, every ratio beside them. Defaults take about 40 minutes on a 2-core machine (three fresh swarms per
slowdown and policy); the figures are noisy when other work runs.

Usage: python benchmarks/slow_peer.py [--slowdowns 5,50] [--repeats 3] [--window_s 60] [--periods live|fast]
       [--policies on,off] [--slow_replica_tolerance 2] [--log_dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import add_record_arguments, take_turns, write_record  # noqa: E402
from _swarm import FAST_PEER, LiveSwarm, counts, install_signal_handlers, log, make_log_dir, online  # noqa: E402
from _roles import cpu_seconds_by_kind, machine_busy_seconds  # noqa: E402
from peers.launcher import RoleProcess  # noqa: E402
from swarm.simulate.slow_peer import SlowPeerScenario, compare  # noqa: E402

MODEL = ["--num_layers", "2", "--hidden_size", "64", "--num_heads", "2", "--seq_len", "32"]
STANDBY_MARK = "standing by on stage"
POLICIES = ("on", "off")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slowdowns", default="5,50", help="comma-separated: how many times slower each joining replica is")
    p.add_argument("--delay_per_sample_s", type=float, default=0.05,
                   help="the balanced peers' emulated device: seconds of sleep per sample of backward work; at 0.05 the "
                        "devices bound the swarm, not the machine's cores (at 0.01 two cores are saturated, and any "
                        "extra process, a replica as fast as the others included, slows the swarm)")
    p.add_argument("--target_batch_size", type=int, default=256, help="samples per global step")
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--max_in_flight", type=int, default=4, help="micro-batches each trainer keeps in flight")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--window_s", type=float, default=60.0, help="seconds each throughput is measured over")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh swarms per slowdown; the run of median ratio is reported (one pair of windows moves by "
                        "about 5%%, the size of the effect measured)")
    p.add_argument("--warmup_s", type=float, default=15.0, help="seconds of training before the first window")
    p.add_argument("--settle_s", type=float, default=10.0, help="seconds after a join or a leave before the next window")
    p.add_argument("--slow_replica_tolerance", type=float, default=None,
                   help="the trainers' --slow_replica_tolerance in the policy-on runs; default: theirs")
    p.add_argument("--policies", default="on,off",
                   help="which runs per repeat: on (the standby policy), off (--slow_replica_tolerance 0), or both")
    p.add_argument("--slow_nice", type=int, default=0,
                   help="niceness of the slow replica's processes: 19 lets them use only CPU the others leave idle, as "
                        "if it ran on its own machine (on one machine its DHT, averaging and p2pd take cores from the "
                        "others); 0 = as the others")
    p.add_argument("--periods", choices=("live", "fast"), default="live",
                   help="the peers' announce, poll and matchmaking periods: live = a peer's defaults, fast = the tests' "
                        "shorter ones (more DHT work per second, which on one machine takes cores from the swarm)")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    args = p.parse_args(argv)
    args.slowdown_list = [float(s) for s in args.slowdowns.split(",") if s.strip()]
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    policies = args.policy_list
    if not policies or any(x not in POLICIES for x in policies) or len(set(policies)) < len(policies):
        p.error(f"--policies must name on, off or both, got {args.policies!r}")
    if args.slow_replica_tolerance == 0 and "on" in args.policy_list:
        p.error("--slow_replica_tolerance 0 turns the policy off: pass --policies off (the policy-off runs use 0)")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if not args.slowdown_list or any(s < 1 for s in args.slowdown_list):
        p.error(f"--slowdowns must be numbers >= 1, got {args.slowdowns!r}")
    return args


def _cpu_s(pid: Optional[int]) -> float:
    return sum(cpu_seconds_by_kind({"slow": pid}).values()) if pid else 0.0


async def rate(swarm: LiveSwarm, window_s: float, watch: Optional[str] = None, watch_pid: Optional[int] = None) -> Dict[str, Any]:
    """The trainers' samples/s over a window, and how busy the machine's cores were; with ``watch``, the
    share of stage 0's samples that replica processed and the CPU its processes (``watch_pid``'s tree) used."""
    first = await snapshot(swarm)
    busy, cpu = machine_busy_seconds(), _cpu_s(watch_pid)
    await asyncio.sleep(window_s)
    busy, cpu = machine_busy_seconds() - busy, _cpu_s(watch_pid) - cpu
    last = await snapshot(swarm)
    elapsed = last.t - first.t
    sent = sum(r.samples_sent for r in last.trainers.values()) - sum(r.samples_sent for r in first.trainers.values())
    start = {r.peer_id: r.samples_processed for r in online(first.peers, 1)}
    stage1 = sum(r.samples_processed - start.get(r.peer_id, 0) for r in online(last.peers, 1))
    result = {"samples_per_s": round(stage1 / elapsed, 2), "trainer_samples_per_s": round(sent / elapsed, 2),
              "window_s": round(elapsed, 1),
              "replicas_end": list(counts(last.peers)), "machine_busy_cores": round(busy / window_s, 2)}
    if watch_pid:
        result["slow_replica_cpu_cores"] = round(cpu / window_s, 3)
    before = {r.peer_id: r.samples_processed for r in online(first.peers, 0)}
    processed = {r.peer_id: r.samples_processed - before.get(r.peer_id, 0) for r in online(last.peers, 0)}
    if watch is not None and sum(processed.values()) > 0:
        result["slow_replica_share_of_stage0"] = round(processed.get(watch, 0) / sum(processed.values()), 4)
    result["stage0_throughputs"] = {peer_id[-6:]: round(r.throughput, 1)
                                    for peer_id, r in ((r.peer_id, r) for r in online(last.peers, 0))}
    return result


async def snapshot(swarm: LiveSwarm, attempts: int = 3):
    """A DHT read that shows the swarm's peers and trainers (a read can come back empty on a loaded machine)."""
    for _ in range(attempts - 1):
        found = await swarm.snapshot()
        if found.peers and found.trainers:
            return found
        await asyncio.sleep(0.5)
    return await swarm.snapshot()


async def start_slow_peer(swarm: LiveSwarm, name: str, delay: float, nice: int, attempts: int = 2):
    """Start the slow replica on stage 0 (at niceness ``nice``); a start that fails (its DHT could not reach the
    bootstrap on a loaded machine) is tried again. Returns the process and its peer id."""
    for attempt in range(attempts):
        args = ["--stage", "0", *swarm._common(), *swarm.peer_args, "--delay_per_sample_s", str(delay)]
        process = RoleProcess("peer", args, swarm.log_dir, f"{swarm.run_id}-{name}_try{attempt}")
        swarm.processes.append(process)
        try:
            ready = await swarm.event(process, "peer_ready", 120.0)
            if nice:  # once it serves: at a low priority its start (p2pd dialing the bootstrap) can time out
                lower_priority(process.pid, nice)
            return process, ready.get("peer_id") or ""
        except TimeoutError as e:
            log(f"the slow replica did not start ({str(e).splitlines()[0]}); {'retrying' if attempt + 1 < attempts else 'giving up'}")
            await asyncio.to_thread(process.stop, 10.0)
    raise RuntimeError(f"the slow replica did not start in {attempts} attempts")


def lower_priority(pid: int, nice: int) -> None:
    """Give the role ``pid`` and everything it forked (its process group) niceness ``nice``, and its session the
    same against other sessions: with the kernel's autogroup scheduling a nice value counts only within a session."""
    try:
        os.setpriority(os.PRIO_PGRP, os.getpgid(pid), nice)
    except OSError as e:
        log(f"could not lower the priority of process group {pid}: {e}")
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError as e:  # no autogroup scheduling here (the process group's nice value then does it), or not permitted
        log(f"could not set the autogroup niceness of {pid}: {e}")


def count_lines(path: Path, mark: str) -> int:
    """Lines of a log that contain ``mark`` (here: averaging rounds that found no group, a sign of an overloaded machine)."""
    try:
        return sum(mark in line for line in path.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def standby_lines(path: Path) -> List[str]:
    try:
        return [line.strip() for line in path.read_text(errors="replace").splitlines() if STANDBY_MARK in line]
    except OSError:
        return []


async def one_slowdown(swarm: LiveSwarm, args, slowdown: float, index: int) -> Dict[str, Any]:
    before = await rate(swarm, args.window_s)
    log(f"[{slowdown:g}x] before: {before}")
    delay = args.delay_per_sample_s * slowdown
    slow, slow_id = await start_slow_peer(swarm, f"slow{index}_{slowdown:g}x", delay, args.slow_nice)
    await swarm.wait_for(lambda r: len(online(r, 0)) == 3, 60.0, "the slow replica online on stage 0")
    log(f"[{slowdown:g}x] a replica {slowdown:g}x slower ({delay:g} s/sample) is online on stage 0; settling {args.settle_s:g}s")
    await asyncio.sleep(args.settle_s)
    after = await rate(swarm, args.window_s, watch=slow_id, watch_pid=slow.pid)
    log(f"[{slowdown:g}x] after: {after}")
    lines = standby_lines(slow.log_path)
    ratio = after["samples_per_s"] / before["samples_per_s"] if before["samples_per_s"] else None
    return {"slowdown": slowdown, "throughput_ratio_after_vs_before": round(ratio, 3) if ratio is not None else None,
            "samples_per_s_before": before["samples_per_s"], "samples_per_s_after": after["samples_per_s"],
            "trainer_samples_per_s": [before["trainer_samples_per_s"], after["trainer_samples_per_s"]],
            "slow_replica_share_of_stage0": after.get("slow_replica_share_of_stage0", 0.0),
            "slow_replica_cpu_cores": after.get("slow_replica_cpu_cores"),
            "machine_busy_cores": [before["machine_busy_cores"], after["machine_busy_cores"]],
            "stage0_throughputs_after": after["stage0_throughputs"],
            "stood_by": bool(lines), "standby_line": STANDBY_MARK + lines[0].split(STANDBY_MARK, 1)[-1] if lines else None}


def tolerance_for(policy: str, args) -> Optional[float]:
    """The trainers' --slow_replica_tolerance in a run of ``policy``: 0 turns the policy off; None leaves theirs."""
    return 0.0 if policy == "off" else args.slow_replica_tolerance


def make_swarm(args, log_dir: Path, label: str, tolerance: Optional[float]) -> LiveSwarm:
    run_id = f"bench_slow_{label}_{uuid.uuid4().hex[:6]}"
    routing = [] if tolerance is None else ["--slow_replica_tolerance", str(tolerance)]
    return LiveSwarm(log_dir, run_id,
                     run_args=["--num_stages", "2", "--target_batch_size", str(args.target_batch_size), *MODEL],
                     peer_args=[] if args.periods == "live" else [*FAST_PEER],
                     trainer_args=["--max_data_mb", "2", "--refresh_period_s", "0.5", "--log_period_s", "0.5",
                                   "--duration_s", "900", "--batch_size", str(args.batch_size),
                                   "--max_in_flight", str(args.max_in_flight), *routing])


async def bring_up(swarm: LiveSwarm, args) -> None:
    """A bootstrap, a balanced 2+2 swarm and the trainers, training until the first global step and a warm-up."""
    log(f"bootstrap, 2+2 peers and {args.trainers} trainers; logs in {swarm.log_dir} (run {swarm.run_id}); "
        f"load {os.getloadavg()}")
    swarm.bootstrap(60.0)
    delay = ["--delay_per_sample_s", str(args.delay_per_sample_s)]
    peers = [swarm.peer(stage, f"s{stage}p{i}", delay) for i, stage in enumerate((0, 0, 1, 1))]
    for process in peers:
        await swarm.event(process, "peer_ready", 120.0)
    await swarm.wait_for(lambda r: counts(r) == (2, 2), 60.0, "a 2+2 swarm")
    trainers = [swarm.trainer(f"trainer{i}", ["--trainer_seed", str(i + 1)]) for i in range(args.trainers)]
    for trainer in trainers:
        await swarm.event(trainer, "trainer_ready", 120.0)
    await swarm.wait_for(lambda r: any(x.step > 0 for x in r.values()), 120.0, "a first global step")
    log(f"training with global steps; warming up {args.warmup_s:g}s")
    await asyncio.sleep(args.warmup_s)


async def one_swarm(args, log_dir: Path, slowdown: float, index: int, repeat: int, policy: str) -> Dict[str, Any]:
    """A fresh balanced swarm, then the slow replica's join: one before/after pair of windows."""
    tolerance = tolerance_for(policy, args)
    swarm = make_swarm(args, log_dir, f"{slowdown:g}x_{policy}_r{repeat}", tolerance)
    try:
        await bring_up(swarm, args)
        result = await one_slowdown(swarm, args, slowdown, index)
        records = await swarm.probe.records()
        result["global_steps"] = max((r.step for r in records.values()), default=0)
        result["rounds_applied_alone"] = sum(count_lines(p.log_path, "applying it alone") for p in swarm.processes
                                             if p.role == "peer")
        result["slow_replica_tolerance"], result["policy"] = tolerance, policy
        result["slow_nice"] = args.slow_nice
        result["periods"], result["delay_per_sample_s"] = args.periods, args.delay_per_sample_s
        result["load_avg_1m"] = round(os.getloadavg()[0], 2)
        log(f"[{slowdown:g}x] policy {policy}, repeat {repeat + 1}/{args.repeats}: ratio "
            f"{result['throughput_ratio_after_vs_before']}")
        return result
    finally:
        await asyncio.to_thread(swarm.close)


def median_run(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The run of median ratio (the lower middle one of an even count), with every run's ratio beside it."""
    ratios = [r["throughput_ratio_after_vs_before"] for r in runs]
    ranked = sorted(range(len(runs)), key=lambda i: -math.inf if ratios[i] is None else ratios[i])
    return {**runs[ranked[(len(runs) - 1) // 2]], "ratios": ratios, "repeats": len(runs)}


def combine_policies(slowdown: float, runs: Dict[str, List[Dict[str, Any]]],
                     simulated: Dict[str, Optional[float]]) -> Dict[str, Any]:
    """One slowdown's entry: the policy-on median run's figures at the top (the policy-off one's if only it ran),
    the policy-off median run beside them, and the simulator's ratios for both."""
    medians = {policy: median_run(found) for policy, found in runs.items() if found}
    top = medians.get("on") or medians["off"]
    entry = {**top, "slowdown": slowdown, "simulated": simulated}
    off = medians.get("off")
    if off is not None and top is not off:
        entry["policy_off"] = off
        entry["throughput_ratio_after_vs_before_policy_off"] = off["throughput_ratio_after_vs_before"]
        entry["ratios_policy_off"] = off["ratios"]
        entry["slow_replica_share_of_stage0_policy_off"] = off["slow_replica_share_of_stage0"]
    return entry


def median_of_policy(entry: Dict[str, Any], policy: str) -> Optional[Dict[str, Any]]:
    """The median run of ``policy`` in a slowdown's entry (see :func:`combine_policies`), or None if it did not run."""
    if entry.get("policy") == policy:
        return entry
    return entry.get("policy_off") if policy == "off" else None


def simulated_ratios(simulated: Dict[str, List[Dict[str, float]]], slowdown: float) -> Dict[str, Optional[float]]:
    """The simulator's after/before ratio at ``slowdown``, with the policy ("on") and without it ("off")."""
    def ratio(rows: List[Dict[str, float]]) -> Optional[float]:
        return next((r["throughput_ratio_after_vs_before"] for r in rows if r["slowdown"] == slowdown), None)
    return {"on": ratio(simulated["policy"]), "off": ratio(simulated["naive"])}


async def main(args) -> List[Dict[str, Any]]:
    log_dir = make_log_dir(args.log_dir, "bench_slow_peer_")
    wall = time.monotonic()
    simulated = compare(SlowPeerScenario(slowdowns=tuple(args.slowdown_list)))
    log("simulated (swarm/simulate/slow_peer.py), throughput ratio after/before by slowdown: policy "
        f"{[(r['slowdown'], r['throughput_ratio_after_vs_before']) for r in simulated['policy']]}, throughput-proportional "
        f"routing alone {[(r['slowdown'], r['throughput_ratio_after_vs_before']) for r in simulated['naive']]}")
    results, every_run = [], []
    for index, slowdown in enumerate(args.slowdown_list):
        runs: Dict[str, List[Dict[str, Any]]] = {policy: [] for policy in args.policy_list}
        for repeat in range(args.repeats):
            for policy in take_turns(args.policy_list, repeat):
                runs[policy].append(await one_swarm(args, log_dir, slowdown, index, repeat, policy))
        every_run += [run for found in runs.values() for run in found]
        results.append(combine_policies(slowdown, runs, simulated_ratios(simulated, slowdown)))
    log(f"done in {time.monotonic() - wall:.0f}s; load {os.getloadavg()}")
    record(args, results, every_run)
    return results


def record(args, results: List[Dict[str, Any]], runs: List[Dict[str, Any]]) -> None:
    """The run's record: every swarm's ratio, rates and share, by slowdown and policy."""
    raw: Dict[str, List[Any]] = {}
    for run in runs:
        cell = f"[{run['slowdown']:g}x, policy {run['policy']}]"
        for key in ("throughput_ratio_after_vs_before", "samples_per_s_before", "samples_per_s_after",
                    "slow_replica_share_of_stage0"):
            raw.setdefault(f"{key}{cell}", []).append(run.get(key))
    headline = []
    for entry in results:
        row: Dict[str, Any] = {"slowdown": entry["slowdown"]}
        for policy in POLICIES:
            run = median_of_policy(entry, policy) or {}
            row[f"ratio_policy_{policy}"] = run.get("throughput_ratio_after_vs_before")
            row[f"share_policy_{policy}"] = run.get("slow_replica_share_of_stage0")
            row[f"stood_by_policy_{policy}"] = run.get("stood_by")
        headline.append({**row, "simulated_on": entry["simulated"]["on"], "simulated_off": entry["simulated"]["off"]})
    write_record("slow_peer", args, results, raw=raw, headline=headline, notes=[
        "ratio = stage 1's samples/s after the slow replica joined stage 0 over before, in one fresh swarm; the "
        "headline is the run of median ratio per slowdown and policy, the raw values every run's.",
        "policy on: the trainers' standby policy (--slow_replica_tolerance, default theirs); off: "
        "--slow_replica_tolerance 0, throughput-proportional routing alone. The runs take turns, on/off then off/on.",
        "share = the slow replica's share of stage 0's samples in the after window.",
        "simulated_*: swarm/simulate/slow_peer.py's account of the same scenario."])


if __name__ == "__main__":
    install_signal_handlers()
    print(json.dumps(asyncio.run(main(parse_args()))), flush=True)
