"""``swarm peer``: serve one pipeline stage until SIGTERM/SIGINT, then leave gracefully."""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from peers._common import describe_join, emit, fail, load_role_config, setup_logging, stop_event
from swarm.config import PeerConfig
from swarm.config_loading import ConfigError


async def serve(config: PeerConfig) -> int:
    from swarm.server.peer import StagePeer

    stop = stop_event()
    peer = StagePeer(config)
    try:
        await peer.start()
        emit("peer_ready", peer_id=peer.peer_id, run_id=config.run.run_id, stage=peer.stage, step=peer.runner.step,
             maddrs=[f"{m}/p2p/{peer.peer_id}" for m in peer.maddrs],
             reachability=peer.reachability.status if peer.reachability else None)
        await stop.wait()
        emit("peer_leaving", peer_id=peer.peer_id)
        await peer.leave()
        emit("peer_stopped", peer_id=peer.peer_id, step=peer.runner.step, samples_applied=peer.runner.samples_applied)
        return 0
    finally:
        peer.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, manifest = load_role_config(PeerConfig, argv, "swarm peer", "Serve one pipeline stage of a swarm training run.")
    if manifest is not None:
        print(describe_join("peer", config.run, manifest, config.device, config.stage), flush=True)
    setup_logging()
    try:
        return asyncio.run(serve(config))
    except ConfigError as e:  # settings that differ from the run's peers
        fail(f"invalid configuration: {e}")
        return 2
    except (RuntimeError, OSError) as e:
        return fail(str(e))
