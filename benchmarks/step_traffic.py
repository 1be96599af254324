"""Control-plane traffic of training stage peers: the DHT keys each one stores and reads per second.

Why: a global step closes on what the replicas know of each other's progress. Near a step they learn it
from progress calls to their stage-mates (``swarm/server/progress.py``), and the DHT is stored and read
about once an announce period. Every store and every read is a DHT traversal (kilobytes on the wire at a few
dozen peers, see ``benchmarks/control_plane.py``), so the rate of those operations is what the control plane
costs a volunteer's link, and the steps per hour and their sizes show what coordinating that way costs
training.

What runs, for each ``--target_batch_sizes`` entry (short steps, then long ones at this machine's rate):
a bootstrap DHT, 2 stages x ``--replicas`` replicas and one trainer on 127.0.0.1, the peers with the live
default periods (announce every 60 s, progress calls every 0.25 s near a step; not the tests' fast ones). Once the last stage has
applied its first global step, every peer's ``swarm_dht_keys`` counters (``--metrics_port``) are scraped at
the start and at the end of a ``--window_s`` window.

Reported per setting: the mean step length and samples/s of the window; the samples of each global step
applied in it, per stage (mean and standard deviation as shares of the target: how closely steps close on
the target, and whether stage 0's steps hold the same micro-batches as the clock's); per peer the DHT keys
stored and read per second and the payload bytes of its progress calls (their mean over the peers); and the
CPU each peer's processes took over the window (cores, mean over the peers): its main process (serving,
stepping, announcing), its helpers (hivemind's DHT process, which runs every lookup and store and checks
every record they carry, and the averager) and its p2pd. With ``--baseline REV`` every setting also runs on
that revision's code, just before this tree's, measured by this script. Last line: a JSON list, one object
per setting (and code).

Usage: python benchmarks/step_traffic.py [--target_batch_sizes 256,4096] [--window_s 60] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _roles import cpu_seconds_by_kind  # noqa: E402
from _records import add_record_arguments, write_record  # noqa: E402
from _swarm import TINY_MODEL, LiveSwarm, free_port, install_signal_handlers, log, make_log_dir  # noqa: E402

NUM_STAGES = 2
KEYS = "swarm_dht_keys_total"
PROGRESS_BYTES = "swarm_rpc_bytes_total"
STEP_LINE = re.compile(r"stage (\d+): global step (\d+) with (\d+) samples from")
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target_batch_sizes", default="256,4096", help="comma-separated global batches, one run each")
    p.add_argument("--replicas", type=int, default=2, help="replicas per stage")
    p.add_argument("--window_s", type=float, default=60.0, help="seconds between the two scrapes")
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    p.add_argument("--baseline", default=None,
                   help="a git revision to measure side by side: each setting runs on its code too, in turn with this "
                        "tree's (from a temporary worktree; the measuring code is this script's)")
    p.add_argument("--json_out", default=None, help=argparse.SUPPRESS)  # a baseline run writes its rows here
    add_record_arguments(p)
    args = p.parse_args(argv)
    args.targets = [int(t) for t in args.target_batch_sizes.split(",")]
    if args.replicas < 1 or args.window_s <= 0 or any(t <= 0 for t in args.targets):
        p.error("--replicas, --window_s and every target batch size must be positive")
    return args


def dht_keys(url: str) -> Dict[str, float]:
    """operation -> keys stored or read so far (successful or not), and ``progress`` -> bytes of progress calls
    sent and received (requests and replies, payloads), from one scrape of a peer's metrics."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    counts: Dict[str, float] = {"store": 0.0, "read": 0.0, "progress": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == KEYS:
                counts[sample.labels["operation"]] = counts.get(sample.labels["operation"], 0.0) + sample.value
            elif sample.name == PROGRESS_BYTES and sample.labels.get("method") == "progress":
                counts["progress"] += sample.value
    return counts


def step_samples(log_dir: Path, run_id: str, windows: Dict[int, Tuple[int, int]]) -> Dict[int, List[int]]:
    """stage -> samples of each global step applied within its ``(first, last)`` steps, from the peers' logs
    ("global step N with X samples": every replica of a group logs the same total; the first line counts)."""
    found: Dict[int, Dict[int, int]] = {stage: {} for stage in windows}
    for path in log_dir.glob(f"{run_id}-s*.log"):
        for line in path.read_text(errors="replace").splitlines():
            match = STEP_LINE.search(line)
            if match:
                stage, step, samples = (int(x) for x in match.groups())
                first, last = windows.get(stage, (1, 0))
                if first <= step <= last:
                    found[stage].setdefault(step, samples)
    return {stage: [steps[k] for k in sorted(steps)] for stage, steps in found.items()}


def spread(samples: List[int], target: int) -> Dict[str, Optional[float]]:
    """Samples per step against the target: mean and standard deviation as shares of it."""
    if not samples:
        return {"steps": 0, "mean_over_target": None, "stdev_over_target": None}
    return {"steps": len(samples), "mean_over_target": round(statistics.mean(samples) / target, 3),
            "stdev_over_target": round(statistics.pstdev(samples) / target, 3)}


async def measure(target: int, args, log_dir: Path) -> Dict[str, Any]:
    run_id = f"traffic_{target}_{uuid.uuid4().hex[:6]}"
    swarm = LiveSwarm(log_dir, run_id, run_args=["--num_stages", str(NUM_STAGES), "--target_batch_size", str(target),
                                                 *TINY_MODEL],
                      peer_args=[], trainer_args=["--batch_size", str(args.batch_size), "--log_period_s", "5"])
    try:
        await asyncio.to_thread(swarm.bootstrap, 60.0)
        peers = [swarm.peer(stage, f"s{stage}p{i}", ["--metrics_port", str(free_port())])
                 for stage in range(NUM_STAGES) for i in range(args.replicas)]
        urls = [(await swarm.event(p, "peer_ready", 120.0))["metrics"] for p in peers]
        trainer = swarm.trainer("trainer0")
        await swarm.event(trainer, "trainer_ready", 120.0)
        last = NUM_STAGES - 1
        await swarm.wait_for(lambda r: any(x.stage == last and x.step >= 1 for x in r.values()), 300.0,
                             "the first global step")
        roots = {f"peer{i}": p.pid for i, p in enumerate(peers)}
        start = await swarm.snapshot()
        before, cpu_before = [await asyncio.to_thread(dht_keys, url) for url in urls], cpu_seconds_by_kind(roots)
        await asyncio.sleep(args.window_s)
        end = await swarm.snapshot()
        after, cpu_after = [await asyncio.to_thread(dht_keys, url) for url in urls], cpu_seconds_by_kind(roots)
    finally:
        await asyncio.to_thread(swarm.close, 20.0)
    elapsed = end.t - start.t

    def clock(snapshot) -> tuple:
        replicas = [r for r in snapshot.peers.values() if r.stage == last]
        return max(r.step for r in replicas), max(r.samples_applied for r in replicas)

    (step0, applied0), (step1, applied1) = clock(start), clock(end)
    per_peer = {op: [(a[op] - b[op]) / elapsed for a, b in zip(after, before)] for op in ("store", "read")}
    progress = [(a["progress"] - b["progress"]) / elapsed for a, b in zip(after, before)]

    def steps_of(snapshot, stage: int) -> int:
        return max((r.step for r in snapshot.peers.values() if r.stage == stage), default=0)

    windows = {stage: (steps_of(start, stage) + 1, steps_of(end, stage)) for stage in range(NUM_STAGES)}
    per_step = step_samples(log_dir, run_id, windows)
    cores = {kind: statistics.mean((cpu_after.get(f"{name} {kind}", 0.0) - cpu_before.get(f"{name} {kind}", 0.0)) / elapsed
                                   for name in roots)
             for kind in ("python", "helpers", "p2pd")}
    return {
        "target_batch_size": target, "window_s": round(elapsed, 1), "global_steps": step1 - step0,
        "step_s": round(elapsed / (step1 - step0), 2) if step1 > step0 else None,
        "samples_per_s": round((applied1 - applied0) / elapsed, 1),
        "dht_keys_per_s_per_peer": {op: round(statistics.mean(v), 2) for op, v in per_peer.items()},
        "dht_keys_per_s_by_peer": {op: [round(x, 2) for x in v] for op, v in per_peer.items()},
        "progress_bytes_per_s_per_peer": round(statistics.mean(progress)),
        "progress_bytes_per_s_by_peer": [round(x) for x in progress],
        "samples_per_step": {f"stage{stage}": spread(v, target) for stage, v in per_step.items()},
        "samples_per_step_raw": {f"stage{stage}": v for stage, v in per_step.items()},
        "cores_per_peer": {"main": round(cores["python"], 3), "helpers": round(cores["helpers"], 3),
                           "p2pd": round(cores["p2pd"], 3)},
    }


def measure_baseline(target: int, args, log_dir: Path, tree: Path) -> Dict[str, Any]:
    """One setting on the baseline's code: this script in a subprocess whose ``swarm`` and ``peers`` (and the
    roles it starts, which run from the tree they are imported from) come from ``tree``."""
    out = log_dir / f"baseline_{target}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--target_batch_sizes", str(target),
               "--replicas", str(args.replicas), "--window_s", str(args.window_s), "--batch_size", str(args.batch_size),
               "--log_dir", str(log_dir / "baseline"), "--no_record", "--json_out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(command, cwd=tree, env=env, check=True, timeout=1800)
    return json.loads(out.read_text())[0]


def _log_row(label: str, row: Dict[str, Any], wall_s: float) -> None:
    log(f"{label} target {row['target_batch_size']}: {row['global_steps']} steps in {row['window_s']} s (one per "
        f"{row['step_s']} s), {row['samples_per_s']} samples/s; samples per step {row['samples_per_step']}; "
        f"DHT keys per peer per second: stored {row['dht_keys_per_s_per_peer']['store']}, read "
        f"{row['dht_keys_per_s_per_peer']['read']}; progress {row['progress_bytes_per_s_per_peer']} B/s per peer; "
        f"cores per peer {row['cores_per_peer']} ({wall_s:.0f} s wall)")


async def main(args) -> List[Dict[str, Any]]:
    log_dir = make_log_dir(args.log_dir, "bench_step_traffic_")
    tree = _worktree(args.baseline) if args.baseline else None
    rows = []
    try:
        for target in args.targets:
            if tree is not None:
                started = time.monotonic()
                base = await asyncio.to_thread(measure_baseline, target, args, log_dir, tree)
                base["code"] = f"baseline {args.baseline}"
                _log_row("baseline", base, time.monotonic() - started)
                rows.append(base)
            started = time.monotonic()
            row = await measure(target, args, log_dir)
            row["code"] = "this tree"
            _log_row("this tree", row, time.monotonic() - started)
            rows.append(row)
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    return rows


def _worktree(revision: str) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="step_traffic_baseline_")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), revision], check=True,
                   capture_output=True)
    return tree


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    rows = asyncio.run(main(arguments))
    if arguments.json_out:
        Path(arguments.json_out).write_text(json.dumps(rows))
    label = lambda r: f"target {r['target_batch_size']}" + (f", {r['code']}" if arguments.baseline else "")  # noqa: E731
    write_record("step_traffic", arguments, rows,
                 raw={**{f"dht_keys_{op}_per_s[{label(r)}]": r["dht_keys_per_s_by_peer"][op]
                         for r in rows for op in ("store", "read")},
                      **{f"progress_bytes_per_s[{label(r)}]": r["progress_bytes_per_s_by_peer"] for r in rows},
                      **{f"samples_per_step_{stage}[{label(r)}]": v
                         for r in rows for stage, v in r["samples_per_step_raw"].items()}},
                 headline=[{"target_batch_size": r["target_batch_size"], "code": r.get("code", "this tree"),
                            "step_s": r["step_s"], "samples_per_s": r["samples_per_s"],
                            "clock_samples_per_step_over_target": r["samples_per_step"]["stage1"]["mean_over_target"],
                            "clock_samples_per_step_stdev": r["samples_per_step"]["stage1"]["stdev_over_target"],
                            "stage0_samples_per_step_stdev": r["samples_per_step"]["stage0"]["stdev_over_target"],
                            "progress_bytes_per_s_per_peer": r["progress_bytes_per_s_per_peer"],
                            "stored_per_s_per_peer": r["dht_keys_per_s_per_peer"]["store"],
                            "read_per_s_per_peer": r["dht_keys_per_s_per_peer"]["read"],
                            "main_cores_per_peer": r["cores_per_peer"]["main"],
                            "helpers_cores_per_peer": r["cores_per_peer"]["helpers"],
                            "p2pd_cores_per_peer": r["cores_per_peer"]["p2pd"]} for r in rows],
                 notes=["One swarm per target batch size (and with --baseline one more on the baseline's code, run "
                        "just before it); raw values are one per peer (DHT keys per second over the window, from its "
                        "swarm_dht_keys_total counters; progress payload bytes per second from swarm_rpc_bytes_total), "
                        "and the samples of each global step applied in the window, per stage, from the peers' logs."])
    print(json.dumps(rows), flush=True)
