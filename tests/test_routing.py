"""Pure routing policy: throughput-proportional wiring, capped announcements, own measurements, bans with backoff."""

import itertools
from collections import Counter

import numpy as np
import pytest

from swarm.policy.routing import (NoPeerAvailable, Router, cap_announced, effective_throughputs, preferred_replica,
                                  routing_weights)
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


def _shares(router, peers, now=0.0):
    return {peer.peer_id: p for peer, p in router.distribution(peers, now)}


def test_a_liar_gets_no_more_than_its_capped_share():
    liar = PeerInfo("liar", 0, "online", 1e12)
    # capped at 4x the lower median of what the stage announces: 4x1.0 in both cases
    for honest, bound in ((_peers([1.0]), 4.0 / 5.0), (_peers([1.0, 1.2, 0.9]), 4.0 / 7.1)):
        capped = _shares(Router(), honest + [liar])
        assert capped["liar"] == pytest.approx(bound), capped
        uncapped = _shares(Router(announced_cap=float("inf")), honest + [liar])
        assert uncapped["liar"] > 0.999  # without the cap the liar attracts all the work


def test_a_measured_slow_peer_gets_less_than_a_measured_fast_one_whatever_they_announce():
    router = Router()
    router.report_success("slow", samples=8, elapsed_s=0.8)  # 10 samples/s of wall time
    router.report_success("fast", samples=8, elapsed_s=0.04)  # 200 samples/s
    claims = (0.0, 0.5, 1.0, 100.0, 1e12)
    for slow_claims, fast_claims in itertools.product(claims, claims):
        peers = [PeerInfo("slow", 0, "online", slow_claims), PeerInfo("fast", 0, "online", fast_claims)]
        shares = _shares(router, peers)
        # an announcement moves a measured peer by at most 4x: at worst 200/4 against 10*4
        assert shares["fast"] >= 50 / 90 - 1e-9, (slow_claims, fast_claims, shares)
    counts = Counter(router.choose([PeerInfo("slow", 0, "online", 1e12), PeerInfo("fast", 0, "online", 0.5)],
                                   0.0).peer_id for _ in range(2000))
    assert counts["fast"] > counts["slow"]


def test_honest_announcements_tell_apart_replicas_whose_calls_take_about_as_long():
    # on loopback a call's wall time is mostly transfer: a replica 2.2x faster at compute answers only a bit sooner
    router = Router()
    router.report_success("fast", samples=8, elapsed_s=0.030)
    router.report_success("slow", samples=8, elapsed_s=0.034)
    router.report_success("liar", samples=8, elapsed_s=0.032)
    honest = [PeerInfo("fast", 0, "online", 880.0), PeerInfo("slow", 0, "online", 400.0)]
    shares = _shares(router, honest)
    assert shares["fast"] / shares["slow"] == pytest.approx(2.2)
    measured = [router.measured_throughput(p) for p in ("fast", "slow", "liar")]
    weights = effective_throughputs([880.0, 400.0, 1e12], measured)
    assert weights[2] == pytest.approx(4 * measured[2])  # the liar counts 4x what it measured, no more
    assert weights[0] / weights[1] == pytest.approx(2.2)


def test_an_unmeasured_peer_is_tried_but_never_above_a_multiple_of_the_best_measured():
    router = Router()
    router.report_success("a", samples=10, elapsed_s=0.1)  # measured 100/s while announcing 10/s
    peers = [PeerInfo("a", 0, "online", 10.0), PeerInfo("new", 0, "online", 1e12), PeerInfo("quiet", 0, "online", 0.0)]
    shares = _shares(router, peers)
    assert shares["new"] == pytest.approx(2 * shares["a"])  # 4x10 announced -> 400 measured scale -> capped at 2x100
    assert shares["quiet"] == pytest.approx(shares["a"])  # no hint at all: the mean measured value
    np.testing.assert_allclose(effective_throughputs([10.0, 5.0, 0.0], [100.0, 0.0, 0.0]), [100.0, 50.0, 100.0])
    # a measured replica keeps within 4x of its measurement whatever it announces
    np.testing.assert_allclose(effective_throughputs([1.0, 1.0, 1e12], [10.0, 10.0, 10.0]), [10.0, 10.0, 40.0])
    np.testing.assert_allclose(effective_throughputs([0.0, 5.0], [30.0, 0.0]), [30.0, 30.0])  # no ratio known
    np.testing.assert_allclose(effective_throughputs([3.0, 1.0], [0.0, 0.0]), [3.0, 1.0])  # nothing measured
    np.testing.assert_allclose(cap_announced([1.0, 2.0, 100.0, 0.0]), [1.0, 2.0, 8.0, 0.0])
    with pytest.raises(ValueError, match="same length"):
        effective_throughputs([1.0], [1.0, 2.0])


def test_measurements_are_a_low_quantile_of_recent_wall_time_per_sample_and_are_forgotten_with_the_peer():
    router = Router(measure_window=4, measure_quantile=0.25)
    assert router.measured_throughput("a") == 0.0
    router.report_success("a")  # old callers: no measurement, just a success
    assert router.measured_throughput("a") == 0.0
    for elapsed in (1.0, 1.0, 30.0, 1.0):  # one call waited out a global step: it does not count
        router.report_success("a", 10, elapsed)
    assert router.measured_throughput("a") == pytest.approx(10.0)
    for _ in range(4):  # a replica that stays slow (requests queued at it) is measured slow within a window
        router.report_success("a", 10, 5.0)
    assert router.measured_throughput("a") == pytest.approx(2.0)
    router.forget("a")
    assert router.measured_throughput("a") == 0.0
    for samples, elapsed in ((-1, 1.0), (1, float("nan")), (1, -2.0), (1.5, 1.0)):
        with pytest.raises(ValueError):
            router.report_success("a", samples, elapsed)
    with pytest.raises(ValueError, match="announced_cap"):
        Router(announced_cap=0.5)
    with pytest.raises(ValueError, match="measure_window"):
        Router(measure_window=0)


def test_a_fixed_ban_sets_a_peer_aside_without_counting_a_failure():
    router = Router(ban_base_s=1.0)
    assert router.ban("busy", now=0.0, duration_s=0.25) == 0.25
    assert router.is_banned("busy", 0.2) and not router.is_banned("busy", 0.25)
    assert router.ban("busy", now=1.0) == 1.0  # its first real failure still starts the backoff at the base
    with pytest.raises(ValueError, match="duration_s"):
        router.ban("busy", 0.0, duration_s=-1.0)


def test_a_preferred_replica_is_taken_while_eligible_and_drawn_around_otherwise():
    peers = _peers([1.0, 1.0, 100.0])
    router = Router(seed=0)
    assert preferred_replica(peers, "p0").peer_id == "p0"
    assert preferred_replica(peers, "gone") is None and preferred_replica(peers, None) is None
    assert {router.choose(peers, 0.0, prefer="p0").peer_id for _ in range(50)} == {"p0"}, "preferred over faster ones"
    router.ban("p0", 0.0)  # banned (or dead: not in the snapshot) -> drawn among the others as usual
    assert Counter(router.choose(peers, 0.1, prefer="p0").peer_id for _ in range(200))["p0"] == 0
    assert Counter(router.choose(peers[1:], 0.1, prefer="p0").peer_id for _ in range(200))["p2"] > 150
    assert router.choose(peers, 10**6, exclude=["p1"], prefer="p1").peer_id != "p1", "a failed try is not preferred"
