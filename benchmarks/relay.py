"""Relay benchmark: a trainer trains through a stage peer that accepts no incoming connections.

Why: a volunteer behind NAT serves through the run's bootstrap as a libp2p circuit relay. This script
measures what that costs: how long after the peer starts the first micro-batch gets through (the relay
reservation), and the training throughput through the relay against a direct connection.

What runs, per cell ("relayed", then "direct"), one after another:
  * 3 hosts: network namespaces on a bridge (``peers/netns.py``), addresses from 198.18.0.0/15;
  * host 0 the bootstrap (the relay), host 1 the run's only stage peer (one stage), host 2 the trainer.
    In the relayed cell host 1 listens only on an address no other host has a route to
    (:meth:`peers.netns.Hosts.unroutable_address`): nothing can connect to it, its own connections out work;
  * the trainer trains for ``--duration_s`` seconds from the moment the peer is ready.

Measured, per cell:
  reachability       what the peer's check said ("unreachable" / "reachable").
  first_sample_s     seconds from the peer's ready event to the trainer's first progress line with samples
                     (to within --log_period 1 s): in the relayed cell, the wait for the relay reservation.
  tokens_per_s       samples sent x seq_len / seconds from the first sample to the end of training.

Needs root. Everything it makes carries a random tag and is removed at the end of each cell.
Output: progress lines, then one JSON list, one object per cell.

Usage: sudo python benchmarks/relay.py [--duration_s 300] [--cells relayed,direct]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _records import add_record_arguments, write_record  # noqa: E402
from _swarm import FAST_PEER, TINY_MODEL, install_signal_handlers, log, make_log_dir  # noqa: E402
from peers.launcher import RoleProcess, stop_all  # noqa: E402
from peers.netns import Hosts, namespaces_unavailable  # noqa: E402

BOOTSTRAP, PEER, TRAINER = range(3)
READY_TIMEOUT_S = 120.0
SEQ_LEN = 16  # TINY_MODEL's
_PROGRESS = re.compile(r"samples\s+(\d+)\s+loss")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration_s", type=float, default=300.0, help="seconds the trainer runs, from the peer's start")
    p.add_argument("--cells", default="relayed,direct", help="which cells to run, comma-separated")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    return p.parse_args(argv)


def _samples(trainer: RoleProcess) -> int:
    found = _PROGRESS.findall(trainer.log_tail(50))
    return int(found[-1]) if found else 0


def run_cell(args, log_dir: Path, cell: str) -> Dict[str, Any]:
    hosts = Hosts(3).create()
    roles: List[RoleProcess] = []

    def start(role: str, host: int, extra: List[str], listen: str) -> RoleProcess:
        process = RoleProcess(role, [*extra, "--host_maddrs", listen], log_dir, f"{cell}-{role}", prefix=hosts.prefix(host))
        roles.append(process)
        return process

    try:
        listen = f"/ip4/{hosts.unroutable_address(PEER) if cell == 'relayed' else hosts.address(PEER)}/tcp/0"
        run = ["--run_id", f"relay_{cell}", "--num_stages", "1"]
        bootstrap = start("bootstrap", BOOTSTRAP, run, f"/ip4/{hosts.address(BOOTSTRAP)}/tcp/0")
        initial = bootstrap.wait_event("bootstrap_ready", READY_TIMEOUT_S)["maddrs"]
        common = [*run, "--initial_peers", ",".join(initial), "--target_batch_size", "64", *TINY_MODEL]
        peer = start("peer", PEER, ["--stage", "0", *common, *FAST_PEER], listen)
        ready = peer.wait_event("peer_ready", READY_TIMEOUT_S)
        started = time.monotonic()
        trainer = start("train", TRAINER, [*common, "--max_data_mb", "2", "--duration_s", str(args.duration_s),
                                           "--refresh_period_s", "0.5", "--log_period_s", "1"],
                        f"/ip4/{hosts.address(TRAINER)}/tcp/0")
        first: Optional[float] = None
        first_samples = 0
        while time.monotonic() - started < args.duration_s + READY_TIMEOUT_S and trainer.proc.poll() is None:
            if first is None and _samples(trainer) > 0:
                first, first_samples = time.monotonic() - started, _samples(trainer)
                log(f"{cell}: first samples through the peer {first:.0f} s after it was ready")
            time.sleep(1.0)
        done = trainer.wait_event("trainer_done", READY_TIMEOUT_S)
        ended = time.monotonic() - started
    finally:
        stop_all(roles, 10.0)
        hosts.close()
    samples = done["samples_sent"]
    through = ended - first if first is not None else None
    return {"cell": cell, "reachability": ready.get("reachability"), "announced": ready.get("maddrs"),
            "first_sample_s": round(first, 1) if first is not None else None, "samples": samples,
            "tokens_per_s": round((samples - first_samples) * SEQ_LEN / through, 1) if through else None}


def main(args) -> List[Dict[str, Any]]:
    reason = namespaces_unavailable()
    if reason:
        raise SystemExit(f"relay.py needs network namespaces: {reason}")
    log_dir = make_log_dir(args.log_dir, "bench_relay_")
    cells = []
    for cell in args.cells.split(","):
        result = run_cell(args, log_dir, cell)
        cells.append(result)
        log(f"{cell}: {result}")
    log(f"logs in {log_dir}")
    return cells


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    cells = main(arguments)
    write_record("relay", arguments, cells,
                 raw={f"{key}[{c['cell']}]": [c.get(key)] for c in cells for key in ("first_sample_s", "tokens_per_s")},
                 headline=[{k: c.get(k) for k in ("cell", "reachability", "first_sample_s", "tokens_per_s", "samples")}
                           for c in cells],
                 notes=["One trainer run per cell: one value each, no spread.",
                        "first_sample_s counts from the peer's ready event; in the relayed cell it is the wait for "
                        "the relay reservation."])
    print(json.dumps(cells), flush=True)
