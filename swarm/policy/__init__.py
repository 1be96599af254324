"""Pure decision policies: routing micro-batches and choosing/moving stages.

Functions over plain snapshots (:class:`PeerInfo` lists), deterministic given a seed, with
no network or clock access; the live peers/trainers and the simulator call the same code.
"""

from swarm.policy.snapshot import PEER_STATES, PeerInfo
from swarm.policy.routing import NoPeerAvailable, Router, routing_weights
from swarm.policy.rebalance import (
    RebalanceConfig,
    choose_stage_for_new_peer,
    decide_move,
    next_period_s,
    plan_moves,
    settle_join_choice,
    stage_capacities,
)

__all__ = [
    "PEER_STATES",
    "PeerInfo",
    "NoPeerAvailable",
    "Router",
    "routing_weights",
    "RebalanceConfig",
    "stage_capacities",
    "choose_stage_for_new_peer",
    "settle_join_choice",
    "plan_moves",
    "decide_move",
    "next_period_s",
]
