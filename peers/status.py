"""``swarm status``: watch a run from the DHT (peers, trainers, loss, speed) without serving anything."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

from peers._common import setup_logging, stop_event
from swarm.config.settings import NetworkConfig
from swarm.config.loading import parse_role_config
from swarm.dht.records import validate_run_id


@dataclass
class StatusConfig:
    """Which run to watch and how often."""

    run_id: str = "swarm_demo"  # the run to watch
    num_stages: int = 2  # pipeline stages of that run (each stage's peers announce under a key of their own)
    period_s: float = 5.0  # seconds between status lines
    count: int = 0  # status lines to print before exiting; 0 = until Ctrl-C
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if not self.period_s > 0 or self.count < 0:
            raise ValueError("period_s must be positive and count non-negative")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")


def format_status(elapsed: float, peers: Dict, trainers: Dict) -> str:
    losses = [t.loss for t in trainers.values() if t.loss is not None]
    samples_per_s = sum(t.samples_per_s for t in trainers.values())
    tokens_per_s = sum(t.tokens_per_s for t in trainers.values())
    loss = f"{sum(losses) / len(losses):.4f}" if losses else "  -   "
    steps = sorted({p.step for p in peers.values()})
    per_peer = "  ".join(
        f"s{p.stage}:{p.peer_id[-4:]} {p.throughput:6.1f}/s q{p.queue_length} {p.samples_processed}"
        for p in sorted(peers.values(), key=lambda p: (p.stage, p.peer_id))
    )
    return (
        f"[{elapsed:5.0f}s] loss {loss} | {len(trainers)} trainers {samples_per_s:6.1f} samples/s "
        f"{tokens_per_s:8.0f} tokens/s | step {steps} | peers (stage:id throughput queue processed) {per_peer}"
    )


async def status_line(dht, run_id: str, num_stages: int, elapsed: float) -> str:
    from swarm.dht.store import fetch_records
    from swarm.dht.directory import fetch_stage_records
    from swarm.dht.records import TrainerRecord, trainers_key

    peers = await fetch_stage_records(dht, run_id, num_stages)
    trainers = await fetch_records(dht, trainers_key(run_id), TrainerRecord)
    return format_status(elapsed, peers, trainers)


async def watch(config: StatusConfig) -> int:
    from swarm.dht.node import start_dht, stop_dht

    stop = stop_event()
    dht = start_dht(config.network, client_mode=True, run_id=config.run_id, num_stages=config.num_stages)
    started, printed = time.monotonic(), 0
    try:
        while not stop.is_set() and (config.count == 0 or printed < config.count):
            print(await status_line(dht, config.run_id, config.num_stages, time.monotonic() - started), flush=True)
            printed += 1
            try:
                await asyncio.wait_for(stop.wait(), config.period_s)
            except asyncio.TimeoutError:
                pass
        return 0
    finally:
        stop_dht(dht)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_role_config(StatusConfig, argv, "swarm status", "Watch a swarm training run from the DHT.")
    setup_logging()
    return asyncio.run(watch(config))
