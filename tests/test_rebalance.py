"""Pure rebalancing policy: joins, moves, no flapping, bounded movers, stages never emptied."""

import random

import pytest

from swarm.policy.rebalance import (
    RebalanceConfig, apply_moves, choose_stage_for_new_peer, decide_move, next_period_s, plan_moves,
    stage_capacities, swarm_throughput,
)
from swarm.policy.snapshot import PeerInfo


def _online(snapshot):
    """Movers become online at their new stage (their download finished)."""
    return [PeerInfo(p.peer_id, p.stage, "online", p.throughput, p.queue_length) for p in snapshot]


def _iterate(peers, num_stages, config, max_rounds=100):
    history = []
    for _ in range(max_rounds):
        moves = plan_moves(peers, num_stages, config)
        if not moves:
            return peers, history
        history.append(moves)
        peers = _online(apply_moves(peers, moves))
    raise AssertionError(f"no fixed point after {max_rounds} rounds: {history[-4:]}")


def test_capacities_ignore_leaving_and_estimate_unmeasured():
    peers = [PeerInfo("a", 0, throughput=2.0), PeerInfo("b", 0, "leaving", 100.0),
             PeerInfo("c", 1, "joining", 0.0), PeerInfo("d", 1, throughput=4.0)]
    assert stage_capacities(peers, 3) == [2.0, 7.0, 0.0]  # c counts as the mean, 3.0
    assert stage_capacities([PeerInfo("a", 0), PeerInfo("b", 1), PeerInfo("c", 1)], 2) == [1.0, 2.0]


def test_no_move_when_balanced():
    peers = [PeerInfo(f"p{i}", i % 2, throughput=1.0) for i in range(4)]
    assert plan_moves(peers, 2, RebalanceConfig(max_movers_per_period=3)) == []
    assert decide_move(peers, "p0", 2, RebalanceConfig()) is None


def test_imbalanced_three_plus_one_becomes_two_plus_two():
    peers = [PeerInfo("a", 0, throughput=1.0), PeerInfo("b", 0, throughput=1.0),
             PeerInfo("c", 0, throughput=1.0), PeerInfo("d", 1, throughput=1.0)]
    config = RebalanceConfig()
    assert plan_moves(peers, 2, config) == [("a", 0, 1)]  # ties broken by peer id
    assert decide_move(peers, "a", 2, config) == 1
    assert decide_move(peers, "b", 2, config) is None
    final, history = _iterate(peers, 2, config)
    assert len(history) == 1 and stage_capacities(final, 2) == [2.0, 2.0]


def test_no_flapping_between_near_equal_stages():
    peers = [PeerInfo("a", 0, throughput=5.0), PeerInfo("b", 0, throughput=5.1),
             PeerInfo("c", 1, throughput=5.0), PeerInfo("d", 1, throughput=5.0)]
    assert plan_moves(peers, 2, RebalanceConfig(min_gain=0.0)) == []
    # a random heterogeneous swarm converges to a fixed point, never cycling
    rng = random.Random(0)
    for trial in range(20):
        peers = [PeerInfo(f"p{i:02d}", rng.randrange(3), throughput=rng.choice([1.0, 2.0, 3.5, 7.0]))
                 for i in range(rng.randrange(4, 30))]
        config = RebalanceConfig(min_gain=rng.choice([0.0, 0.01, 0.05]), max_movers_per_period=rng.randrange(1, 4))
        before = swarm_throughput(peers, 3)
        final, history = _iterate(peers, 3, config)
        assert swarm_throughput(final, 3) >= before
        assert plan_moves(final, 3, config) == []


def test_min_gain_blocks_small_improvements():
    peers = [PeerInfo(f"a{i}", 0, throughput=1.0) for i in range(11)] + \
            [PeerInfo(f"b{i}", 1, throughput=1.0) for i in range(9)]
    assert plan_moves(peers, 2, RebalanceConfig(min_gain=0.2)) == []  # 9 -> 10 is +11%
    assert plan_moves(peers, 2, RebalanceConfig(min_gain=0.1)) == [("a0", 0, 1)]


def test_movers_per_period_bounded_and_deterministic():
    peers = [PeerInfo(f"p{i:02d}", 0, throughput=1.0 + i % 3) for i in range(20)] + [PeerInfo("z", 1, throughput=1.0)]
    for bound in (0, 1, 3):
        moves = plan_moves(peers, 2, RebalanceConfig(max_movers_per_period=bound))
        assert len(moves) == bound
        assert moves == plan_moves(list(reversed(peers)), 2, RebalanceConfig(max_movers_per_period=bound))
    assert len({m[0] for m in plan_moves(peers, 2, RebalanceConfig(max_movers_per_period=3))}) == 3


def test_never_empties_a_stage_and_fills_empty_ones():
    peers = [PeerInfo("a", 0, throughput=10.0), PeerInfo("b", 1, throughput=1.0)]
    assert plan_moves(peers, 2, RebalanceConfig(max_movers_per_period=5, min_gain=0.0)) == []
    # a stage whose only peer is leaving gets one from the richest stage
    peers = [PeerInfo("a", 0, throughput=1.0), PeerInfo("b", 0, throughput=1.0), PeerInfo("c", 1, "leaving", 1.0)]
    assert plan_moves(peers, 2, RebalanceConfig()) == [("a", 0, 1)]
    # joining and leaving peers never move
    peers = [PeerInfo("a", 0, "joining", 1.0), PeerInfo("b", 0, "leaving", 1.0), PeerInfo("c", 0, "online", 1.0)]
    assert plan_moves(peers, 2, RebalanceConfig()) == []


def test_tied_bottlenecks_are_lifted_one_at_a_time():
    peers = [PeerInfo("a", 0, throughput=10.0), PeerInfo("b", 1, throughput=10.0)] + \
            [PeerInfo(f"c{i}", 2, throughput=5.0) for i in range(6)]
    final, history = _iterate(peers, 3, RebalanceConfig())
    assert sorted(stage_capacities(final, 3)) == [15.0, 15.0, 20.0]
    assert len(history) == 2


def test_new_peer_joins_the_stage_that_needs_capacity_most():
    assert choose_stage_for_new_peer([], 3) == 0
    peers = [PeerInfo("a", 0, throughput=3.0), PeerInfo("b", 1, throughput=1.0), PeerInfo("c", 2, throughput=2.0)]
    assert choose_stage_for_new_peer(peers, 3) == 1
    # a joining peer counts where it is going: the next newcomer goes elsewhere
    assert choose_stage_for_new_peer(peers + [PeerInfo("d", 1, "joining")], 3) == 2
    # a stage whose peers are all leaving is the neediest
    assert choose_stage_for_new_peer(peers + [PeerInfo("e", 1, "joining", 5.0)] + [PeerInfo("f", 2, "leaving", 9.0)], 4) == 3
    # ties broken by queue length (demand), then by stage index
    tied = [PeerInfo("a", 0, throughput=1.0, queue_length=1), PeerInfo("b", 1, throughput=1.0, queue_length=7)]
    assert choose_stage_for_new_peer(tied, 2) == 1
    assert choose_stage_for_new_peer([PeerInfo("a", 0), PeerInfo("b", 1)], 2, my_throughput=4.0) == 0


def test_next_period_within_jitter_and_seeded():
    config = RebalanceConfig(period_s=300.0, period_jitter=0.2)
    draws = [next_period_s(config, random.Random(5)) for _ in range(3)]
    assert len(set(draws)) == 1
    rng = random.Random(1)
    values = [next_period_s(config, rng) for _ in range(1000)]
    assert 240.0 <= min(values) and max(values) <= 360.0 and max(values) - min(values) > 100


@pytest.mark.parametrize("field,value", [("period_s", 0), ("period_jitter", 1.0), ("min_gain", -0.1),
                                         ("max_movers_per_period", -1)])
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        RebalanceConfig(**{field: value})


def test_mover_is_stable_under_measurement_noise():
    """Throughputs are noisy EMAs; the peer named to move must not change from snapshot to snapshot,
    since each peer acts only on its own tick (otherwise a move can wait many periods)."""
    rng = random.Random(0)
    config = RebalanceConfig(min_gain=0.05, max_movers_per_period=1)
    named = set()
    for _ in range(50):
        peers = [PeerInfo(name, 0, "online", 32.0 * rng.uniform(0.9, 1.1)) for name in ("p1", "p2", "p3")]
        peers.append(PeerInfo("p4", 1, "online", 36.0 * rng.uniform(0.9, 1.1)))
        moves = plan_moves(peers, 2, config)
        assert len(moves) == 1 and moves[0][1:] == (0, 1)
        named.add(moves[0][0])
    assert named == {"p1"}


def test_simultaneous_auto_joiners_settle_on_different_stages():
    from swarm.policy.rebalance import settle_join_choice

    base = [PeerInfo("p0", 0, "online", 10.0), PeerInfo("p1", 1, "online", 10.0)]
    # both chose stage 0 from the same snapshot and announced it
    joiners = [PeerInfo("a", 0, "joining"), PeerInfo("b", 0, "joining")]
    snapshot = base + joiners
    assert settle_join_choice(snapshot, "a", 0, 2) == 0  # the smallest id keeps its choice
    assert settle_join_choice(snapshot, "b", 0, 2) == 1  # the other chooses again with "a" counted
    assert settle_join_choice(base + [PeerInfo("b", 0, "joining")], "b", 0, 2) == 0  # alone: keeps it
