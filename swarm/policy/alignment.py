"""Which replicas' gradients point against their stage-mates', judged over many rounds: pure functions.

CenteredClip bounds how far one contribution moves a round's result, and the distance test bans what is
far from the rest; neither sees a replica that sends its gradient negated at its own norm. Such a gradient
is as far from the honest ones as an honest one is, but it points the other way: every step it pulls the
stage back up the loss by up to the clipping radius.

Every member of a robust round holds every included gradient, so each can measure, for every pair of
members that contributed samples, the cosine between their gradients (:func:`pair_cosines`). Two honest
replicas estimate the same expected gradient from different samples, so their cosine is positive on
average; with small batches a single round's cosine is noise (0.05 to 0.3, sometimes below zero), so one
round proves nothing. A pair's *record* is the cosines of the rounds they shared, most recent
``window`` of them; a pair is **opposed** once its record holds ``min_rounds`` rounds and the mean cosine is
``z`` standard errors below zero (:func:`pair_is_opposed`). A replica is accused once it is opposed to a
strict majority of the stage-mates it has a record with, and to at least two of them
(:func:`opposed_members`): with honest replicas a strict majority of the stage, an honest one has more
honest stage-mates than attackers, so attackers alone cannot get it accused; and one stage-mate's word
never decides between two replicas.

Attackers that collude gain nothing here: two replicas that both negate their gradients agree with each
other, and each is still opposed to the honest majority. What this does not catch is a shift that keeps
its cosine with the honest gradients positive (a little-is-enough attack); CenteredClip bounds that one.

Every honest member computes the same cosines from the same inputs in the same order, so honest members
that applied the same rounds accuse alike; the accusation is then a ban by each, which the stage's records
carry and :func:`swarm.policy.aggregation.banned_by_majority` turns into an exclusion.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, Mapping, Sequence, Tuple

import torch

__all__ = [
    "AlignmentConfig",
    "Pair",
    "pair_cosines",
    "pair_is_opposed",
    "opposed_members",
    "AlignmentRecord",
]

Pair = Tuple[str, str]  # two peer ids, in sorted order


@dataclass(frozen=True)
class AlignmentConfig:
    """When a replica's gradients count as opposed to its stage-mates'; the same on every replica."""

    min_rounds: int = 8  # shared rounds a pair needs before its record can accuse; 0 = no alignment check
    window: int = 64  # most recent shared rounds a pair's record keeps
    z: float = 4.0  # standard errors below zero a pair's mean cosine must be
    min_spread: float = 0.02  # floor of the per-round spread of cosines, so a few near-equal rounds prove little

    def __post_init__(self) -> None:
        if self.min_rounds < 0 or (self.min_rounds and self.min_rounds < 3):
            raise ValueError(f"alignment min_rounds must be 0 (off) or at least 3, got {self.min_rounds!r}")
        if self.window < max(self.min_rounds, 1):
            raise ValueError(f"alignment window ({self.window!r}) must hold at least min_rounds ({self.min_rounds!r})")
        if not self.z > 0 or not self.min_spread > 0:
            raise ValueError(f"alignment z and min_spread must be positive, got {self.z!r} and {self.min_spread!r}")

    @property
    def enabled(self) -> bool:
        return self.min_rounds > 0


CHUNK_VALUES = 2**18  # values per contribution converted to float64 at a time


def pair_cosines(contributions: Mapping[str, torch.Tensor]) -> Dict[Pair, float]:
    """The cosine between every two contributions (peer id -> flat gradient of one size), accumulated in
    float64 over chunks in a fixed order, so no float64 copy of a whole gradient is made. A vector without a
    direction (zero or not finite) has no cosine: its pairs are left out."""
    peers = sorted(contributions)
    flat = [contributions[p].detach().reshape(-1) for p in peers]
    if len(peers) < 2:
        return {}
    if len({v.numel() for v in flat}) != 1:
        raise ValueError(f"contributions differ in size: {sorted({v.numel() for v in flat})}")
    gram = torch.zeros(len(peers), len(peers), dtype=torch.float64)
    for start in range(0, flat[0].numel(), CHUNK_VALUES):
        block = torch.stack([v[start : start + CHUNK_VALUES].to(torch.float64) for v in flat])
        gram += block @ block.T
    norms = [math.sqrt(float(gram[i, i])) for i in range(len(peers))]
    cosines: Dict[Pair, float] = {}
    for i, a in enumerate(peers):
        for j in range(i + 1, len(peers)):
            if norms[i] > 0 and norms[j] > 0 and math.isfinite(norms[i]) and math.isfinite(norms[j]):
                cosines[(a, peers[j])] = float(gram[i, j]) / (norms[i] * norms[j])
    return cosines


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a < b else (b, a)


def _mean_and_error(values: Sequence[float], min_spread: float) -> Tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, max(math.sqrt(variance), min_spread) / math.sqrt(n)


def pair_is_opposed(cosines: Sequence[float], config: AlignmentConfig) -> bool:
    """Whether a pair's record of cosines shows their gradients pointing apart, beyond noise."""
    if not config.enabled or len(cosines) < config.min_rounds:
        return False
    mean, error = _mean_and_error(cosines, config.min_spread)
    return mean < -config.z * error


def opposed_members(records: Mapping[Pair, Sequence[float]], config: AlignmentConfig) -> Dict[str, str]:
    """Members opposed to a strict majority (and at least two) of the stage-mates they share a full record
    with, each with the reason."""
    judged: Dict[str, Dict[str, bool]] = {}  # member -> stage-mate -> opposed
    for (a, b), cosines in sorted(records.items()):
        if not config.enabled or len(cosines) < config.min_rounds:
            continue
        opposed = pair_is_opposed(cosines, config)
        judged.setdefault(a, {})[b] = opposed
        judged.setdefault(b, {})[a] = opposed
    accused: Dict[str, str] = {}
    for member, mates in sorted(judged.items()):
        against = sorted(m for m, opposed in mates.items() if opposed)
        if len(against) >= 2 and 2 * len(against) > len(mates):
            pairs = [_pair(member, m) for m in against]
            means = [_mean_and_error(records[pair], config.min_spread)[0] for pair in pairs]
            rounds = min(len(records[pair]) for pair in pairs)
            accused[member] = (
                f"its gradients pointed against those of {len(against)} of {len(mates)} stage-mates over "
                f"{rounds}+ rounds (mean cosine {sum(means) / len(means):+.3f})"
            )
    return accused


class AlignmentRecord:
    """The cosines of the rounds each pair of members shared (the last ``window``), kept by one averager."""

    STALE_WINDOWS = 4  # a pair that shared no round in this many windows of rounds is dropped (one left)

    def __init__(self, config: AlignmentConfig):
        self.config = config
        self.records: Dict[Pair, Deque[float]] = {}
        self._rounds = 0
        self._last: Dict[Pair, int] = {}  # pair -> the round it last shared

    def add(self, cosines: Mapping[Pair, float]) -> None:
        self._rounds += 1
        for pair, cosine in cosines.items():
            self.records.setdefault(pair, deque(maxlen=self.config.window)).append(cosine)
            self._last[pair] = self._rounds
        horizon = self._rounds - self.STALE_WINDOWS * self.config.window
        for pair in [p for p, last in self._last.items() if last < horizon]:
            del self.records[pair], self._last[pair]

    def forget(self, peers: Iterable[str]) -> None:
        """Drop every record of ``peers`` (banned ones: a later return starts from nothing)."""
        gone = set(peers)
        self.records = {pair: r for pair, r in self.records.items() if not gone & set(pair)}
        self._last = {pair: last for pair, last in self._last.items() if pair in self.records}

    def opposed(self) -> Dict[str, str]:
        return opposed_members(self.records, self.config)
