"""``swarm bootstrap``: a DHT node that others join through; holds no stage."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional, Sequence

from peers._common import emit, setup_logging, stop_event
from swarm.config import BootstrapConfig
from swarm.configuration import parse_role_config


async def serve(config: BootstrapConfig) -> int:
    from swarm.dht import start_dht

    stop = stop_event()
    dht = start_dht(config.network)
    try:
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        if config.maddrs_file:
            path = Path(config.maddrs_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text("\n".join(maddrs) + "\n")
            path.with_suffix(".tmp").replace(path)  # atomic: readers never see half a file
        emit("bootstrap_ready", peer_id=str(dht.peer_id), maddrs=maddrs)
        await stop.wait()
        return 0
    finally:
        dht.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_role_config(BootstrapConfig, argv, "swarm bootstrap", "Run a DHT entry point for a swarm.")
    setup_logging()
    return asyncio.run(serve(config))
