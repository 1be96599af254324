"""Starting the hivemind DHT that every role (peer, trainer, bootstrap, status) joins."""

from __future__ import annotations

from hivemind import DHT

from swarm.config import NetworkConfig

__all__ = ["start_dht"]


def start_dht(network: NetworkConfig, client_mode: bool = False) -> DHT:
    return DHT(
        initial_peers=network.initial_peers, host_maddrs=network.host_maddrs,
        announce_maddrs=network.announce_maddrs or None, identity_path=network.identity_path,
        client_mode=client_mode, start=True, startup_timeout=network.startup_timeout_s,
    )
