"""Averaging benchmark: overlapped against synchronous averaging, in a 2+2 swarm whose stage all-reduce is slow.

Why: a stage's replicas average their gradients every global step. Synchronous, they compute nothing while
they do; overlapped (``--overlap_averaging true``), they accumulate the next step's gradients meanwhile. At
model scale over home links the all-reduce takes seconds, so the difference is most of a step.

What runs, per setting (overlap off, then on), one after another:
  * 7 hosts: network namespaces on a bridge (``peers/netns.py``), addresses from 198.18.0.0/15, each host's
    link limited to ``--mbit`` each way with ``tc`` tbf (bandwidth only, no latency);
  * host 0 the bootstrap, hosts 1-2 stage 0's replicas, hosts 3-4 stage 1's, hosts 5-6 a trainer each;
  * a model of ``--hidden`` x ``--num_layers`` (by default 2 layers of 1024: 50 MB of float32 gradients per
    stage), the run's defences on (the robust all-reduce sends each replica's whole gradient to the other),
    ``--compression`` for activations and the all-reduce;
  * the trainers train for ``--duration_s`` seconds.

Measured, per setting:
  samples_per_s   samples both trainers sent / the longer of their training times.
  loss            the mean of the trainers' losses over their last micro-batches (at unequal samples: the
                  overlapped run sends more; compare ``loss_at_equal_samples`` for parity).
  loss_at_equal_samples  each trainer's loss at the sample count the synchronous run reached, read from its
                  loss history (mean over trainers).

Needs root (namespaces and qdiscs). Everything it makes carries a random tag and is removed at the end of each
setting, also on Ctrl-C or error.

Output: progress lines, then one JSON list, one object per setting: {"overlap", "samples_per_s", "samples",
"train_s", "loss", "loss_at_equal_samples"}, and the ratio of samples/s (overlap over synchronous).

Usage: sudo python benchmarks/averaging.py [--mbit 50] [--hidden 1024] [--duration_s 120]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _records import add_record_arguments, write_record  # noqa: E402
from _swarm import FAST_PEER, LimitedHosts, install_signal_handlers, log, make_log_dir  # noqa: E402
from peers.launcher import RoleProcess  # noqa: E402
from peers.netns import namespaces_unavailable  # noqa: E402

BOOTSTRAP, TRAINERS = 0, (5, 6)
REPLICAS = ((0, 1), (0, 2), (1, 3), (1, 4))  # (stage, host)
READY_TIMEOUT_S = 240.0
SLOW_LINK_PEER = ["--averaging_timeout_s", "120", "--state_download_timeout_s", "240"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mbit", type=float, default=50.0, help="Mbit/s of every host's link")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--target_batch_size", type=int, default=64)
    p.add_argument("--compression", default="none")
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--max_in_flight", type=int, default=4)
    p.add_argument("--duration_s", type=float, default=120.0, help="seconds each trainer trains, per setting")
    p.add_argument("--log_dir", default=None)
    add_record_arguments(p)
    return p.parse_args(argv)


def _run_flags(args, run_id: str) -> List[str]:
    return ["--run_id", run_id, "--num_stages", "2", "--target_batch_size", str(args.target_batch_size),
            "--num_layers", str(args.num_layers), "--hidden_size", str(args.hidden),
            "--num_heads", str(max(1, args.hidden // 64)), "--seq_len", str(args.seq_len), "--lr", str(args.lr),
            "--compression", args.compression]


_PROGRESS = re.compile(r"samples\s+(\d+)\s+loss\s+([0-9.]+)")  # a trainer's progress line (peers/trainer.py)


def _history(trainer: RoleProcess) -> List[Tuple[int, float]]:
    """(samples sent, recent loss) from each progress line of the trainer's log."""
    return [(int(n), float(loss)) for n, loss in _PROGRESS.findall(trainer.log_path.read_text(errors="replace"))]


def _loss_at(history: List[Tuple[int, float]], samples: int) -> Optional[float]:
    """The trainer's logged loss at the last progress line at or below ``samples`` sent."""
    points = [loss for n, loss in history if n <= samples and math.isfinite(loss)]
    return points[-1] if points else None


def run_setting(args, log_dir: Path, overlap: bool) -> Dict[str, Any]:
    """One 2+2 swarm across 7 limited hosts, from bootstrap to figures; removes everything it made."""
    name = f"avg_{'overlap' if overlap else 'sync'}"
    with LimitedHosts(7, args.mbit, log_dir, name) as swarm:
        run = _run_flags(args, name)
        bootstrap = swarm.start("bootstrap", BOOTSTRAP, ["--run_id", name, "--num_stages", "2"], "bootstrap")
        initial = ["--initial_peers", ",".join(bootstrap.wait_event("bootstrap_ready", READY_TIMEOUT_S)["maddrs"])]
        peers = [swarm.start("peer", host, ["--stage", str(stage), *run, *initial, *FAST_PEER, *SLOW_LINK_PEER,
                                            "--overlap_averaging", "true" if overlap else "false"], f"s{stage}h{host}")
                 for stage, host in REPLICAS]
        for peer in peers:
            peer.wait_event("peer_ready", READY_TIMEOUT_S)
        trainers = [swarm.start("train", host, [*run, *initial, "--max_data_mb", "2", "--batch_size",
                                                str(args.batch_size), "--max_in_flight", str(args.max_in_flight),
                                                "--duration_s", str(args.duration_s), "--trainer_seed", str(i),
                                                "--log_period_s", "5"], f"trainer{i}")
                    for i, host in enumerate(TRAINERS)]
        done = [t.wait_event("trainer_done", args.duration_s + READY_TIMEOUT_S) for t in trainers]
    samples = sum(int(d["samples_sent"]) for d in done)
    train_s = max(float(d["train_s"]) for d in done)
    losses = [float(d["loss"]) for d in done if isinstance(d.get("loss"), float) and math.isfinite(d["loss"])]
    return {"overlap": overlap, "samples_per_s": round(samples / train_s, 3) if train_s > 0 else None,
            "samples": samples, "train_s": round(train_s, 1),
            "loss": round(statistics.mean(losses), 4) if losses else None,
            "histories": [_history(t) for t in trainers]}


def main(args) -> List[Dict[str, Any]]:
    reason = namespaces_unavailable()
    if reason:
        raise SystemExit(f"averaging.py needs network namespaces: {reason}")
    log_dir = make_log_dir(args.log_dir, "bench_averaging_")
    cells = []
    for overlap in (False, True):
        started = time.monotonic()
        cell = run_setting(args, log_dir, overlap)
        cells.append(cell)
        log(f"overlap {overlap}: {cell['samples_per_s']} samples/s ({cell['samples']} in {cell['train_s']} s), "
            f"loss {cell['loss']} ({time.monotonic() - started:.0f}s)")
    equal = min(c["samples"] // 2 for c in cells)  # per trainer, what both runs reached
    for cell in cells:
        at = [_loss_at(h, equal) for h in cell.pop("histories")]
        cell["loss_at_equal_samples"] = round(statistics.mean(at), 4) if all(a is not None for a in at) else None
    log(f"logs in {log_dir}")
    return cells


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    cells = main(arguments)
    sync, overlapped = cells
    ratio = (round(overlapped["samples_per_s"] / sync["samples_per_s"], 3)
             if sync["samples_per_s"] and overlapped["samples_per_s"] else None)
    print(f"samples/s overlapped over synchronous: {ratio}", flush=True)
    raw = {f"samples_per_s[overlap {c['overlap']}]": [c["samples_per_s"]] for c in cells}
    raw |= {f"loss_at_equal_samples[overlap {c['overlap']}]": [c["loss_at_equal_samples"]] for c in cells}
    write_record("averaging", arguments, cells, raw=raw,
                 headline=[*cells, {"samples_per_s_ratio": ratio}],
                 notes=["One 2+2 swarm per setting, one value each: no spread.",
                        "Links limited with tc tbf: bandwidth only, no latency emulation."])
    print(json.dumps(cells), flush=True)
