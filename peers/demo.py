"""``swarm demo``: start a whole swarm on 127.0.0.1, train for a while, print progress, stop everything.

Every role is a separate process, started exactly as a user would start it (``swarm bootstrap``,
``swarm peer``, ``swarm train``); their logs go to ``work_dir``. The demo watches the swarm
through the DHT like any outside observer and prints loss, speed and per-peer throughput.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import List, Optional, Sequence

from peers._common import setup_logging, stop_event
from peers.launcher import RoleProcess
from peers.status import status_line
from swarm.config.settings import DemoConfig, NetworkConfig
from swarm.config.loading import parse_role_config
from swarm.dashboard.join import run_flags


def _run_flags(config: DemoConfig) -> List[str]:
    """Every run setting of the demo as flags, so that whatever ``demo.yaml`` sets reaches every role."""
    return run_flags(config.run)


def _peer_periods(config: DemoConfig) -> List[str]:
    """The demo's announce period (and an expiration of four), so that its status lines move every few seconds."""
    return ["--announce_period_s", str(config.announce_period_s), "--expiration_s", str(4 * config.announce_period_s)]


def _start_swarm(config: DemoConfig, log_dir: Path, processes: List[RoleProcess]) -> None:
    """Start every role, appending each to ``processes`` as it starts, so the caller stops them all even when
    one fails to come up."""
    boot = RoleProcess(
        "bootstrap", ["--run_id", config.run.run_id, "--num_stages", str(config.run.num_stages)], log_dir, "bootstrap"
    )
    processes.append(boot)
    maddrs = boot.wait_event("bootstrap_ready", config.startup_timeout_s)["maddrs"]
    if config.dashboard_port >= 0:  # started first, so that its page shows the peers as they join
        processes.append(
            RoleProcess(
                "dashboard",
                [
                    "--run_id",
                    config.run.run_id,
                    "--num_stages",
                    str(config.run.num_stages),
                    "--initial_peers",
                    ",".join(maddrs),
                    "--port",
                    str(config.dashboard_port),
                    "--period_s",
                    "1",
                ],
                log_dir,
                "dashboard",
            )
        )
    common = [*_run_flags(config), "--initial_peers", ",".join(maddrs)]
    peers = [
        RoleProcess("peer", ["--stage", str(stage), *common, *_peer_periods(config)], log_dir, f"peer_s{stage}_{i}")
        for stage in range(config.run.num_stages)
        for i in range(config.peers_per_stage)
    ]
    processes += peers
    _announce_dashboard(processes)  # while the peers start: the page shows them joining
    for peer in peers:  # a replica joining a stage downloads its state first; start trainers once all serve
        peer.wait_event("peer_ready", config.startup_timeout_s)
    trainer_flags = [
        "--duration_s",
        str(config.duration_s),
        "--batch_size",
        str(config.batch_size),
        "--max_in_flight",
        str(config.max_in_flight),
        "--log_period_s",
        str(config.log_period_s),
        "--refresh_period_s",
        str(config.announce_period_s),
    ]
    if config.max_data_mb is not None:
        trainer_flags += ["--max_data_mb", str(config.max_data_mb)]
    processes += [
        RoleProcess("train", [*common, *trainer_flags, "--trainer_seed", str(i + 1)], log_dir, f"trainer{i}")
        for i in range(config.num_trainers)
    ]


async def _watch(config: DemoConfig, maddrs: Sequence[str], trainers: List[RoleProcess], stop: asyncio.Event) -> None:
    from swarm.dht.node import start_dht, stop_dht

    run = config.run
    dht = start_dht(
        NetworkConfig(initial_peers=list(maddrs)), client_mode=True, run_id=run.run_id, num_stages=run.num_stages
    )
    started = time.monotonic()
    try:
        while not stop.is_set() and any(t.proc.poll() is None for t in trainers):
            try:
                await asyncio.wait_for(stop.wait(), config.log_period_s)
            except asyncio.TimeoutError:
                pass
            print(await status_line(dht, run.run_id, run.num_stages, time.monotonic() - started), flush=True)
    finally:
        stop_dht(dht)


def _announce_dashboard(processes: List[RoleProcess]) -> None:
    """Print where the run's web page is; a dashboard that failed (its port taken) does not stop the demo."""
    for process in processes:
        if process.role == "dashboard":
            try:
                print(
                    f"dashboard: {process.wait_event('dashboard_ready', 30)['url']} (a live page of the run)",
                    flush=True,
                )
            except TimeoutError:
                reason = process.log_tail(3).strip().splitlines()
                print(f"no dashboard: {reason[-1] if reason else 'it did not start'}", flush=True)


async def demo(config: DemoConfig) -> int:
    stop = stop_event()
    log_dir = Path(config.work_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"starting a swarm on 127.0.0.1: {config.run.num_stages} stages x {config.peers_per_stage} peers, "
        f"{config.num_trainers} trainers, {config.duration_s:.0f}s of training; logs in {log_dir}/",
        flush=True,
    )
    processes: List[RoleProcess] = []
    try:
        await asyncio.get_running_loop().run_in_executor(None, _start_swarm, config, log_dir, processes)
        maddrs = processes[0].wait_event("bootstrap_ready", 1)["maddrs"]
        trainers = [p for p in processes if p.role == "train"]
        await _watch(config, maddrs, trainers, stop)
        for trainer in trainers:
            done = [e for e in trainer.seen + list(trainer.events.queue) if e["event"] == "trainer_done"]
            if done:
                print(f"{trainer.name}: sent {done[0]['samples_sent']} samples, final loss {done[0]['loss']:.4f}")
        return 0
    finally:
        print("stopping every process of the demo...", flush=True)
        for process in reversed(processes):
            process.stop(timeout=15)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_role_config(DemoConfig, argv, "swarm demo", "Run a whole swarm on 127.0.0.1 for a while.")
    setup_logging()
    return asyncio.run(demo(config))
