"""Churn benchmark: a live 2-stage swarm on loopback loses a peer (SIGKILL) and gains one every period.

Why: SWARM's promise is that training goes on while volunteers come and go. This script
measures, on a real swarm of subprocesses, whether any micro-batch is lost or counted twice
under repeated crashes and joins, how much throughput churn costs, and how long training
stalls at worst.

What runs (every address 127.0.0.1; the tests' fast announce periods, FAST_PEER: announce every
0.5 s, records expire after 3 s):
  * a bootstrap DHT, ``--peers_per_stage`` peers on each of the 2 stages (fixed stages), on a
    model where compute sets a stage's cost (4 layers, hidden 96, seq_len 32) slowed down
    ``--delay_per_sample_s`` (a sleep per sample), so that the peers, not the trainers or the machine's cores,
    limit throughput and a lost replica costs capacity;
    ``--trainers`` trainers (``--max_in_flight 8``) that train for ``lead_s + events * period_s +
    tail_s`` seconds (``--duration_s`` of the trainer) with global steps every
    ``--target_batch_size`` samples (so replicas average, and a killed replica takes accumulated
    gradients with it);
  * churn run: every ``--period_s`` seconds (first event ``--lead_s`` after the trainers are
    ready), one peer is SIGKILLed with its whole process group (its p2pd included), alternately
    from stage 0 and stage 1 (the other stage if that one has a single replica: the benchmark never
    kills the last replica of a stage), and as soon as its DHT record has expired (two reads in a
    row without it) a new peer starts with ``--stage auto`` (it picks the stage that needs
    capacity, downloads that stage's state from a live replica, then serves); the next event
    keeps its schedule whether or not that peer already serves;
  * baseline run: the same swarm, trainers and duration, no churn (skip with ``--no_baseline``).
  Peers do not rebalance (``--rebalance`` is off); only joining peers choose their stage.

Measured:
  samples_sent            sum of the trainers' ``trainer_done`` samples_sent (the churn run).
  samples_accounted       MIN over the two stages of what a stage accounts for once the swarm
                          has settled: max samples_applied over its online replicas + the sum of
                          their samples_pending + samples_frozen (as tests/test_failure.py);
                          ``samples_accounted_by_stage`` has both. Both must equal samples_sent.
  lost                    samples_sent - samples_accounted (negative = counted twice).
  throughput_ratio_vs_no_churn   (samples sent in the churn run) / (samples sent in the baseline),
                          both over the same trainer duration.
  max_stall_s             every ~``--sample_period_s`` the probe reads the DHT: the trainers' records
                          (samples_sent, published every 0.5 s) and stage 1's peer records
                          (samples_processed, announced every 0.5 s). A stall of a counter is an
                          interval in which it did not grow (for stage 1: no online replica's
                          counter grew); max_stall_s is the longest stall of EITHER counter,
                          between training start and the trainers' end (also reported apart:
                          max_stall_trainers_s, max_stall_stage1_s). Resolution ~0.5-1 s: records
                          are announced every 0.5 s and a DHT read takes time.
  resends_by_stage        samples the trainers re-sent per stage (their 're-sent' log lines).
  live_records_missing_from_reads  per peer: probe reads that did not return the record of a peer
                          seen before and after (a live peer that looked gone); trainers reading
                          such a snapshot treat the peer as dead and re-send its contributions.
The last line is one JSON object; progress lines come before it. The probe's series is written to
``<log_dir>/<run_id>-samples.jsonl`` for a post-mortem. Logs of every process are
kept in ``--log_dir`` (a fresh temporary directory by default; its path is printed).

Repeats: ``--repeats N`` runs N churn runs and N baseline runs, taking turns (churn, baseline, then
baseline, churn, ...) so that a slow spell of the shared machine favours neither; each pair's ratio is its
churn run's samples over its baseline's. The top-level figures are those of the repeat of median ratio
(``repeat`` names it; with ``--no_baseline``, the first), ``lost_max`` the most samples any churn run lost,
``repeats`` every repeat's figures and ``spread`` their n, min, median and max.

Defaults (``--period_s 20 --events 4``, 2 peers per stage, 2 trainers, 1 repeat) train 100 s per run and
take about 4-6 minutes in all (both runs) on a 2-core machine (5m43s measured under load average 15,
most of the excess in process start-ups). ``--period_s 60 --events 5``
is "one peer killed and one started per minute" (about 13 minutes).

Usage: python benchmarks/churn.py [--period_s 20] [--events 4] [--repeats 1] [--no_baseline] [--log_dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import add_record_arguments, median_item, spread_of, take_turns, write_record  # noqa: E402
from _swarm import (FAST_PEER, LiveSwarm, Snapshot, accounted, counts, install_signal_handlers,  # noqa: E402
                    log, make_log_dir, online)

# compute, not per-request overhead, sets a stage's cost (as in rebalance.py); with --delay_per_sample_s (a sleep)
# the peers, not the trainers or the 2 cores, limit throughput, so a lost replica costs capacity
MODEL = ["--num_layers", "4", "--hidden_size", "96", "--num_heads", "4", "--seq_len", "32"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--period_s", type=float, default=20.0, help="seconds between churn events (a kill + a join)")
    p.add_argument("--events", type=int, default=4, help="churn events (each: one peer killed, one started)")
    p.add_argument("--lead_s", type=float, default=10.0, help="training seconds before the first event")
    p.add_argument("--tail_s", type=float, default=10.0, help="training seconds after the last event's slot")
    p.add_argument("--peers_per_stage", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--target_batch_size", type=int, default=256, help="samples per global step")
    p.add_argument("--delay_per_sample_s", type=float, default=0.01, help="peers' emulated slow device: seconds of sleep per sample of backward work")
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--max_in_flight", type=int, default=8)
    p.add_argument("--sample_period_s", type=float, default=0.5, help="seconds between DHT reads of the probe")
    p.add_argument("--settle_timeout_s", type=float, default=30.0, help="wait at most this long for the stages to account for every sample")
    p.add_argument("--no_baseline", action="store_true", help="skip the no-churn run (no throughput ratio)")
    p.add_argument("--repeats", type=int, default=1, help="churn runs (and as many baseline runs), taking turns")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.events < 0 or args.period_s <= 0 or args.peers_per_stage < 1 or args.trainers < 1:
        p.error("--repeats, --peers_per_stage and --trainers must be at least 1, --events >= 0, --period_s positive")
    return args


class Sampler:
    """Reads the DHT every period; keeps the series the stall figures and progress lines come from."""

    def __init__(self, swarm: LiveSwarm, period_s: float):
        self.swarm, self.period_s = swarm, period_s
        self.snapshots: List[Snapshot] = []
        self.failed_reads = 0

    async def run(self) -> None:
        last_line = 0.0
        while True:
            started = time.monotonic()
            try:
                snapshot = await asyncio.wait_for(self.swarm.snapshot(), timeout=10.0)
                self.snapshots.append(snapshot)
                if not snapshot.peers:
                    self.failed_reads += 1
            except (asyncio.TimeoutError, Exception):
                self.failed_reads += 1
                snapshot = None
            if snapshot is not None and started - last_line >= 5.0:
                last_line = started
                sent = sum(r.samples_sent for r in snapshot.trainers.values())
                s1 = sum(r.samples_processed for r in online(snapshot.peers, 1))
                steps = sorted({r.step for r in snapshot.peers.values()})
                log(f"  replicas per stage {counts(snapshot.peers)}  trainers sent {sent}  stage-1 processed (online) {s1}"
                    f"  steps {steps}  states {sorted(r.state for r in snapshot.peers.values())}")
            await asyncio.sleep(max(0.0, self.period_s - (time.monotonic() - started)))

    def dump(self, path: Path, t0: float) -> None:
        """The series, one JSON line per DHT read (times in seconds since training start), for a post-mortem."""
        with open(path, "w") as f:
            for snap in self.snapshots:
                f.write(json.dumps({
                    "t": round(snap.t - t0, 2),
                    "trainers": {k[-6:]: r.samples_sent for k, r in snap.trainers.items()},
                    "peers": [[r.peer_id[-6:], r.stage, r.state, r.step, r.accum_step, r.samples_pending,
                               r.samples_frozen, r.samples_admitted, r.samples_applied, r.samples_processed]
                              for r in sorted(snap.peers.values(), key=lambda r: (r.stage, r.peer_id))]}) + "\n")

    def read_gaps(self) -> Dict[str, int]:
        """Reads in which a peer was missing although it appeared both before and after (a live record
        that a DHT read did not return: expired between announcements, or a partial read)."""
        present = [{r.peer_id for r in snap.peers.values()} for snap in self.snapshots]
        gaps: Dict[str, int] = {}
        for peer_id in set().union(*present) if present else ():
            seen = [peer_id in ids for ids in present]
            first, last = seen.index(True), len(seen) - 1 - seen[::-1].index(True)
            missing = sum(1 for x in seen[first:last + 1] if not x)
            if missing:
                gaps[peer_id[-6:]] = missing
        return gaps

    def stalls(self, start: float, end: float) -> Dict[str, float]:
        """Longest interval within [start, end] in which each counter did not grow."""
        best_sent: Dict[str, int] = {}
        best_s1: Dict[str, int] = {}
        last_sent = last_s1 = start
        stall_sent = stall_s1 = 0.0
        for snap in self.snapshots:
            grew_sent = grew_s1 = False
            for trainer_id, record in snap.trainers.items():
                if record.samples_sent > best_sent.get(trainer_id, 0):
                    best_sent[trainer_id] = record.samples_sent
                    grew_sent = True
            for record in online(snap.peers, 1):
                if record.samples_processed > best_s1.get(record.peer_id, 0):
                    best_s1[record.peer_id] = record.samples_processed
                    grew_s1 = True
            if snap.t < start:
                continue
            t = min(snap.t, end)
            if grew_sent:
                stall_sent, last_sent = max(stall_sent, t - last_sent), t
            if grew_s1:
                stall_s1, last_s1 = max(stall_s1, t - last_s1), t
            if snap.t >= end:
                break
        stall_sent = max(stall_sent, end - last_sent)
        stall_s1 = max(stall_s1, end - last_s1)
        return {"max_stall_trainers_s": round(stall_sent, 2), "max_stall_stage1_s": round(stall_s1, 2)}


async def churn_events(swarm: LiveSwarm, args, t0: float, peers: Dict[str, Any], report: List[Dict[str, Any]]) -> None:
    """Every period: SIGKILL one peer (alternating stages), wait for its record to expire, start a --stage auto peer
    (without waiting for it to serve: the next event keeps its schedule)."""
    joins: List[asyncio.Task] = []
    for i in range(args.events):
        await asyncio.sleep(max(0.0, t0 + args.lead_s + i * args.period_s - time.monotonic()))
        records = await swarm.probe.records()
        wanted = i % 2
        stage = next((s for s in (wanted, 1 - wanted) if len(online(records, s)) >= 2), None)
        event: Dict[str, Any] = {"event": i, "t_s": round(time.monotonic() - t0, 1), "wanted_stage": wanted}
        if stage is None:
            event["skipped"] = f"no stage has 2 online replicas (replicas per stage {counts(records)})"
            log(f"event {i}: skipped: {event['skipped']}")
            report.append(event)
            continue
        candidates = sorted((r for r in online(records, stage) if r.peer_id in peers),
                            key=lambda r: peers[r.peer_id]["started"])  # the longest-serving peer goes first
        if not candidates:
            event["skipped"] = "no online peer of that stage has reported ready yet"
            log(f"event {i}: skipped: {event['skipped']}")
            report.append(event)
            continue
        victim_id = candidates[0].peer_id
        victim = peers[victim_id]
        log(f"event {i}: SIGKILL {victim['process'].name} ({victim_id[-6:]}) on stage {stage} at step "
            f"{records[victim_id].step} (pending {records[victim_id].samples_pending}, frozen "
            f"{records[victim_id].samples_frozen}); replicas per stage {counts(records)}")
        await asyncio.to_thread(victim["process"].kill_group)
        killed_at = time.monotonic()
        event.update(killed_stage=stage, victim=victim["process"].name)
        absent = 0  # two reads in a row without it: a single DHT read may miss a live record
        while absent < 2 and time.monotonic() - killed_at < 20.0:
            absent = absent + 1 if victim_id not in await swarm.probe.records() else 0
            await asyncio.sleep(0.3)
        if absent < 2:
            log(f"event {i}: the killed peer's record was still in the DHT 20s after the kill")
        event["record_expired_after_s"] = round(time.monotonic() - killed_at, 1)
        name = f"joiner{i}"
        joins.append(asyncio.create_task(join(swarm, name, event, peers)))
        report.append(event)
    if joins:  # the last joiners may still be starting: give them their bounded time
        await asyncio.wait(joins, timeout=150.0)


async def join(swarm: LiveSwarm, name: str, event: Dict[str, Any], peers: Dict[str, Any]) -> None:
    """Start a --stage auto peer and record which stage it chose and how long it took to serve."""
    i = event["event"]
    process = swarm.peer("auto", name)
    started = time.monotonic()
    try:
        ready = await swarm.event(process, "peer_ready", 120.0)
    except TimeoutError as e:
        event["join_failed"] = str(e).splitlines()[0]
        log(f"event {i}: new peer {name} did not become ready: {e}")
        return
    peers[ready["peer_id"]] = {"process": process, "started": started}
    event.update(joined_stage=ready["stage"], joined_at_step=ready["step"],
                 join_ready_s=round(time.monotonic() - started, 1))
    log(f"event {i}: {name} ({ready['peer_id'][-6:]}) joined stage {ready['stage']} at step {ready['step']} "
        f"after {event['join_ready_s']}s (record of the victim expired {event['record_expired_after_s']}s after the kill)")


def resends_by_stage(paths) -> Dict[int, int]:
    """Micro-batch re-sends the trainers logged ('re-sent ID (N samples) to stage S'), in samples per stage."""
    found: Dict[int, int] = {}
    for path in paths:
        for match in re.finditer(r"re-sent \S+ \((\d+) samples\) to stage (\d+)", Path(path).read_text(errors="replace")):
            found[int(match.group(2))] = found.get(int(match.group(2)), 0) + int(match.group(1))
    return found


async def run_once(args, churn: bool, log_dir: Path) -> Dict[str, Any]:
    label = "churn" if churn else "baseline"
    duration_s = args.lead_s + args.events * args.period_s + args.tail_s
    run_id = f"bench_{label}_{uuid.uuid4().hex[:6]}"
    swarm = LiveSwarm(
        log_dir, run_id,
        run_args=["--num_stages", "2", "--target_batch_size", str(args.target_batch_size), *MODEL],
        peer_args=[*FAST_PEER, "--delay_per_sample_s", str(args.delay_per_sample_s)],
        trainer_args=["--max_data_mb", "2", "--refresh_period_s", "0.5", "--log_period_s", "0.5",
                      "--batch_size", str(args.batch_size), "--max_in_flight", str(args.max_in_flight),
                      "--duration_s", str(duration_s)])
    sampler_task: Optional[asyncio.Task] = None
    churn_task: Optional[asyncio.Task] = None
    try:
        log(f"[{label}] starting a bootstrap, {args.peers_per_stage} peers per stage; logs in {log_dir} (run {run_id})")
        swarm.bootstrap(60.0)
        starting = [(swarm.peer(stage, f"s{stage}p{i}"), time.monotonic())
                    for i in range(args.peers_per_stage) for stage in (0, 1)]
        peers: Dict[str, Any] = {}
        for process, started in starting:
            ready = await swarm.event(process, "peer_ready", 120.0)
            peers[ready["peer_id"]] = {"process": process, "started": started}
        await swarm.wait_for(lambda r: counts(r) == (args.peers_per_stage,) * 2, 60.0, "every peer online")
        trainers = [swarm.trainer(f"trainer{i}", ["--trainer_seed", str(i + 1)]) for i in range(args.trainers)]
        for trainer in trainers:
            await swarm.event(trainer, "trainer_ready", 120.0)
        t0 = time.monotonic()
        log(f"[{label}] {args.trainers} trainers ready; training for {duration_s:.0f}s")
        sampler = Sampler(swarm, args.sample_period_s)
        sampler_task = asyncio.create_task(sampler.run())
        events: List[Dict[str, Any]] = []
        if churn:
            churn_task = asyncio.create_task(churn_events(swarm, args, t0, peers, events))

        done_events: List[Dict[str, Any]] = []
        first_done: Optional[float] = None
        for trainer in trainers:
            done = await swarm.event(trainer, "trainer_done", duration_s + 180.0 - (time.monotonic() - t0))
            first_done = first_done or time.monotonic()
            done_events.append(done)
        if churn_task is not None:
            try:  # done by now unless a join is still starting
                await asyncio.wait_for(churn_task, timeout=180.0)
            except Exception as e:
                log(f"[{label}] churn events ended with {type(e).__name__}: {e}")
        sent = sum(d["samples_sent"] for d in done_events)
        log(f"[{label}] trainers done: " + ", ".join(
            f"sent {d['samples_sent']} failed {d['failed']} resent {d['resent']} drained {d['drained']}" for d in done_events))

        settle_started = time.monotonic()
        records: Dict[str, Any] = {}
        settled = False
        while time.monotonic() - settle_started < args.settle_timeout_s:
            records = await swarm.probe.records()
            if records and all(accounted(records, s) == sent for s in (0, 1)) \
                    and all(r.state == "online" and not r.samples_frozen for r in records.values()):
                settled = True
                break
            await asyncio.sleep(0.5)
        by_stage = [accounted(records, s) for s in (0, 1)]
        log(f"[{label}] {'settled' if settled else 'NOT settled'} after {time.monotonic() - settle_started:.1f}s: "
            f"accounted by stage {by_stage} for {sent} sent")
        for r in sorted(records.values(), key=lambda r: (r.stage, r.peer_id)):
            log(f"    stage {r.stage} {r.peer_id[-6:]} {r.state} step {r.step} accum {r.accum_step} applied "
                f"{r.samples_applied} pending {r.samples_pending} frozen {r.samples_frozen} processed {r.samples_processed}")
        sampler_task.cancel()
        sampler.dump(log_dir / f"{run_id}-samples.jsonl", t0)
        stalls = sampler.stalls(t0, min(first_done, t0 + duration_s))
        return {
            "samples_sent": sent, "samples_accounted_by_stage": by_stage, "settled": settled,
            "throughput_samples_per_s": sent / duration_s, "duration_s": duration_s,
            "failed": sum(d["failed"] for d in done_events), "resent": sum(d["resent"] for d in done_events),
            "drained": all(d["drained"] for d in done_events), "events": events,
            "replicas_per_stage_at_end": list(counts(records)), "failed_dht_reads": sampler.failed_reads, **stalls,
            "live_records_missing_from_reads": sampler.read_gaps(),
            "resends_by_stage": resends_by_stage([t.log_path for t in trainers]),
        }
    finally:
        for task in (sampler_task, churn_task):
            if task is not None and not task.done():
                task.cancel()
        await asyncio.to_thread(swarm.close)


async def one_repeat(args, log_dir: Path, repeat: int) -> Dict[str, Any]:
    """A churn run and (unless ``--no_baseline``) a baseline run, in this repeat's turn: the pair's figures."""
    churned, baseline, baseline_error = None, None, None
    for kind in take_turns(["churn"] if args.no_baseline else ["churn", "baseline"], repeat):
        log(f"repeat {repeat + 1}/{args.repeats}: the {kind} run")
        if kind == "churn":
            churned = await run_once(args, churn=True, log_dir=log_dir)
            continue
        try:
            baseline = await run_once(args, churn=False, log_dir=log_dir)
        except (TimeoutError, OSError, RuntimeError) as e:  # still report the churn run's figures
            baseline_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"[baseline] failed: {e}")
    return {"repeat": repeat, **pair_figures(args, churned, baseline, baseline_error)}


REPEAT_FIGURES = ("throughput_ratio_vs_no_churn", "lost", "max_stall_s", "churn_samples_per_s",
                  "baseline_samples_per_s", "baseline_max_stall_s", "baseline_lost", "failed_micro_batches", "resent",
                  "kills", "joins")


async def main(args) -> Dict[str, Any]:
    log_dir = make_log_dir(args.log_dir, "bench_churn_")
    wall = time.monotonic()
    repeats = [await one_repeat(args, log_dir, repeat) for repeat in range(args.repeats)]
    return {**summarize(repeats, args.no_baseline), "wall_s": round(time.monotonic() - wall, 1),
            "log_dir": str(log_dir)}


def summarize(repeats: List[Dict[str, Any]], no_baseline: bool) -> Dict[str, Any]:
    """The repeat of median ratio (the first without baselines) at the top, the most samples any churn run lost,
    every repeat's figures and their spread."""
    chosen = repeats[0] if no_baseline else median_item(repeats, "throughput_ratio_vs_no_churn")
    return {**chosen, "lost_max": max(r["lost"] for r in repeats),
            "repeats": [{key: r.get(key) for key in ("repeat", *REPEAT_FIGURES)} for r in repeats],
            "spread": {key: spread_of(repeats, key) for key in REPEAT_FIGURES}}


def pair_figures(args, churned: Dict[str, Any], baseline: Optional[Dict[str, Any]],
                 baseline_error: Optional[str]) -> Dict[str, Any]:
    """The figures of one churn run beside its baseline run (see the module docstring)."""
    accounted_min = min(churned["samples_accounted_by_stage"])
    return {
        "samples_sent": churned["samples_sent"],
        "samples_accounted": accounted_min,
        "samples_accounted_is": "min over stages",
        "samples_accounted_by_stage": churned["samples_accounted_by_stage"],
        "lost": churned["samples_sent"] - accounted_min,
        "lost_by_stage": [churned["samples_sent"] - a for a in churned["samples_accounted_by_stage"]],
        "throughput_ratio_vs_no_churn": (round(churned["samples_sent"] / baseline["samples_sent"], 3)
                                         if baseline and baseline["samples_sent"] else None),
        "max_stall_s": max(churned["max_stall_trainers_s"], churned["max_stall_stage1_s"]),
        "max_stall_trainers_s": churned["max_stall_trainers_s"],
        "max_stall_stage1_s": churned["max_stall_stage1_s"],
        "churn_samples_per_s": round(churned["throughput_samples_per_s"], 2),
        "baseline_samples_per_s": round(baseline["throughput_samples_per_s"], 2) if baseline else None,
        "baseline_max_stall_s": (max(baseline["max_stall_trainers_s"], baseline["max_stall_stage1_s"])
                                 if baseline else None),
        "baseline_lost": (baseline["samples_sent"] - min(baseline["samples_accounted_by_stage"])) if baseline else None,
        "baseline_error": baseline_error,
        "settled": churned["settled"], "drained": churned["drained"],
        "failed_micro_batches": churned["failed"], "resent": churned["resent"],
        "kills": sum(1 for e in churned["events"] if "killed_stage" in e),
        "joins": sum(1 for e in churned["events"] if "joined_stage" in e),
        "events": [{k: v for k, v in e.items() if k != "event"} for e in churned["events"]],
        "replicas_per_stage_at_end": churned["replicas_per_stage_at_end"],
        "resends_by_stage": churned["resends_by_stage"],
        "live_records_missing_from_reads": churned["live_records_missing_from_reads"],
        "train_duration_s": churned["duration_s"], "period_s": args.period_s,
    }


def record(args, result: Dict[str, Any]) -> None:
    """The run's record: every repeat's figures, and the headline a reader needs first."""
    ratio = result["spread"]["throughput_ratio_vs_no_churn"]
    write_record("churn", args, result, raw={key: [r[key] for r in result["repeats"]] for key in REPEAT_FIGURES},
                 headline={"repeats": len(result["repeats"]), "lost (median-ratio repeat)": result["lost"],
                           "lost_max": result["lost_max"], "throughput_ratio_vs_no_churn (median)": ratio["median"],
                           "throughput_ratio_vs_no_churn (min)": ratio["min"],
                           "throughput_ratio_vs_no_churn (max)": ratio["max"],
                           "max_stall_s (median)": result["spread"]["max_stall_s"]["median"],
                           "baseline_max_stall_s (median)": result["spread"]["baseline_max_stall_s"]["median"],
                           "kills": result["kills"], "joins": result["joins"]},
                 notes=["Each repeat: a churn run and a baseline run (same swarm, trainers and duration, no churn), "
                        "each a fresh swarm, taking turns; the ratio is the churn run's samples sent over its "
                        "baseline's.",
                        "lost = samples sent - the least any stage accounts for once settled (negative: counted "
                        "twice).",
                        "Raw values are one per repeat; kills and joins in the headline are the median-ratio "
                        "repeat's."])


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    record(arguments, result)
    print(json.dumps(result), flush=True)
