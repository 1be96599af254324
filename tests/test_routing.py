"""Pure routing policy: throughput-proportional wiring, bans with backoff, clear errors."""

from collections import Counter

import numpy as np
import pytest

from swarm.policy.routing import NoPeerAvailable, Router, routing_weights
from swarm.policy.snapshot import PeerInfo


def _peers(throughputs, stage=0, state="online"):
    return [PeerInfo(f"p{i}", stage, state, float(t)) for i, t in enumerate(throughputs)]


def test_weights_proportional_and_unmeasured_get_mean():
    np.testing.assert_allclose(routing_weights([1, 2, 4]), [1 / 7, 2 / 7, 4 / 7])
    # the unmeasured peer is treated as the mean of the measured ones (3.0)
    np.testing.assert_allclose(routing_weights([2, 4, 0]), [2 / 9, 4 / 9, 3 / 9])
    np.testing.assert_allclose(routing_weights([0, 0, 0, 0]), [0.25] * 4)
    assert routing_weights([]).size == 0
    with pytest.raises(ValueError):
        routing_weights([1.0, float("nan")])


def test_shares_match_throughput_1_2_4():
    router = Router(seed=7)
    peers = _peers([1, 2, 4])
    draws = 20_000
    counts = Counter(router.choose(peers, now=0.0).peer_id for _ in range(draws))
    for peer_id, expected in zip(("p0", "p1", "p2"), (1 / 7, 2 / 7, 4 / 7)):
        assert abs(counts[peer_id] / draws - expected) < 0.1 * expected, counts


def test_choose_is_deterministic_for_a_seed():
    peers = _peers([1, 3, 5, 0])
    first, second = Router(seed=3), Router(seed=3)
    a = [first.choose(peers, 0.0).peer_id for _ in range(200)]
    b = [second.choose(peers, 0.0).peer_id for _ in range(200)]
    assert a == b
    assert len(set(a)) == 4


def test_new_peer_gets_tried():
    router = Router(seed=1)
    peers = _peers([10.0, 10.0]) + [PeerInfo("new", 0, "online", 0.0)]
    counts = Counter(router.choose(peers, now=0.0).peer_id for _ in range(3000))
    assert 0.25 < counts["new"] / 3000 < 0.42  # the mean share, 1/3


def test_only_online_peers_are_chosen():
    router = Router(seed=0)
    peers = [PeerInfo("j", 0, "joining", 100.0), PeerInfo("l", 0, "leaving", 100.0),
             PeerInfo("o", 0, "online", 1.0)]
    assert {router.choose(peers, 0.0).peer_id for _ in range(100)} == {"o"}
    assert {router.choose(_peers([1, 1, 1]), 0.0, exclude={"p0", "p2"}).peer_id
            for _ in range(50)} == {"p1"}


def test_ban_backoff_doubles_caps_and_resets():
    router = Router(seed=0, ban_base_s=1.0, ban_max_s=5.0)
    assert router.ban("a", now=0.0) == 1.0
    assert router.is_banned("a", 0.5) and not router.is_banned("a", 1.0)
    assert router.ban("a", now=10.0) == 2.0
    assert router.ban("a", now=20.0) == 4.0
    assert router.ban("a", now=30.0) == 5.0  # capped
    assert router.ban("a", now=40.0) == 5.0
    assert router.is_banned("a", 44.9) and not router.is_banned("a", 45.0)
    router.report_success("a")
    assert not router.is_banned("a", 41.0)
    assert router.ban("a", now=50.0) == 1.0  # backoff reset by the success
    assert not router.is_banned("b", 0.0)


def test_banned_peer_is_skipped_until_ban_expires():
    router = Router(seed=0, ban_base_s=2.0)
    peers = _peers([1.0, 100.0])
    router.ban("p1", now=0.0)
    assert {router.choose(peers, now=1.0).peer_id for _ in range(50)} == {"p0"}
    assert "p1" in {router.choose(peers, now=2.5).peer_id for _ in range(50)}


def test_no_peer_available_messages_name_stage_and_reason():
    router = Router(seed=0)
    with pytest.raises(NoPeerAvailable, match=r"stage 2.*none online.*1 joining.*1 leaving") as info:
        router.choose([PeerInfo("a", 2, "joining"), PeerInfo("b", 2, "leaving")], 0.0)
    assert info.value.stage == 2
    router.ban("a", 0.0)
    with pytest.raises(NoPeerAvailable, match=r"stage 1.*all 2 online peers are banned or excluded"):
        router.choose([PeerInfo("a", 1), PeerInfo("b", 1)], 0.5, exclude={"b"})
    with pytest.raises(NoPeerAvailable, match="no peers known"):
        router.choose([], 0.0)


def test_invalid_inputs_rejected():
    with pytest.raises(ValueError, match="ban_base_s"):
        Router(ban_base_s=0)
    with pytest.raises(ValueError, match="ban_max_s"):
        Router(ban_base_s=2, ban_max_s=1)
    with pytest.raises(ValueError, match="state"):
        PeerInfo("a", 0, "offline")
    with pytest.raises(ValueError, match="throughput"):
        PeerInfo("a", 0, "online", -1.0)
    with pytest.raises(ValueError, match="stage"):
        PeerInfo("a", -1)


def test_distribution_matches_choose():
    router = Router(seed=2)
    peers = _peers([1, 2, 0]) + [PeerInfo("j", 0, "joining", 5.0)]
    router.ban("p0", 0.0)
    dist = {peer.peer_id: p for peer, p in router.distribution(peers, 0.5)}
    assert set(dist) == {"p1", "p2"} and abs(sum(dist.values()) - 1) < 1e-12
    counts = Counter(router.choose(peers, 0.5).peer_id for _ in range(4000))
    assert abs(counts["p1"] / 4000 - dist["p1"]) < 0.03
    assert router.distribution([PeerInfo("x", 0, "leaving")], 0.0) == []
