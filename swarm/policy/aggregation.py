"""How a stage's replicas combine their gradients when some of them may lie: pure functions.

A plain weighted mean lets one replica move the result anywhere (a NaN, or its gradient times
-1000) and lets it choose its own weight. Here every replica holds every groupmate's whole gradient
(see :mod:`swarm.server.robust_allreduce`) and decides on its own, deterministically, so honest
replicas that hold the same inputs reach bit-identical results:

1. contributions that are not finite, or from banned peers, or that a peer sent in two versions
   (equivocation) are dropped, and the first and last kind get their sender banned;
2. each weight (the samples a replica claims) is capped at ``max_weight_ratio`` times the median claim
   and at the step's target, so no replica buys itself a majority;
3. CenteredClip (Karimireddy, He and Jaggi, 2021): start from the coordinate-wise median ``x``, then
   repeat ``x <- x + sum_i w_i (g_i - x) min(1, tau / ||g_i - x||) / sum_i w_i`` until the step is tiny.
   A contribution farther than ``tau`` from ``x`` pulls with force ``tau`` at most, so a minority moves
   the result by O(tau) whatever it sends; contributions within ``tau`` are averaged as they are.
4. ``tau`` is ``centered_clip_scale`` times the median distance of the contributions from their coordinate-wise
   median (the typical spread of honest gradients, which a minority cannot move much), unless set;
5. a contribution farther from the result than ``ban_ratio`` times the median distance is an attack,
   not noise: its sender is banned (only with three or more contributions, where a median means something);
6. the cosine between every two included contributions with samples goes out with the result
   (``Aggregate.cosines``): over many rounds they show a replica whose gradients point against the others'
   at an honest norm (:mod:`swarm.policy.alignment`), which no single round can.

Computation is in float64 and in a fixed order (no BLAS reductions across contributions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from swarm.model.finite import all_finite
from swarm.policy.alignment import AlignmentConfig, Pair, pair_cosines

__all__ = [
    "AggregationConfig",
    "Aggregate",
    "bounded_weights",
    "coordinate_median",
    "clip_radius",
    "centered_clip",
    "equivocators",
    "robust_aggregate",
    "banned_by_majority",
    "adds_nothing",
]


def adds_nothing(samples: float) -> bool:
    """Whether a member claiming ``samples`` has nothing to add to the round (it had no samples this step):
    it takes part with weight 0, so its values would never count and it sends none."""
    return samples < 1


@dataclass
class AggregationConfig:
    """Knobs of the robust aggregation; every replica of a stage must use the same ones."""

    centered_clip_tau: float = field(
        default=0.0,
        metadata={
            "help": (
                "CenteredClip radius; 0 = centered_clip_scale x the median distance of the contributions from their median"
            )
        },
    )
    centered_clip_scale: float = 2.0  # the automatic radius in units of the typical honest spread
    max_weight_ratio: float = 2.0  # no contribution weighs more than this many times the median claim
    ban_ratio: float = 50.0  # a contribution this many median distances from the result gets its sender banned
    centered_clip_iterations: int = 100  # CenteredClip iterations at most
    centered_clip_tolerance: float = 1e-7  # stop when a step moves the result by less than this fraction of the radius
    alignment_rounds: int = field(
        default=8,
        metadata={
            "help": (
                "rounds two replicas must share before their gradients' cosines can show one pointing against the "
                "other; a replica opposed so to most of its stage-mates is banned (0 = no such check)"
            )
        },
    )
    alignment_z: float = 4.0  # standard errors below zero a pair's mean cosine must be to count as opposed

    def __post_init__(self) -> None:
        if not self.centered_clip_tau >= 0 or not self.centered_clip_scale > 0:
            raise ValueError(
                f"centered_clip_tau must be >= 0 and centered_clip_scale positive, got "
                f"{self.centered_clip_tau!r} and {self.centered_clip_scale!r}"
            )
        if not self.max_weight_ratio >= 1 or not self.ban_ratio > 1:
            raise ValueError(
                f"max_weight_ratio must be >= 1 and ban_ratio > 1, got {self.max_weight_ratio!r} and {self.ban_ratio!r}"
            )
        if self.centered_clip_iterations < 1 or not self.centered_clip_tolerance > 0:
            raise ValueError("centered_clip_iterations must be at least 1 and centered_clip_tolerance positive")
        AlignmentConfig(min_rounds=self.alignment_rounds, z=self.alignment_z)  # raises on bad alignment settings

    @property
    def alignment(self) -> AlignmentConfig:
        return AlignmentConfig(min_rounds=self.alignment_rounds, z=self.alignment_z)


@dataclass
class Aggregate:
    """The outcome of one robust aggregation."""

    vector: Optional[torch.Tensor]  # float64 result; None when nothing could be aggregated
    included: List[str]  # peers whose contributions went in, in the order used
    weights: Dict[str, float]  # the bounded weight of each included peer
    excluded: Dict[str, str] = field(default_factory=dict)  # peer -> why its contribution was left out
    banned: Dict[str, str] = field(default_factory=dict)  # peer -> why it must be banned (a subset of excluded)
    tau: float = 0.0
    iterations: int = 0
    distances: Dict[str, float] = field(default_factory=dict)  # distance of each included contribution from the result
    cosines: Dict[Pair, float] = field(default_factory=dict)  # between every two included contributions with samples

    @property
    def samples(self) -> float:
        return sum(self.weights.values())


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return 0.0
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def bounded_weights(claims: Sequence[float], max_ratio: float, cap: Optional[float] = None) -> List[float]:
    """Claimed sample counts, each capped at ``max_ratio`` x the median positive claim (and at ``cap``)."""
    positive = [c for c in claims if c > 0]
    limit = max_ratio * _median(positive) if positive else 0.0
    if cap is not None:
        limit = min(limit, cap)
    return [min(max(float(c), 0.0), limit) for c in claims]


def coordinate_median(vectors: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of the rows (the mean of the two middle values for an even count)."""
    ordered = vectors.sort(dim=0).values
    n = vectors.shape[0]
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _distances(vectors: torch.Tensor, center: torch.Tensor) -> List[float]:
    return [float(torch.linalg.vector_norm(row - center)) for row in vectors]


def clip_radius(vectors: torch.Tensor, config: AggregationConfig) -> float:
    """The configured radius, or ``centered_clip_scale`` x the median distance of the rows from their
    coordinate-wise median."""
    if config.centered_clip_tau > 0:
        return config.centered_clip_tau
    return config.centered_clip_scale * _median(_distances(vectors, coordinate_median(vectors)))


def centered_clip(
    vectors: torch.Tensor, weights: Sequence[float], tau: float, max_iterations: int = 100, tolerance: float = 1e-7
) -> Tuple[torch.Tensor, int]:
    """CenteredClip from the coordinate-wise median; returns (result, iterations run)."""
    x = coordinate_median(vectors)
    total = float(sum(weights))
    if total <= 0 or tau <= 0:
        return x, 0
    for iteration in range(1, max_iterations + 1):
        step = torch.zeros_like(x)
        for row, weight in zip(vectors, weights):  # a fixed order: the same bits on every replica
            diff = row - x
            norm = float(torch.linalg.vector_norm(diff))
            scale = 1.0 if norm <= tau else tau / norm
            step.add_(diff, alpha=weight * scale / total)
        x = x + step
        if float(torch.linalg.vector_norm(step)) <= tolerance * tau:
            return x, iteration
    return x, max_iterations


def equivocators(commitments: Mapping[str, Set[str]]) -> Set[str]:
    """Senders that signed more than one content hash for the same round: proof that they equivocated."""
    return {sender for sender, hashes in commitments.items() if len(hashes) > 1}


def robust_aggregate(
    contributions: Mapping[str, torch.Tensor],
    claims: Mapping[str, float],
    config: AggregationConfig,
    banned: AbstractSet[str] = frozenset(),
    equivocated: AbstractSet[str] = frozenset(),
    max_samples: Optional[float] = None,
) -> Aggregate:
    """Combine flat gradient vectors (peer id -> vector) into one, leaving out and naming the bad ones, with the
    cosines between the included contributions that have samples (unless the alignment check is off)."""
    excluded: Dict[str, str] = {}
    bans: Dict[str, str] = {}
    peers: List[str] = []
    empty: List[str] = []
    for peer in sorted(contributions):
        vector = contributions[peer]
        if peer in banned:
            excluded[peer] = "banned earlier"
        elif peer in equivocated:
            excluded[peer] = bans[peer] = "signed two different gradients for one round"
        elif not all_finite(vector):
            excluded[peer] = bans[peer] = "sent non-finite gradients"
        elif not math.isfinite(claims.get(peer, 0)):
            excluded[peer] = f"claimed {claims.get(peer)!r} samples"
        elif adds_nothing(claims.get(peer, 0)):
            empty.append(peer)  # a member that had no samples this step: it takes part, with nothing to add
        else:
            peers.append(peer)
    if not peers:
        if not empty:
            return Aggregate(None, [], {}, excluded, bans)
        return Aggregate(
            torch.zeros_like(contributions[empty[0]], dtype=torch.float64),
            empty,
            dict.fromkeys(empty, 0.0),
            excluded,
            bans,
        )
    aggregate = _aggregate_nonempty(peers, contributions, claims, config, excluded, bans, max_samples)
    if config.alignment.enabled:
        aggregate.cosines = pair_cosines({p: contributions[p] for p in aggregate.included})
    aggregate.included += empty
    aggregate.weights.update(dict.fromkeys(empty, 0.0))
    return aggregate


def _aggregate_nonempty(
    peers: List[str],
    contributions: Mapping[str, torch.Tensor],
    claims: Mapping[str, float],
    config: AggregationConfig,
    excluded: Dict[str, str],
    bans: Dict[str, str],
    max_samples: Optional[float],
) -> Aggregate:
    weights = bounded_weights([claims[p] for p in peers], config.max_weight_ratio, max_samples)
    vectors = torch.stack([contributions[p].to(torch.float64) for p in peers])
    if len(peers) == 1:
        return Aggregate(vectors[0].clone(), peers, {peers[0]: weights[0]}, excluded, bans)
    tau = clip_radius(vectors, config)
    result, iterations = centered_clip(
        vectors, weights, tau, config.centered_clip_iterations, config.centered_clip_tolerance
    )
    distances = dict(zip(peers, _distances(vectors, result)))
    typical = _median(list(distances.values()))
    if len(peers) >= 3 and typical > 0:
        for peer, distance in distances.items():
            if distance > config.ban_ratio * typical:
                bans[peer] = (
                    f"sent a gradient {distance / typical:.0f}x farther from the robust mean than the median replica"
                )
    if bans.keys() & set(peers):  # recompute without the attackers, so the result does not carry their pull at all
        kept = [p for p in peers if p not in bans]
        for peer in set(peers) - set(kept):
            excluded[peer] = bans[peer]
        # without the cosines: the caller computes them once, over what this returns
        unchecked = replace(config, alignment_rounds=0)
        inner = robust_aggregate({p: contributions[p] for p in kept}, claims, unchecked, max_samples=max_samples)
        inner.excluded.update(excluded)
        inner.banned.update(bans)
        return inner
    return Aggregate(result, peers, dict(zip(peers, weights)), excluded, bans, tau, iterations, distances)


def banned_by_majority(excluded_by: Mapping[str, Sequence[str]]) -> Set[str]:
    """Replicas of one stage that a strict majority of their stage-mates banned from averaging.

    ``excluded_by``: each online replica of the stage -> the stage-mates it announces as banned. A minority
    of liars can therefore never get an honest replica shunned (nor can one of two replicas), and a banned
    replica's own list is ignored as far as it concerns itself."""
    replicas = set(excluded_by)
    banned = set()
    for candidate in replicas:
        voters = replicas - {candidate}
        votes = sum(1 for voter in voters if candidate in excluded_by[voter])
        if len(voters) >= 2 and votes * 2 > len(voters):  # one stage-mate alone could be the liar
            banned.add(candidate)
    return banned
