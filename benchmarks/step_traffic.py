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

Reported per setting: the mean step length and samples/s of the window, per peer the DHT keys stored
and read per second (their mean over the peers), and the CPU each peer's processes took over the window
(cores, mean over the peers): its main process (serving, stepping, announcing), its helpers (hivemind's
DHT process, which runs every lookup and store and checks every record they carry, and the averager)
and its p2pd. Last line: a JSON list, one object per setting.

Usage: python benchmarks/step_traffic.py [--target_batch_sizes 256,4096] [--window_s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _roles import cpu_seconds_by_kind  # noqa: E402
from _records import add_record_arguments, write_record  # noqa: E402
from _swarm import TINY_MODEL, LiveSwarm, free_port, install_signal_handlers, log, make_log_dir  # noqa: E402

NUM_STAGES = 2
KEYS = "swarm_dht_keys_total"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target_batch_sizes", default="256,4096", help="comma-separated global batches, one run each")
    p.add_argument("--replicas", type=int, default=2, help="replicas per stage")
    p.add_argument("--window_s", type=float, default=60.0, help="seconds between the two scrapes")
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    args = p.parse_args(argv)
    args.targets = [int(t) for t in args.target_batch_sizes.split(",")]
    if args.replicas < 1 or args.window_s <= 0 or any(t <= 0 for t in args.targets):
        p.error("--replicas, --window_s and every target batch size must be positive")
    return args


def dht_keys(url: str) -> Dict[str, float]:
    """operation -> keys stored or read so far (successful or not), from one scrape of a peer's metrics."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    counts: Dict[str, float] = {"store": 0.0, "read": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == KEYS:
                counts[sample.labels["operation"]] = counts.get(sample.labels["operation"], 0.0) + sample.value
    return counts


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
    cores = {kind: statistics.mean((cpu_after.get(f"{name} {kind}", 0.0) - cpu_before.get(f"{name} {kind}", 0.0)) / elapsed
                                   for name in roots)
             for kind in ("python", "helpers", "p2pd")}
    return {
        "target_batch_size": target, "window_s": round(elapsed, 1), "global_steps": step1 - step0,
        "step_s": round(elapsed / (step1 - step0), 2) if step1 > step0 else None,
        "samples_per_s": round((applied1 - applied0) / elapsed, 1),
        "dht_keys_per_s_per_peer": {op: round(statistics.mean(v), 2) for op, v in per_peer.items()},
        "dht_keys_per_s_by_peer": {op: [round(x, 2) for x in v] for op, v in per_peer.items()},
        "cores_per_peer": {"main": round(cores["python"], 3), "helpers": round(cores["helpers"], 3),
                           "p2pd": round(cores["p2pd"], 3)},
    }


async def main(args) -> List[Dict[str, Any]]:
    log_dir = make_log_dir(args.log_dir, "bench_step_traffic_")
    rows = []
    for target in args.targets:
        started = time.monotonic()
        row = await measure(target, args, log_dir)
        log(f"target {target}: {row['global_steps']} steps in {row['window_s']} s (one per {row['step_s']} s), "
            f"{row['samples_per_s']} samples/s; DHT keys per peer per second: stored "
            f"{row['dht_keys_per_s_per_peer']['store']}, read {row['dht_keys_per_s_per_peer']['read']}; "
            f"cores per peer {row['cores_per_peer']} ({time.monotonic() - started:.0f} s wall)")
        rows.append(row)
    return rows


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    rows = asyncio.run(main(arguments))
    write_record("step_traffic", arguments, rows,
                 raw={f"dht_keys_{op}_per_s[target {r['target_batch_size']}]": r["dht_keys_per_s_by_peer"][op]
                      for r in rows for op in ("store", "read")},
                 headline=[{"target_batch_size": r["target_batch_size"], "step_s": r["step_s"],
                            "samples_per_s": r["samples_per_s"],
                            "stored_per_s_per_peer": r["dht_keys_per_s_per_peer"]["store"],
                            "read_per_s_per_peer": r["dht_keys_per_s_per_peer"]["read"],
                            "main_cores_per_peer": r["cores_per_peer"]["main"],
                            "helpers_cores_per_peer": r["cores_per_peer"]["helpers"],
                            "p2pd_cores_per_peer": r["cores_per_peer"]["p2pd"]} for r in rows],
                 notes=["One swarm per target batch size; raw values are one per peer (DHT keys per second over the "
                        "window, from its swarm_dht_keys_total counters)."])
    print(json.dumps(rows), flush=True)
