"""The ``swarm`` command: one entry point, one subcommand per role.

Each subcommand lives in its own module with a ``main(argv) -> int`` and is imported lazily,
so ``swarm plan`` does not pay for importing torch and hivemind.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "peer": ("peers.peer", "serve one pipeline stage"),
    "faulty_peer": (
        "peers.faulty_peer",
        "serve one pipeline stage with an emulated fault (--fault: tests, benchmarks)",
    ),
    "train": ("peers.trainer", "push micro-batches through the swarm"),
    "bootstrap": ("peers.bootstrap", "run a DHT entry point for others to join; with --manifest, organise a run"),
    "demo": ("peers.demo", "start a whole swarm on 127.0.0.1 and train for a while"),
    "status": ("peers.status", "watch a run's peers and trainers from the DHT"),
    "dashboard": ("peers.dashboard", "serve a live web page of a run: stages, peers, trainers, loss, how to join"),
    "plan": ("peers.plan", "allocate stages over a heterogeneous network"),
    "simulate": ("peers.simulate", "discrete-event simulation of a swarm under churn"),
    "export": ("peers.export", "write a live run's model as one checkpoint (Hugging Face Llama or our GPT format)"),
    "generate": ("peers.generate", "continue a prompt with a live run's model, one pipeline forward per token"),
    "tokenizer": ("peers.tokenizer", "train a byte-level BPE tokenizer on local text; print its hash for the run"),
}


def _usage() -> str:
    lines = ["usage: swarm <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n`swarm <command> --help` describes the options of a command.")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"swarm: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
