"""Fuzzing benchmark: trainer throughput with and without hostile input, and what the peers suffer.

Why: a public swarm's peers get garbage from anyone. This script measures, on a live 2-stage
swarm of subprocesses on loopback, whether random and mutated requests (the generator of
tests/utils/fuzzing.py: raw bytes, wrong types, lying tensor headers, NaN and inf, wrong stages,
unknown methods, truncated streams, streams 10x over the peers' limit) and junk DHT values
crash a peer, make it log a traceback, grow its memory, or slow down an honest trainer.

What runs (every address 127.0.0.1): a bootstrap DHT, one peer per stage of the tests' tiny
model (``--max_message_mb 1``, the tests' fast announce periods), and, one after the other,
two trainers of equal ``--duration_s``: the first during the clean phase (``--clean_s``), the
second during the fuzz phase (``--fuzz_s``), while this process sends fuzz cases to both peers
through its own DHT's P2P, paced at ``--rate_per_s`` with at most ``--max_concurrent`` requests
outstanding (the fuzzer must not take the cores that bootstrap, 2 peers and a trainer share),
and stores junk under the run's DHT keys every 5 s.

Measured:
  requests, answered_with_error   fuzz requests sent, and those answered with an error reply.
  unexpected                      answers a correct peer never gives (an error reply to a
                                  well-formed request, a reply that does not decode, a request
                                  left unanswered, a reply accepting garbage); ``notes`` lists them.
  crashes                         peers whose process died during the run.
  tracebacks                      'Traceback' lines in the peers' logs.
  throughput_ratio_during_fuzz    samples/s of the fuzz-phase trainer / of the clean-phase one
                                  (each: samples_sent of its 'trainer_done' / its duration).
  max_rss_mb                      the largest VmRSS of a peer process (sampled every 0.5 s);
                                  ``max_rss_mb_clean`` is the same over the clean phase.
  fuzzer_cpu_s                    CPU seconds this process (the fuzzer), its DHT and its p2pd
                                  spent in the fuzz phase.
Repeats: ``--repeats N`` runs N pairs of phases in the same swarm, clean and fuzzed taking turns (clean,
fuzz, clean, fuzz, ...; fuzz cases seeded ``--seed`` + the repeat), so that a slow spell of the shared
machine does not land on one side only. Each repeat's figures are in ``repeats``, their spread (n, min,
median, max) in ``spread``; ``throughput_ratio_during_fuzz`` is then the median of the repeats' ratios,
the counts (requests, unexpected, tracebacks) are totals, and the RSS figures the largest seen.

The last line is one JSON object; progress lines come before it. Logs of every process are kept
in ``--log_dir`` (a fresh temporary directory by default; its path is printed). Defaults take
about 3 minutes on a 2-core machine (each further repeat about 2 more).

Usage: python benchmarks/fuzz.py [--clean_s 60] [--fuzz_s 60] [--rate_per_s 100] [--repeats 1] [--log_dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hivemind import DHT  # noqa: E402

from _records import add_record_arguments, spread_of, write_record  # noqa: E402
from _roles import LOOPBACK, RoleProcess, Swarm, cpu_seconds_by_kind  # noqa: E402
from _swarm import install_signal_handlers, log, make_log_dir  # noqa: E402
from tests.utils.fuzzing import FuzzInputs, FuzzStats, fuzz, log_tracebacks, rss_mb, store_junk  # noqa: E402
from tests.utils.processes import FAST_PEER, TINY_MODEL  # noqa: E402

TRAINER = ["--batch_size", "8", "--max_in_flight", "4", "--max_data_mb", "2", "--refresh_period_s", "0.5",
           "--log_period_s", "5"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clean_s", type=float, default=60.0, help="seconds of training with no fuzzing")
    p.add_argument("--fuzz_s", type=float, default=60.0, help="seconds of training while fuzzing")
    p.add_argument("--rate_per_s", type=float, default=100.0,
                   help="fuzz requests per second (a ceiling: see --max_concurrent)")
    p.add_argument("--max_concurrent", type=int, default=8, help="fuzz requests outstanding at once")
    p.add_argument("--max_message_mb", type=float, default=1.0, help="the peers' request limit (MiB)")
    p.add_argument("--seed", type=int, default=0, help="seeds the fuzz cases")
    p.add_argument("--repeats", type=int, default=1, help="pairs of clean and fuzz phases, taking turns")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    args = p.parse_args(argv)
    if args.clean_s <= 0 or args.fuzz_s <= 0 or args.rate_per_s <= 0 or args.max_concurrent < 1 or args.repeats < 1:
        p.error("--clean_s, --fuzz_s and --rate_per_s must be positive, --max_concurrent and --repeats at least 1")
    return args


class PeerWatch:
    """Samples the peers' RSS every 0.5 s in the background; ``max_mb`` is the largest seen, per phase."""

    def __init__(self, peers: List[RoleProcess]):
        self.peers, self.max_mb, self.phase = peers, {}, "clean"
        self._stop = asyncio.Event()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            current = max(rss_mb(process.pid) for process in self.peers)
            self.max_mb[self.phase] = max(self.max_mb.get(self.phase, 0.0), current)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


async def junk_loop(dht: DHT, run_id: str, counts: Dict[str, int]) -> None:
    """Store junk under the run's DHT keys every 5 s until cancelled."""
    rng = random.Random(1)
    while True:
        for name, count in (await store_junk(dht, run_id, rng)).items():
            counts[name] = counts.get(name, 0) + count
        await asyncio.sleep(5.0)


def fuzzer_cpu_s(swarm: Swarm) -> float:
    """CPU seconds of this process's tree (the fuzzer, its DHT and p2pd), leaving out the roles it started."""
    roles = {"fuzzer": os.getpid(), **{process.name: process.pid for process in swarm.processes}}
    return sum(seconds for key, seconds in cpu_seconds_by_kind(roles).items() if key.startswith("fuzzer "))


async def train_for(swarm: Swarm, run_args: List[str], name: str, duration_s: float) -> RoleProcess:
    """Start a trainer that trains for ``duration_s`` seconds once ready; returns it once it is ready."""
    trainer = RoleProcess("train", [*run_args, "--initial_peers", ",".join(swarm.initial_peers), *TRAINER,
                                    "--duration_s", str(duration_s)], swarm.log_dir, name)
    swarm.processes.append(trainer)
    await asyncio.to_thread(trainer.wait_event, "trainer_ready", 90)
    return trainer


async def samples_per_s(trainer: RoleProcess, duration_s: float) -> Dict[str, Any]:
    done = await asyncio.to_thread(trainer.wait_event, "trainer_done", duration_s + 90)
    return {"samples_sent": done["samples_sent"], "samples_per_s": round(done["samples_sent"] / duration_s, 2),
            "failed_micro_batches": done["failed"]}


async def fuzz_phase(args, swarm: Swarm, run_args: List[str], run_id: str, dht: DHT,
                     ids: Dict[int, str], repeat: int = 0) -> Dict[str, Any]:
    """Train for ``fuzz_s`` while fuzzing both peers and storing DHT junk; returns what was measured."""
    p2p = await dht.replicate_p2p()
    trainer = await train_for(swarm, run_args, f"trainer_fuzz{_suffix(repeat)}", args.fuzz_s)
    cpu_before = fuzzer_cpu_s(swarm)
    junk: Dict[str, int] = {}
    inputs = FuzzInputs(args.seed + repeat, max_message_bytes=int(args.max_message_mb * 2**20))
    log(f"fuzzing both peers for {args.fuzz_s:.0f} s, paced at <= {args.rate_per_s:.0f} requests/s with at most "
        f"{args.max_concurrent} outstanding, DHT junk every 5 s")
    junk_task = asyncio.create_task(junk_loop(dht, run_id, junk))
    try:
        stats = await fuzz(p2p, ids, inputs, duration_s=args.fuzz_s, rate_per_s=args.rate_per_s,
                           max_concurrent=args.max_concurrent, timeout_s=20.0, stats=FuzzStats())
    finally:
        junk_task.cancel()
        await asyncio.gather(junk_task, return_exceptions=True)
    elapsed = stats.elapsed_s
    cpu_s = fuzzer_cpu_s(swarm) - cpu_before
    log(f"sent {stats.requests} requests in {elapsed:.1f} s ({stats.requests / elapsed:.1f}/s), fuzzer CPU {cpu_s:.1f} s "
        f"({100 * cpu_s / elapsed:.0f}% of one core, its DHT and p2pd included); outcomes {dict(stats.outcomes)}; "
        f"DHT junk {junk}")
    return {"stats": stats, "trainer": await samples_per_s(trainer, args.fuzz_s), "junk": junk,
            "fuzzer_cpu_s": round(cpu_s, 2), "requests_per_s": round(stats.requests / elapsed, 1)}


def _suffix(repeat: int) -> str:
    """Log names of the first repeat are those of a run without repeats."""
    return f"_r{repeat}" if repeat else ""


async def one_repeat(args, swarm: Swarm, run_args: List[str], run_id: str, dht: DHT, ids: Dict[int, str],
                     watch: PeerWatch, peers: List[RoleProcess], repeat: int) -> Dict[str, Any]:
    """A clean phase, then a fuzz phase, in the running swarm: the figures of this pair."""
    tracebacks_before = log_tracebacks([process.log_path for process in peers])
    watch.phase = f"clean{repeat}"
    log(f"repeat {repeat + 1}/{args.repeats}: clean phase, a trainer trains for {args.clean_s:.0f} s")
    clean = await samples_per_s(await train_for(swarm, run_args, f"trainer_clean{_suffix(repeat)}", args.clean_s),
                                args.clean_s)
    log(f"clean phase: {clean}")
    watch.phase = f"fuzz{repeat}"
    fuzzed = await fuzz_phase(args, swarm, run_args, run_id, dht, ids, repeat)
    log(f"fuzz phase: {fuzzed['trainer']}")
    stats: FuzzStats = fuzzed["stats"]
    for note in stats.notes:
        log(f"unexpected: {note}")
    fuzz_rate = fuzzed["trainer"]["samples_per_s"]
    return {
        "repeat": repeat, "clean_samples_per_s": clean["samples_per_s"], "fuzz_samples_per_s": fuzz_rate,
        "throughput_ratio_during_fuzz": round(fuzz_rate / max(clean["samples_per_s"], 1e-9), 3),
        "requests": stats.requests, "requests_per_s": fuzzed["requests_per_s"],
        "answered_with_error": stats.answered_with_error, "unexpected": stats.unexpected,
        "tracebacks": log_tracebacks([process.log_path for process in peers]) - tracebacks_before,
        "max_rss_mb_clean": round(watch.max_mb.get(f"clean{repeat}", 0.0), 1),
        "max_rss_mb_fuzz": round(watch.max_mb.get(f"fuzz{repeat}", 0.0), 1),
        "fuzzer_cpu_s": fuzzed["fuzzer_cpu_s"], "trainer_clean": clean, "trainer_fuzz": fuzzed["trainer"],
        "outcomes": dict(stats.outcomes), "error_kinds": dict(stats.kinds), "families": dict(stats.families),
        "dht_junk": fuzzed["junk"], "notes": list(stats.notes)}


REPEAT_FIGURES = ("throughput_ratio_during_fuzz", "clean_samples_per_s", "fuzz_samples_per_s", "requests",
                  "requests_per_s", "answered_with_error", "unexpected", "tracebacks", "max_rss_mb_clean",
                  "max_rss_mb_fuzz", "fuzzer_cpu_s")


def _total(repeats: List[Dict[str, Any]], key: str) -> Dict[str, int]:
    """Counters of every repeat added up (``key``: outcomes, error_kinds, families, dht_junk)."""
    total: Dict[str, int] = {}
    for repeat in repeats:
        for name, count in repeat[key].items():
            total[name] = total.get(name, 0) + count
    return total


def summarize(repeats: List[Dict[str, Any]], crashes: int, log_dir: Path) -> Dict[str, Any]:
    """The last-line JSON: totals of the counts, the median repeat's ratio, the largest RSS, and every repeat's
    figures with their spread. With one repeat, the figures of a run without repeats."""
    spread = {key: spread_of(repeats, key) for key in REPEAT_FIGURES}
    return {
        "requests": sum(r["requests"] for r in repeats),
        "answered_with_error": sum(r["answered_with_error"] for r in repeats),
        "unexpected": sum(r["unexpected"] for r in repeats), "crashes": crashes,
        "tracebacks": sum(r["tracebacks"] for r in repeats),
        "throughput_ratio_during_fuzz": spread["throughput_ratio_during_fuzz"]["median"],
        "max_rss_mb": max(max(r["max_rss_mb_clean"], r["max_rss_mb_fuzz"]) for r in repeats),
        "max_rss_mb_clean": max(r["max_rss_mb_clean"] for r in repeats),
        "trainer_clean": repeats[0]["trainer_clean"], "trainer_fuzz": repeats[0]["trainer_fuzz"],
        "requests_per_s": spread["requests_per_s"]["median"], "fuzzer_cpu_s": sum(r["fuzzer_cpu_s"] for r in repeats),
        "outcomes": _total(repeats, "outcomes"), "error_kinds": _total(repeats, "error_kinds"),
        "families": _total(repeats, "families"), "dht_junk": _total(repeats, "dht_junk"),
        "repeats": [{k: v for k, v in r.items() if k not in ("outcomes", "error_kinds", "families", "dht_junk")}
                    for r in repeats],
        "spread": spread, "log_dir": str(log_dir),
    }


async def main(args) -> Dict[str, Any]:
    log_dir = make_log_dir(args.log_dir, "swarm-fuzz-")
    run_id = f"fuzz{uuid.uuid4().hex[:6]}"
    run_args = ["--run_id", run_id, "--num_stages", "2", "--target_batch_size", "64", *TINY_MODEL]
    log(f"logs in {log_dir}")
    swarm, dht, watch = Swarm(log_dir, run_args), None, None
    try:
        swarm.bootstrap()
        peer_args = [["--stage", str(stage), *FAST_PEER, "--max_message_mb", str(args.max_message_mb)] for stage in (0, 1)]
        ready = await asyncio.to_thread(swarm.peers, peer_args)
        ids = {event["stage"]: event["peer_id"] for event in ready}
        peers = swarm.processes[1:3]
        dht = DHT(initial_peers=swarm.initial_peers, host_maddrs=[LOOPBACK], start=True)
        watch = PeerWatch(peers)
        watch.start()
        log("peers ready")
        repeats = [await one_repeat(args, swarm, run_args, run_id, dht, ids, watch, peers, repeat)
                   for repeat in range(args.repeats)]
        await watch.stop()
        crashes = sum(process.proc.poll() is not None for process in peers)
        return summarize(repeats, crashes, log_dir)
    finally:
        if watch is not None:
            await watch.stop()
        swarm.close()
        if dht is not None and dht.is_alive():
            dht.shutdown()


def record(args, result: Dict[str, Any]) -> None:
    """The run's record: every repeat's figures, and the headline a reader needs first."""
    ratio = result["spread"]["throughput_ratio_during_fuzz"]
    write_record("fuzz", args, result,
                 raw={key: [r[key] for r in result["repeats"]] for key in REPEAT_FIGURES},
                 headline={"repeats": len(result["repeats"]), "requests": result["requests"],
                           "unexpected": result["unexpected"], "crashes": result["crashes"],
                           "tracebacks": result["tracebacks"],
                           "throughput_ratio_during_fuzz (median)": result["throughput_ratio_during_fuzz"],
                           "throughput_ratio_during_fuzz (min)": ratio["min"],
                           "throughput_ratio_during_fuzz (max)": ratio["max"],
                           "max_rss_mb": result["max_rss_mb"], "max_rss_mb_clean": result["max_rss_mb_clean"]},
                 notes=["One swarm; each repeat is a clean phase then a fuzz phase, each with a fresh trainer of the "
                        "same duration; the ratio is the fuzz phase's samples/s over the clean phase's just before it.",
                        "Raw values are one per repeat; counts in the headline are totals over the repeats."])


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    record(arguments, result)
    print(json.dumps(result), flush=True)
