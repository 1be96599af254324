"""Robust aggregation as pure functions: CenteredClip by hand, weight bounds, exclusions and bans."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.policy.aggregation import (
    AggregationConfig, bounded_weights, centered_clip, coordinate_median, equivocators, robust_aggregate,
)


def test_coordinate_median_of_odd_and_even_counts():
    rows = torch.tensor([[1.0, 10.0], [3.0, -2.0], [2.0, 4.0]], dtype=torch.float64)
    assert coordinate_median(rows).tolist() == [2.0, 4.0]
    rows = torch.tensor([[1.0], [3.0], [2.0], [100.0]], dtype=torch.float64)
    assert coordinate_median(rows).tolist() == [2.5]


def test_centered_clip_one_step_by_hand():
    """x0 = median = (0, 0); with tau = 1 the far point (10, 0) pulls by 1 only: x1 = ((0 + 0 + 1) / 3, 0)."""
    rows = torch.tensor([[0.0, 1.0], [0.0, -1.0], [10.0, 0.0]], dtype=torch.float64)
    x, iterations = centered_clip(rows, [1.0, 1.0, 1.0], tau=1.0, max_iterations=1)
    assert iterations == 1
    assert x.tolist() == pytest.approx([1.0 / 3.0, 0.0])


def test_centered_clip_without_clipping_is_the_weighted_mean():
    rows = torch.tensor([[0.0], [1.0], [4.0]], dtype=torch.float64)
    x, _ = centered_clip(rows, [1.0, 2.0, 1.0], tau=100.0)
    assert float(x) == pytest.approx((0 * 1 + 1 * 2 + 4 * 1) / 4)


def test_centered_clip_fixed_point_by_hand():
    """Points 0, 0, 0 and 100 with tau = 1: at the fixed point x, 3 x = min(1, tau/(100-x)) (100 - x), so x = 1/3."""
    rows = torch.tensor([[0.0], [0.0], [0.0], [100.0]], dtype=torch.float64)
    x, _ = centered_clip(rows, [1.0] * 4, tau=1.0, max_iterations=500, tolerance=1e-12)
    assert float(x) == pytest.approx(1.0 / 3.0, rel=1e-6)


def honest_gradients(n: int, dim: int = 1000, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    truth = torch.randn(dim, generator=generator, dtype=torch.float64)
    return truth, [truth + 0.5 * torch.randn(dim, generator=generator, dtype=torch.float64) for _ in range(n)]


@pytest.mark.parametrize("attack", ["sign_flip", "random", "large_constant"])
def test_one_byzantine_of_four_barely_moves_the_result(attack):
    truth, honest = honest_gradients(3)
    mean = torch.stack(honest).mean(0)
    if attack == "sign_flip":
        bad = -1000 * honest[0]
    elif attack == "random":
        bad = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 1000
    else:
        bad = torch.full((1000,), 1e6, dtype=torch.float64)
    contributions = {"a": honest[0], "b": honest[1], "c": honest[2], "z": bad}
    plain = (sum(contributions.values()) / 4)
    result = robust_aggregate(contributions, {p: 8 for p in contributions}, AggregationConfig())
    spread = float(torch.linalg.vector_norm(honest[0] - mean))
    assert float(torch.linalg.vector_norm(plain - mean)) > 100 * spread  # the plain mean is ruined
    assert float(torch.linalg.vector_norm(result.vector - mean)) < 0.5 * spread  # the robust one is not
    assert "z" in result.banned and result.included == ["a", "b", "c"]


def test_no_attacker_no_exclusion_and_close_to_the_mean():
    _, honest = honest_gradients(4, seed=3)
    contributions = dict(zip("abcd", honest))
    result = robust_aggregate(contributions, {p: 8 for p in contributions}, AggregationConfig())
    assert result.included == list("abcd") and not result.excluded and not result.banned
    mean = torch.stack(honest).mean(0)
    spread = float(torch.linalg.vector_norm(honest[0] - mean))
    assert float(torch.linalg.vector_norm(result.vector - mean)) < 0.1 * spread


def test_non_finite_contribution_is_dropped_and_its_sender_banned():
    _, honest = honest_gradients(3, seed=1)
    nan = torch.full((1000,), float("nan"), dtype=torch.float64)
    contributions = {"a": honest[0], "b": honest[1], "c": honest[2], "n": nan}
    result = robust_aggregate(contributions, {p: 8 for p in contributions}, AggregationConfig())
    assert "n" in result.banned and "non-finite" in result.banned["n"]
    assert bool(torch.isfinite(result.vector).all())


def test_weights_are_bounded_by_the_median_claim_and_the_cap():
    assert bounded_weights([10, 10, 12, 10_000], max_ratio=2.0) == [10, 10, 12, 22]
    assert bounded_weights([10, 10, 1000], max_ratio=2.0, cap=15) == [10, 10, 15]
    assert bounded_weights([0, -5, 4], max_ratio=2.0) == [0, 0, 4]


def test_a_huge_claim_cannot_buy_a_majority():
    contributions = {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.float64),
                     "c": torch.zeros(4, dtype=torch.float64), "z": torch.ones(4, dtype=torch.float64)}
    config = AggregationConfig(centered_clip_tau=100.0)  # no clipping: only the weights decide
    result = robust_aggregate(contributions, {"a": 10, "b": 10, "c": 10, "z": 1e9}, config)
    assert result.weights["z"] == 20
    assert float(result.vector[0]) == pytest.approx(20 / 50)


def test_equivocators_are_the_senders_with_two_hashes():
    assert equivocators({"a": {"h1"}, "b": {"h1", "h2"}, "c": set()}) == {"b"}
    result = robust_aggregate({"a": torch.zeros(2), "b": torch.ones(2), "c": torch.zeros(2)}, {"a": 1, "b": 1, "c": 1},
                              AggregationConfig(), equivocated={"b"})
    assert "b" in result.banned and result.included == ["a", "c"]


def test_deterministic_bits_whatever_the_insertion_order():
    _, honest = honest_gradients(4, seed=7)
    forward = robust_aggregate(dict(zip("abcd", honest)), dict.fromkeys("abcd", 8), AggregationConfig())
    backward = robust_aggregate(dict(reversed(list(zip("abcd", honest)))), dict.fromkeys("dcba", 8), AggregationConfig())
    assert torch.equal(forward.vector, backward.vector)


def test_bad_configs_are_refused():
    for bad in (dict(centered_clip_tau=-1.0), dict(centered_clip_scale=0.0), dict(max_weight_ratio=0.5),
                dict(ban_ratio=1.0), dict(centered_clip_iterations=0)):
        with pytest.raises(ValueError):
            AggregationConfig(**bad)
    assert math.isclose(AggregationConfig().centered_clip_scale, 2.0)


def test_a_replica_is_shunned_only_when_most_of_its_stage_mates_banned_it():
    from swarm.policy.aggregation import banned_by_majority

    assert banned_by_majority({"a": ["z"], "b": ["z"], "c": [], "z": ["a"]}) == {"z"}  # 2 of its 3 stage-mates
    assert banned_by_majority({"a": ["z"], "b": [], "c": [], "z": ["a", "b"]}) == set()  # 1 of 3: not a majority
    assert banned_by_majority({"a": ["b"], "b": []}) == set()  # of two replicas, either could be the liar
    assert banned_by_majority({"a": []}) == set()


def test_a_member_without_samples_takes_part_with_nothing_to_add():
    _, honest = honest_gradients(3, seed=2)
    contributions = {"a": honest[0], "b": honest[1], "c": honest[2], "e": torch.zeros(1000, dtype=torch.float64)}
    with_empty = robust_aggregate(contributions, {"a": 8, "b": 8, "c": 8, "e": 0}, AggregationConfig())
    without = robust_aggregate({p: contributions[p] for p in "abc"}, dict.fromkeys("abc", 8), AggregationConfig())
    assert with_empty.included == ["a", "b", "c", "e"] and with_empty.weights["e"] == 0.0
    assert torch.equal(with_empty.vector, without.vector)
    nobody = robust_aggregate({"e": torch.zeros(3), "f": torch.zeros(3)}, {"e": 0, "f": 0}, AggregationConfig())
    assert nobody.included == ["e", "f"] and torch.equal(nobody.vector, torch.zeros(3, dtype=torch.float64))


def test_members_keep_the_gradients_most_of_them_hold():
    from swarm.server.robust_allreduce import agreed_contributions

    full = {"a", "b", "c", "d"}
    assert agreed_contributions({"a": full, "b": full, "c": full, "d": full}) == full
    # d reached only a: the others hold no copy, so every member drops d alike
    assert agreed_contributions({"a": full, "b": full - {"d"}, "c": full - {"d"}, "d": full}) == {"a", "b", "c"}
    # one lying echo ("I hold nothing") cannot veto the others' gradients
    assert agreed_contributions({"a": full, "b": full, "c": full, "d": {"d"}}) == full
