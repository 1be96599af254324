"""The alignment check on hand-built contributions: a replica that negates its gradient at an honest norm is
accused after enough rounds, alone or with a colluding partner; honest noise, however weak the signal, accuses
nobody; a small consistent bias keeps a positive cosine and is left to CenteredClip, which bounds its pull."""

from __future__ import annotations

import math
from typing import Callable, Dict, List

import pytest
import torch

from swarm.policy.aggregation import AggregationConfig, robust_aggregate
from swarm.policy.alignment import AlignmentConfig, AlignmentRecord, opposed_members, pair_cosines, pair_is_opposed

DIM = 4096
CONFIG = AlignmentConfig()


def _noise_for(cosine: float) -> float:
    """Noise std (per coordinate, the true gradient's being 1) at which two honest gradients' expected cosine is
    ``cosine``: 1 / (1 + s^2)."""
    return math.sqrt(1.0 / cosine - 1.0)


def honest_round(generator: torch.Generator, truth: torch.Tensor, noise: float, peers: List[str]) -> Dict[str, torch.Tensor]:
    return {p: truth + noise * torch.randn(DIM, generator=generator, dtype=torch.float64) for p in peers}


def run_rounds(rounds: int, peers: List[str], cosine: float, attack: Callable[[Dict[str, torch.Tensor]], None],
               seed: int = 0) -> List[Dict[str, str]]:
    """What the record accuses after each round, the gradients drawn fresh every round."""
    generator = torch.Generator().manual_seed(seed)
    truth = torch.randn(DIM, generator=generator, dtype=torch.float64)
    record = AlignmentRecord(CONFIG)
    accused = []
    for _ in range(rounds):
        grads = honest_round(generator, truth, _noise_for(cosine), peers)
        attack(grads)
        record.add(pair_cosines(grads))
        accused.append(record.opposed())
    return accused


def flip(*attackers: str) -> Callable[[Dict[str, torch.Tensor]], None]:
    def attack(grads: Dict[str, torch.Tensor]) -> None:
        for attacker in attackers:
            grads[attacker] = -grads[attacker]  # its own gradient, its own norm, pointing the other way
    return attack


def test_pair_cosines_are_exact_and_leave_out_vectors_without_direction():
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    cosines = pair_cosines({"b": b, "a": a, "c": -3 * a, "z": torch.zeros(3)})
    assert cosines == {("a", "b"): 0.0, ("a", "c"): -1.0, ("b", "c"): 0.0}


@pytest.mark.parametrize("cosine", [0.3, 0.1])
def test_a_replica_that_flips_its_gradient_at_an_honest_norm_is_accused_and_the_honest_ones_are_not(cosine):
    peers = ["h1", "h2", "x"]
    history = run_rounds(40, peers, cosine, flip("x"))
    first = next(i for i, accused in enumerate(history) if accused)
    assert first + 1 >= CONFIG.min_rounds  # one round proves nothing
    assert first + 1 <= 20, first
    assert set(history[first]) == {"x"} and "2 of 2 stage-mates" in history[first]["x"]
    assert all(set(accused) <= {"x"} for accused in history)


def test_a_colluding_pair_of_five_that_flips_is_accused_and_cannot_get_an_honest_replica_accused():
    peers = ["h1", "h2", "h3", "x1", "x2"]
    history = run_rounds(40, peers, 0.2, flip("x1", "x2"))
    assert set(history[-1]) == {"x1", "x2"}, history[-1]
    assert "3 of 4 stage-mates" in history[-1]["x1"]  # the partner agrees with it, the honest majority does not
    assert all(set(accused) <= {"x1", "x2"} for accused in history)

    def frame_h1(grads: Dict[str, torch.Tensor]) -> None:  # both attackers point against h1 itself
        for attacker in ("x1", "x2"):
            grads[attacker] = -grads["h1"] * float(grads[attacker].norm() / grads["h1"].norm())

    framed = run_rounds(40, peers, 0.2, frame_h1)
    assert all("h1" not in accused for accused in framed)  # its honest stage-mates still agree with it
    assert {"x1", "x2"} <= set(framed[-1])


@pytest.mark.parametrize("cosine", [0.3, 0.05, 0.0])
def test_honest_noise_accuses_nobody_even_where_gradients_carry_almost_no_signal(cosine):
    peers = ["a", "b", "c", "d", "e"]
    generator = torch.Generator().manual_seed(1)
    truth = torch.randn(DIM, generator=generator, dtype=torch.float64)
    record, seen = AlignmentRecord(CONFIG), []
    for _ in range(400):
        noise = 1e3 if cosine == 0 else _noise_for(cosine)  # cosine 0: pure noise, no shared direction at all
        grads = honest_round(generator, truth, noise, peers)
        cosines = pair_cosines(grads)
        seen.extend(cosines.values())
        record.add(cosines)
        assert record.opposed() == {}
    mean = sum(seen) / len(seen)
    assert abs(mean - cosine) < 0.02 + 0.2 * cosine, mean  # the noise level the test meant to build


def test_a_small_consistent_bias_keeps_a_positive_cosine_and_clipping_bounds_its_pull():
    """The check accuses opposition only. A replica adding the same small shift every round still points the
    honest way; CenteredClip keeps what it adds to the result within its share of the clipping radius."""
    generator = torch.Generator().manual_seed(2)
    truth = torch.randn(DIM, generator=generator, dtype=torch.float64)
    bias = 3.0 * torch.randn(DIM, generator=generator, dtype=torch.float64)
    peers = ["h1", "h2", "h3", "x"]
    record = AlignmentRecord(CONFIG)
    for _ in range(40):
        grads = honest_round(generator, truth, _noise_for(0.2), peers)
        grads["x"] = grads["x"] + bias
        record.add(pair_cosines(grads))
        aggregate = robust_aggregate(grads, dict.fromkeys(peers, 16.0), AggregationConfig())
        honest_mean = sum(grads[p] for p in peers[:3]) / 3
        share = aggregate.weights["x"] / aggregate.samples
        assert float((aggregate.vector - honest_mean).norm()) <= share * aggregate.tau * 1.5
        assert aggregate.cosines and all(c > 0 for c in aggregate.cosines.values())
    assert record.opposed() == {}


def test_a_pair_is_opposed_only_beyond_its_own_noise():
    assert not pair_is_opposed([-0.5] * (CONFIG.min_rounds - 1), CONFIG)  # too few rounds
    assert pair_is_opposed([-0.2] * CONFIG.min_rounds, CONFIG)
    noisy = [-0.2, 0.4, -0.6, 0.3, -0.5, 0.2, -0.4, 0.1]  # mean -0.09, but within its spread
    assert not pair_is_opposed(noisy, CONFIG)
    # one stage-mate alone decides nothing: two replicas opposed to each other are both unproven
    assert opposed_members({("a", "b"): [-0.9] * 10}, CONFIG) == {}


def test_the_record_forgets_banned_and_departed_members():
    record = AlignmentRecord(AlignmentConfig(min_rounds=3, window=4))
    record.add({("a", "x"): -0.5, ("b", "x"): -0.5, ("a", "b"): 0.5})
    record.forget(["x"])
    assert set(record.records) == {("a", "b")}
    for _ in range(4 * 4 + 1):
        record.add({("a", "c"): 0.5})
    assert set(record.records) == {("a", "c")}  # a-b shared no round in four windows
    assert len(record.records[("a", "c")]) == 4


def test_settings_are_checked_and_zero_rounds_turns_the_check_off():
    with pytest.raises(ValueError):
        AggregationConfig(alignment_rounds=2)
    with pytest.raises(ValueError):
        AggregationConfig(alignment_z=0)
    with pytest.raises(ValueError):
        AlignmentConfig(min_rounds=8, window=4)
    grads = {p: torch.randn(8, generator=torch.Generator().manual_seed(i)) for i, p in enumerate("abc")}
    claims = dict.fromkeys(grads, 4.0)
    assert len(robust_aggregate(grads, claims, AggregationConfig()).cosines) == 3
    assert robust_aggregate(grads, claims, AggregationConfig(alignment_rounds=0)).cosines == {}
    claims["c"] = 0.0  # no samples: no direction to judge
    assert set(robust_aggregate(grads, claims, AggregationConfig()).cosines) == {("a", "b")}


def test_without_the_check_a_flip_at_an_honest_norm_stays_in_and_pulls_every_step_back():
    """What the check prevents: CenteredClip alone keeps the flipper in every round, and its pull takes a
    third of the honest mean's progress along the true gradient away, step after step."""
    generator = torch.Generator().manual_seed(3)
    truth = torch.randn(DIM, generator=generator, dtype=torch.float64)
    peers = ["h1", "h2", "x"]
    progress_attacked, progress_honest = 0.0, 0.0
    for _ in range(20):
        grads = honest_round(generator, truth, _noise_for(0.3), peers)
        honest_mean = (grads["h1"] + grads["h2"]) / 2
        grads["x"] = -grads["x"]
        aggregate = robust_aggregate(grads, dict.fromkeys(peers, 16.0), AggregationConfig(alignment_rounds=0))
        assert "x" in aggregate.included and not aggregate.banned
        progress_attacked += float(aggregate.vector @ truth)
        progress_honest += float(honest_mean @ truth)
    assert progress_attacked < 0.6 * progress_honest, (progress_attacked, progress_honest)
