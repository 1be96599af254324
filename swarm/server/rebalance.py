"""The rebalance loop: every (jittered) period, ask the shared pure policy whether this peer should
move to another stage, and move if it says so (:func:`swarm.policy.rebalance.decide_move`)."""

from __future__ import annotations

import random
from typing import Protocol

from hivemind.utils import get_logger

from swarm.policy.rebalance import decide_move, next_period_s
from swarm.dht.records import to_peer_infos

from swarm.server.host import CurrentStage, Loops, Records, Settings, served
from swarm.server.lifecycle import PeerState

__all__ = ["rebalance_loop", "RebalanceHost"]

logger = get_logger(__name__)


class RebalanceHost(Settings, CurrentStage, Loops, Records, Protocol):
    """What rebalancing reads of the peer, and the one thing it asks of it: to move to another stage."""

    async def move_to(self, stage: int) -> None: ...


async def rebalance_loop(peer: RebalanceHost) -> None:
    rng = random.Random(peer.peer_id)
    policy = peer.config.rebalance_policy
    while not peer.stopping.is_set():
        meter = served(peer.runner, "runner").meter
        if not meter.served or meter.samples_per_s <= 0:  # decide on throughput measured on real work: wait for it
            await peer.sleep_or_progress(None, 0.5, 0.5)
            continue
        await peer.sleep_or_progress(None, next_period_s(policy, rng), 0.0)
        if peer.stopping.is_set() or peer.state != PeerState.ONLINE:
            continue
        snapshot = to_peer_infos(await peer.fetch_records(every_stage=True), peer.run.num_stages)
        target = decide_move(snapshot, peer.peer_id, peer.run.num_stages, policy)
        if target is not None and target != peer.stage:
            try:
                await peer.move_to(target)
            except Exception:
                logger.exception(f"moving to stage {target} failed; leaving the swarm")
                peer.stopping.set()
