"""WAN benchmark: a 2-stage swarm whose roles sit on separate hosts with limited links.

Why: volunteers are joined by links of tens to hundreds of Mbit/s, and what crosses them (activations
and their gradients) grows with the model's width while compute grows with its square. This script
measures training throughput and bytes per sample per link speed, compression and width.

What runs, per cell (bandwidth x compression x hidden size), one after another:
  * 4 hosts: network namespaces on a bridge (``peers/netns.py``), addresses from 198.18.0.0/15, each
    host's link limited to the cell's bandwidth each way with ``tc`` tbf. Bandwidth only: no latency
    is emulated (the netem qdisc is not available on these kernels);
  * host 0 the bootstrap, host 1 the stage-0 replica, host 2 the stage-1 replica, host 3 the trainer;
    every role listens and announces on its host's address, never loopback. The trainer relays every
    activation and gradient between the stages, so its link carries four tensors per micro-batch;
  * the trainer trains for ``--duration_s`` seconds with the cell's setting: a ``compression`` codec, and with
    ``+boundaryN`` a run whose stages send ``hidden / N`` values a token (``model.boundary_dim``).

Measured, per cell:
  tokens_per_s      samples the trainer sent x seq_len / its training time (``train_s`` of its done event).
  bytes_per_sample  bytes the trainer's host sent and received on its link during the run, per sample sent.
  loss              the trainer's loss over its last micro-batches (after a fixed time, not a fixed sample
                    count: compare cells of one width and one bandwidth for parity, or use --duration_s).
                    At hidden 1024 a 30 s cell makes only a few global steps, and the first Adam steps
                    (no warm-up) raise this model's loss before it falls: in one such fp32 cell, 5.96
                    before the first step and 7.87 eight seconds after it. Those losses say where a cell
                    stopped in that rise, not what its compression did; compare them over a longer
                    --duration_s.

Needs root (namespaces and qdiscs). Everything it makes carries a random tag and is removed at the end of
each cell, also on Ctrl-C or error; nothing else is touched.

Output: progress lines, a table, ratios of int8 and fp16 over fp32 per bandwidth and width, then one JSON
list, one object per cell: {"bandwidth_mbit", "hidden", "compression", "tokens_per_s", "bytes_per_sample",
"loss", "samples", "train_s"}.

Usage: sudo python benchmarks/wan.py [--bandwidths 50,200,1000] [--compressions none,fp16,int8,int8+boundary4]
       [--hiddens 256,1024] [--duration_s 30] [--lr_at_256 1e-3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _records import add_record_arguments, write_record  # noqa: E402
from _swarm import FAST_PEER, LimitedHosts, install_signal_handlers, log, make_log_dir  # noqa: E402
from peers.netns import Hosts, NamespacesUnavailable, namespaces_unavailable  # noqa: E402

BOOTSTRAP, STAGE0, STAGE1, TRAINER = range(4)
READY_TIMEOUT_S = 120.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidths", default="50,200,1000", help="Mbit/s per host link, comma-separated")
    p.add_argument("--compressions", default="none,fp16,int8",
                   help="run compression settings, comma-separated: a codec, optionally +boundaryN (boundary_dim = hidden / N)")
    p.add_argument("--hiddens", default="256,1024", help="model widths, comma-separated")
    p.add_argument("--duration_s", type=float, default=30.0, help="seconds the trainer trains, per cell")
    p.add_argument("--lr_at_256", type=float, default=1e-3,
                   help="learning rate at hidden 256; other widths take it times 256 / hidden, since one Adam step at a "
                        "fixed rate moves a wider model's outputs further (hidden 1024 at 1e-3 ends worse than it starts)")
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--max_in_flight", type=int, default=4, help="micro-batches in flight")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    return p.parse_args(argv)


def _model(args, hidden: int) -> List[str]:
    return ["--num_layers", str(args.num_layers), "--hidden_size", str(hidden), "--num_heads", str(max(1, hidden // 64)),
            "--seq_len", str(args.seq_len), "--lr", f"{args.lr_at_256 * 256 / hidden:.3g}"]


def _setting(setting: str, hidden: int) -> List[str]:
    """The run flags of a cell's setting: ``codec`` or ``codec+boundaryN``."""
    codec, *options = setting.split("+")
    flags = ["--compression", codec]
    for option in options:
        if not option.startswith("boundary") or not option[len("boundary"):].isdigit():
            raise SystemExit(f"unknown setting {setting!r}: a codec, optionally +boundaryN")
        flags += ["--boundary_dim", str(hidden // int(option[len("boundary"):]))]
    return flags


def _link_bytes(hosts: Hosts, host: int) -> int:
    """Bytes ``host`` sent plus bytes it received (what its bridge-side veth end sent to it)."""
    return hosts.tx_bytes(host) + hosts.rx_bytes(host)


def run_cell(args, log_dir: Path, mbit: float, compression: str, hidden: int) -> Dict[str, Any]:
    """One swarm across 4 limited hosts, from bootstrap to figures; removes everything it made."""
    name = f"wan_{int(mbit)}m_{compression.replace('+', '_')}_h{hidden}"
    with LimitedHosts(4, mbit, log_dir, name) as swarm:
        run = ["--run_id", name, "--num_stages", "2"]
        bootstrap = swarm.start("bootstrap", BOOTSTRAP, run, "bootstrap")
        initial = bootstrap.wait_event("bootstrap_ready", READY_TIMEOUT_S)["maddrs"]
        common = [*run, "--initial_peers", ",".join(initial), "--target_batch_size", "256", *_model(args, hidden),
                  *_setting(compression, hidden)]
        peers = [swarm.start("peer", host, ["--stage", str(stage), *common, *FAST_PEER], f"s{stage}")
                 for stage, host in ((0, STAGE0), (1, STAGE1))]
        for peer in peers:
            peer.wait_event("peer_ready", READY_TIMEOUT_S)
        trainer = swarm.start("train", TRAINER, [*common, "--max_data_mb", "2", "--batch_size", str(args.batch_size),
                                                 "--max_in_flight", str(args.max_in_flight), "--duration_s",
                                                 str(args.duration_s), "--refresh_period_s", "0.5", "--log_period_s",
                                                 "2"], "trainer")
        trainer.wait_event("trainer_ready", READY_TIMEOUT_S)
        before = _link_bytes(swarm.hosts, TRAINER)
        done = trainer.wait_event("trainer_done", args.duration_s + READY_TIMEOUT_S)
        moved = _link_bytes(swarm.hosts, TRAINER) - before
    samples, train_s = done["samples_sent"], done["train_s"]
    return {"bandwidth_mbit": mbit, "hidden": hidden, "compression": compression,
            "tokens_per_s": round(samples * args.seq_len / train_s, 1) if train_s > 0 else None,
            "bytes_per_sample": round(moved / samples) if samples else None,
            "loss": round(done["loss"], 4) if isinstance(done.get("loss"), float) and math.isfinite(done["loss"]) else None,
            "samples": samples, "train_s": train_s}


def _ratio(cells: List[Dict[str, Any]], mbit: float, hidden: int, codec: str) -> Optional[float]:
    by = {c["compression"]: c for c in cells if c["bandwidth_mbit"] == mbit and c["hidden"] == hidden}
    if codec not in by or "none" not in by or not by["none"].get("tokens_per_s") or by[codec].get("tokens_per_s") is None:
        return None
    return round(by[codec]["tokens_per_s"] / by["none"]["tokens_per_s"], 2)


def print_table(cells: List[Dict[str, Any]]) -> None:
    print(f"{'Mbit/s':>7} {'hidden':>6} {'codec':>14} {'tokens/s':>9} {'bytes/sample':>13} {'loss':>7} {'samples':>8}")
    for c in cells:
        print(f"{c['bandwidth_mbit']:>7g} {c['hidden']:>6} {c['compression']:>14} {c.get('tokens_per_s') or '-':>9} "
              f"{c.get('bytes_per_sample') or '-':>13} {c.get('loss') or '-':>7} {c.get('samples', '-'):>8}")
    for mbit in sorted({c["bandwidth_mbit"] for c in cells}):
        for hidden in sorted({c["hidden"] for c in cells}):
            ratios = {c["compression"]: _ratio(cells, mbit, hidden, c["compression"]) for c in cells
                      if c["compression"] != "none"}
            print(f"{mbit:g} Mbit/s, hidden {hidden}: tokens/s over fp32: "
                  + ", ".join(f"{codec} {ratio}" for codec, ratio in ratios.items()))
    print("links limited with tc tbf: bandwidth only, no latency emulation (netem is not available)", flush=True)


def main(args) -> List[Dict[str, Any]]:
    reason = namespaces_unavailable()
    if reason:
        raise SystemExit(f"wan.py needs network namespaces: {reason}")
    log_dir = make_log_dir(args.log_dir, "bench_wan_")
    cells = []
    for hidden in [int(h) for h in args.hiddens.split(",")]:
        for mbit in [float(b) for b in args.bandwidths.split(",")]:
            for compression in args.compressions.split(","):
                started = time.monotonic()
                try:
                    cell = run_cell(args, log_dir, mbit, compression, hidden)
                except (TimeoutError, NamespacesUnavailable, OSError) as e:
                    cell = {"bandwidth_mbit": mbit, "hidden": hidden, "compression": compression,
                            "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                cells.append(cell)
                log(f"{mbit:g} Mbit/s, hidden {hidden}, {compression}: {cell.get('tokens_per_s')} tokens/s, "
                    f"{cell.get('bytes_per_sample')} bytes/sample, loss {cell.get('loss')} "
                    f"({time.monotonic() - started:.0f}s){' ' + cell['error'] if 'error' in cell else ''}")
    print_table(cells)
    log(f"logs in {log_dir}")
    return cells


if __name__ == "__main__":
    install_signal_handlers()
    arguments = parse_args()
    cells = main(arguments)
    raw = {}
    for c in cells:
        name = f"[{c['bandwidth_mbit']:g} Mbit/s, {c['compression']}, hidden {c['hidden']}]"
        raw[f"tokens_per_s{name}"] = [c.get("tokens_per_s")]
        raw[f"bytes_per_sample{name}"] = [c.get("bytes_per_sample")]
    write_record("wan", arguments, cells, raw=raw,
                 headline=[{k: c.get(k) for k in ("bandwidth_mbit", "hidden", "compression", "tokens_per_s",
                                                  "bytes_per_sample", "loss", "samples", "error")} for c in cells],
                 notes=["One trainer run per cell (bandwidth x compression x width): one value each, no spread.",
                        "Links limited with tc tbf: bandwidth only, no latency emulation."])
    print(json.dumps(cells), flush=True)
