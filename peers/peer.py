"""``swarm peer``: serve one pipeline stage until SIGTERM/SIGINT, then leave gracefully."""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from peers._common import emit, fail, setup_logging, stop_event
from swarm.config import PeerConfig
from swarm.configuration import parse_role_config


async def serve(config: PeerConfig) -> int:
    from swarm.server.peer import StagePeer

    stop = stop_event()
    peer = StagePeer(config)
    try:
        await peer.start()
        emit("peer_ready", peer_id=peer.peer_id, stage=peer.stage, step=peer.runner.step,
             maddrs=[str(a) for a in peer.dht.get_visible_maddrs()])
        await stop.wait()
        emit("peer_leaving", peer_id=peer.peer_id)
        await peer.leave()
        emit("peer_stopped", peer_id=peer.peer_id, step=peer.runner.step, samples_applied=peer.runner.samples_applied)
        return 0
    finally:
        peer.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_role_config(PeerConfig, argv, "swarm peer", "Serve one pipeline stage of a swarm training run.")
    setup_logging()
    try:
        return asyncio.run(serve(config))
    except (RuntimeError, OSError) as e:
        return fail(str(e))
