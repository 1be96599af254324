"""``swarm peer``: serve one pipeline stage until SIGTERM/SIGINT, then leave gracefully."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional, Sequence

from peers._common import describe_join, emit, fail, load_role_config, setup_logging, stop_event
from swarm.config.settings import PeerConfig
from swarm.config.loading import ConfigError
from swarm.model.devices import check_available, parse_device
from swarm.model.footprint import StageDoesNotFit, check_peer_fits
from swarm.model.hf_checkpoint import CheckpointError
from swarm.model.initial_weights import config_sha256
from swarm.metrics import MetricsPortError, PeerSnapshot

logger = logging.getLogger("swarm.peer")


def progress_line(s: PeerSnapshot) -> str:
    """One line of what the peer is doing: state, stage, global step, work done, speed."""
    stage = "?" if s.stage is None else s.stage
    return (
        f"{s.state} stage {stage} | step {s.step} | processed {s.samples_processed} samples "
        f"(pending {s.samples_pending}) | {s.throughput:.1f} samples/s | queue {s.queue_length}"
    )


async def _report_progress(peer, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        logger.info(progress_line(peer.snapshot()))


async def serve(config: PeerConfig, prepare: Optional[Callable[[Any], None]] = None) -> int:
    """Run a stage peer until told to stop; ``prepare`` is given the peer before it starts."""
    from swarm.server.host import served
    from swarm.server.peer import StagePeer
    from swarm.server.slow_device import install_slow_device

    stop = stop_event()
    peer = StagePeer(config)
    if config.delay_per_sample_s > 0:  # an emulated slower device, for tests and benchmarks on one machine
        install_slow_device(peer, config.delay_per_sample_s)
    if prepare is not None:
        prepare(peer)
    reporter = None
    try:
        await peer.start()
        emit(
            "peer_ready",
            peer_id=peer.peer_id,
            run_id=config.run.run_id,
            stage=peer.stage,
            step=served(peer.runner, "runner").step,
            maddrs=[f"{m}/p2p/{peer.peer_id}" for m in peer.maddrs],
            reachability=peer.reachability.status if peer.reachability else None,
            metrics=peer.metrics_server.url if peer.metrics_server else None,
        )
        reporter = asyncio.create_task(_report_progress(peer, config.log_period_s))
        await stop.wait()
        emit("peer_leaving", peer_id=peer.peer_id)
        await peer.leave()
        runner = served(peer.runner, "runner")  # read again: moving to another stage replaces the runner
        emit("peer_stopped", peer_id=peer.peer_id, step=runner.step, samples_applied=runner.samples_applied)
        return 0
    finally:
        if reporter is not None:
            reporter.cancel()
        peer.shutdown()


def check_initial_checkpoint(config: PeerConfig) -> None:
    """Refuse, before anything starts, an ``--init_from`` the run cannot use: a run that starts from no
    checkpoint, or a copy whose config.json is not the one the manifest signs (each stage's tensors are checked
    when the peer loads them)."""
    run, path = config.run, config.init_from
    if path is None:
        return
    if not run.starts_from_checkpoint:
        raise ValueError(
            f"--init_from {path}: run {run.run_id!r} starts from no checkpoint (its organiser "
            "gives one with swarm bootstrap --init_from); leave --init_from out"
        )
    found = config_sha256(path)
    if found != run.init_config_sha256:
        raise CheckpointError(
            f"{path}/config.json has SHA-256 {found}, the run's manifest signs "
            f"{run.init_config_sha256}: this is not the checkpoint the run starts from"
        )


def main(argv: Optional[Sequence[str]] = None, prepare: Optional[Callable[[Any], None]] = None) -> int:
    config, manifest = load_role_config(
        PeerConfig, argv, "swarm peer", "Serve one pipeline stage of a swarm training run."
    )
    if manifest is not None:
        print(
            describe_join("peer", config.run, manifest, config.device, config.stage, config.forward_cache_mb),
            flush=True,
        )
    try:  # before anything starts: a device this machine lacks, or a stage it cannot hold, is one line
        check_available(parse_device(config.device))
        if config.stage != "auto":
            check_peer_fits(config, int(config.stage))
        check_initial_checkpoint(config)
    except ValueError as e:
        fail(str(e))
        return 2
    setup_logging()
    try:
        return asyncio.run(serve(config, prepare))
    except ConfigError as e:  # settings that differ from the run's peers
        fail(f"invalid configuration: {e}")
        return 2
    except (StageDoesNotFit, CheckpointError) as e:  # a stage it cannot hold, or a copy of the run's checkpoint
        fail(str(e))  # that differs from the one the manifest signs
        return 2
    except MetricsPortError as e:  # a setting to change, like the one above
        fail(f"{e} (choose another --metrics_port)")
        return 2
    except (RuntimeError, OSError) as e:
        return fail(str(e))
