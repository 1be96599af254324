"""A starting peer finds out whether other machines can reach it, says so, and serves through a relay if not.

Runs once in :meth:`swarm.server.peer.StagePeer.start`, on the peer's event loop, before it chooses a stage:
the dial-back check (:mod:`swarm.net.reachability`), one log line with the verdict in plain words, and, for an
unreachable peer, a restart of its DHT as a DHT client whose p2pd reserves a slot at the run's entry points
(the relays); its record then announces the relay addresses instead of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from hivemind import DHT
from hivemind.utils import get_logger

from swarm.config.settings import NetworkConfig, RunConfig
from swarm.dht.node import identity_of, start_run_dht, stop_dht
from swarm.net.addresses import announceable, listens_on_any
from swarm.net.reachability import Verdict, own_verdict, relay_addresses, relayed_options

__all__ = ["Reach", "reach_or_relay"]

logger = get_logger(__name__)


@dataclass
class Reach:
    """How a peer is reached: the DHT it serves with (a new one when it serves through relays), the addresses
    it announces, and the verdict of the check."""

    dht: DHT
    maddrs: List[str]
    verdict: Verdict


async def reach_or_relay(dht: DHT, network: NetworkConfig, run: RunConfig, owns_dht: bool) -> Reach:
    """Check, log the verdict, and relay if unreachable (only a DHT this peer started can be restarted)."""
    peer_id = str(dht.peer_id)
    listen = getattr(dht, "listen_maddrs", network.host_maddrs)
    p2p = await dht.replicate_p2p()
    maddrs = announceable(
        [str(m) for m in dht.get_visible_maddrs(latest=True)], listens_on_any(list(listen) + network.announce_maddrs)
    )
    verdict = await own_verdict(p2p, listen, maddrs, network.initial_peers)
    relays = relay_addresses(network.initial_peers)
    if verdict.status == "unreachable":
        logger.warning(f"peer {peer_id}: {verdict.message}")
    elif verdict.status != "local":
        logger.info(f"peer {peer_id}: {verdict.message}")
    if not verdict.use_relay or not owns_dht:
        return Reach(dht, maddrs, verdict)
    if not relays:
        logger.warning(
            "no relay to serve through: --initial_peers names no peer on another machine; "
            "trainers will not reach this peer"
        )
        return Reach(dht, maddrs, verdict)
    identity = identity_of(dht)
    stop_dht(dht)
    # the same peer id; a DHT client, since the other DHT nodes could not reach it to ask it anything
    relayed = start_run_dht(
        network, run, client_mode=True, p2p_options=relayed_options(network.initial_peers), identity=identity
    )
    logger.info(
        f"peer {peer_id} serves through the relays {', '.join(relays)}; its p2pd reserves a slot "
        f"there within about 3 minutes (libp2p waits that long for more relay candidates when fewer "
        f"than 4 are known)"
    )
    return Reach(relayed, relays, verdict)
