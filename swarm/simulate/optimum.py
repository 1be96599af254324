"""The best possible swarm throughput: an exact max-min partition of peers into stages.

With a peer's throughput the same on every stage, the optimum assigns the live peers to S
stages so as to maximise the smallest stage sum: the max-min ("machine covering")
partition problem, NP-hard in general. It is nonetheless solved exactly here, because
throughputs are integers (multiples of a quantum, as the simulator generates them) and:

* Upper bound. If the largest value v satisfies v * S >= total, some optimal partition
  puts v alone in a stage (that stage is >= v >= total/S >= OPT whatever else it holds, so
  moving its other items elsewhere never lowers the minimum): peel it off and solve the
  rest with S - 1 stages. Once no value is that large, OPT <= floor(total / S).
* Lower bound. A partition built greedily (largest first into the emptiest stage) and
  improved by moves and swaps that strictly raise the sorted load vector. With many peers
  per stage this reaches floor(total / S) and is then *proved* optimal by the bound.
* Otherwise (small swarms) a branch and bound search finishes the job exactly.

If neither applies (a large swarm whose partition the repair could not tighten), the result
says ``exact=False`` and carries both the best partition found and the proven upper bound;
the simulator then uses the upper bound (so fractions of optimal are, if anything,
understated) and reports how often that happened (about 1 in 1000 evaluations, each
within a few quanta of the bound).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PartitionResult", "max_min_partition", "MaxMinTracker", "BRANCH_AND_BOUND_MAX_ITEMS"]

BRANCH_AND_BOUND_MAX_ITEMS = 22  # beyond this the search is not attempted (it would be slow)


@dataclass(frozen=True)
class PartitionResult:
    """Optimal smallest stage sum (integer units) and whether it is proved optimal.

    When not proved, ``value`` is the best partition found and ``upper`` a proven bound,
    so the optimum lies in [value, upper]; otherwise both are equal.
    """

    value: int
    exact: bool
    upper: Optional[int] = None

    def __post_init__(self) -> None:
        if self.upper is None:
            object.__setattr__(self, "upper", self.value)


class MaxMinTracker:
    """A partition of integer values into ``num_bins`` kept near max-min optimal under adds and removes.

    Used by the simulator, which needs the optimum after every join and departure of a
    peer: repairing the previous partition takes a few swaps, rebuilding it takes far more.
    """

    def __init__(self, num_bins: int) -> None:
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        self.num_bins = num_bins
        self.loads = [0] * num_bins
        self.bins: List[Counter] = [Counter() for _ in range(num_bins)]
        self.where: Dict[Hashable, Tuple[int, int]] = {}
        self.members: List[Dict[int, set]] = [{} for _ in range(num_bins)]  # bin -> value -> keys
        self.values: Counter = Counter()
        self.distinct: List[List[int]] = [[] for _ in range(num_bins)]  # bin -> its distinct values, sorted
        # bin -> sorted distinct sums of up to two of its items, and the values making each up
        self._combo_cache: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.where)

    def add(self, key: Hashable, value: int) -> None:
        if key in self.where:
            raise KeyError(f"{key!r} already present")
        if value <= 0:
            raise ValueError(f"values must be positive integers, got {value}")
        target = min(range(self.num_bins), key=self.loads.__getitem__)
        self._put(key, value, target)
        self.values[value] += 1

    def remove(self, key: Hashable) -> None:
        index, value = self.where.pop(key)
        self._take(index, value)
        self._forget(index, value, key)
        self.values[value] -= 1
        if not self.values[value]:
            del self.values[value]

    def _forget(self, index: int, value: int, key: Hashable) -> None:
        keys = self.members[index][value]
        keys.discard(key)
        if not keys:
            del self.members[index][value]

    def _put(self, key: Hashable, value: int, index: int) -> None:
        self.where[key] = (index, value)
        self.members[index].setdefault(value, set()).add(key)
        if not self.bins[index][value]:
            bisect.insort(self.distinct[index], value)
        self.bins[index][value] += 1
        self.loads[index] += value
        self._combo_cache.pop(index, None)

    def _take(self, index: int, value: int) -> None:
        self.bins[index][value] -= 1
        if not self.bins[index][value]:
            del self.bins[index][value]
            distinct = self.distinct[index]
            del distinct[bisect.bisect_left(distinct, value)]
        self.loads[index] -= value
        self._combo_cache.pop(index, None)

    def _relocate(self, index_from: int, value: int, index_to: int) -> None:
        key = min(self.members[index_from][value], key=repr)  # deterministic choice
        self._forget(index_from, value, key)
        self._take(index_from, value)
        self._put(key, value, index_to)

    def _combos(self, index: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every selection of at most two items of a bin, as arrays over distinct sums.

        Returns ``(sums, first, second)``: sorted distinct sums and, for each, the values of
        one selection making it up (0 where the selection has fewer items). Cached until the
        bin changes.
        """
        cached = self._combo_cache.get(index)
        if cached is not None:
            return cached
        counts = self.bins[index]
        values = np.array(self.distinct[index], dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        sums, first, second = [zero, values], [zero, values], [zero, np.zeros_like(values)]
        if values.size:
            multiplicity = np.fromiter((counts[v] for v in values.tolist()), dtype=np.int64, count=values.size)
            i, j = np.triu_indices(values.size)
            keep = (i != j) | (multiplicity[i] >= 2)  # the same value twice needs two items
            i, j = i[keep], j[keep]
            sums.append(values[i] + values[j])
            first.append(values[i])
            second.append(values[j])
        all_sums = np.concatenate(sums)
        distinct, where = np.unique(all_sums, return_index=True)  # first selection of each sum
        cached = (distinct, np.concatenate(first)[where], np.concatenate(second)[where])
        self._combo_cache[index] = cached
        return cached

    def _best_step(self, low: int, high: int, pairs: bool) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """Items to exchange, (from high, from low), so that 0 < moved sum < the load gap.

        Both bins then end strictly above the old low load, so the sorted load vector
        strictly improves: the repair always terminates. Single items are tried first;
        pairs widen the set of reachable differences when the partition is nearly tight.
        Among valid exchanges the one moving closest to half the gap wins.
        """
        gap = self.loads[high] - self.loads[low]
        if gap <= 1:
            return None
        if not pairs:
            return self._best_single(low, high, gap)
        ideal = gap / 2.0
        high_sums, high_first, high_second = self._combos(high)
        low_sums, low_first, low_second = self._combos(low)
        right = np.searchsorted(high_sums, low_sums + ideal)
        nearest = np.stack([right - 1, np.minimum(right, high_sums.size - 1)])
        in_range = nearest >= 0
        nearest = np.maximum(nearest, 0)
        delta = high_sums[nearest] - low_sums
        valid = in_range & (delta > 0) & (delta < gap)
        if not valid.any():
            return None
        flat = int(np.argmin(np.where(valid, np.abs(delta - ideal), np.inf)))
        low_index = flat % low_sums.size
        high_index = int(nearest.flat[flat])
        from_high = tuple(int(v) for v in (high_first[high_index], high_second[high_index]) if v)
        from_low = tuple(int(v) for v in (low_first[low_index], low_second[low_index]) if v)
        return from_high, from_low

    def _best_single(self, low: int, high: int, gap: int) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """:meth:`_best_step` with at most one item from each bin, on the sorted distinct values.

        Stops at the first exchange that moves exactly half the gap (rounded): none is
        better, and with many distinct values one is usually found within a few tries.
        """
        ideal, perfect = gap / 2.0, (gap % 2) / 2.0
        highs = self.distinct[high]
        best, best_dist = None, math.inf
        for y in itertools.chain((0,), self.distinct[low]):
            i = bisect.bisect_left(highs, y + ideal)
            for j in (i - 1, i):
                if 0 <= j < len(highs):
                    delta = highs[j] - y
                    if 0 < delta < gap and abs(delta - ideal) < best_dist:
                        best, best_dist = ((highs[j],), (y,) if y else ()), abs(delta - ideal)
                        if best_dist <= perfect:
                            return best
        return best

    def improve(self, target: int, max_steps: int = 10_000) -> int:
        """Raise the smallest load towards ``target`` by steps that strictly improve the sorted loads."""
        for _ in range(max_steps):
            low = min(range(self.num_bins), key=self.loads.__getitem__)
            if self.loads[low] >= target:
                break
            step, high = None, None
            for pairs in (False, True):
                for high in sorted(range(self.num_bins), key=lambda i: -self.loads[i]):
                    step = self._best_step(low, high, pairs)
                    if step is not None:
                        break
                if step is not None:
                    break
            if step is None or high is None:
                break
            from_high, from_low = step
            for value in from_high:
                self._relocate(high, value, low)
            for value in from_low:
                self._relocate(low, value, high)
        return min(self.loads)

    def optimum(self) -> PartitionResult:
        """The exact optimum of the current values (repairing the partition as needed)."""
        if len(self.where) < self.num_bins:
            return PartitionResult(0, True)
        total, largest = sum(self.loads), max(self.values)
        if largest * self.num_bins >= total or len(self.where) <= BRANCH_AND_BOUND_MAX_ITEMS:
            return max_min_partition(list(self.values.elements()), self.num_bins)
        upper = total // self.num_bins
        achieved = self.improve(upper)
        return PartitionResult(achieved, achieved == upper, upper)


def _branch_and_bound(values: Sequence[int], num_bins: int, incumbent: int) -> int:
    """Exact max-min by depth-first search (values sorted descending, symmetric bins skipped)."""
    items = sorted(values, reverse=True)
    suffix = [0] * (len(items) + 1)
    for i in range(len(items) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + items[i]
    loads = [0] * num_bins
    best = incumbent

    def bound(remaining: int) -> int:
        # the k lightest bins can reach at most (their loads + everything left) / k each
        lightest = itertools.accumulate(sorted(loads))
        return min((running + remaining) // k for k, running in enumerate(lightest, start=1))

    def search(i: int) -> None:
        nonlocal best
        if i == len(items):
            best = max(best, min(loads))
            return
        if bound(suffix[i]) <= best:
            return
        seen = set()
        for b in sorted(range(num_bins), key=loads.__getitem__):
            if loads[b] in seen:
                continue
            seen.add(loads[b])
            loads[b] += items[i]
            search(i + 1)
            loads[b] -= items[i]

    search(0)
    return best


def max_min_partition(values: Sequence[int], num_bins: int) -> PartitionResult:
    """Exact max over partitions of ``values`` into ``num_bins`` groups of the smallest group sum."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    remaining = sorted((int(v) for v in values), reverse=True)
    if any(v <= 0 for v in remaining):
        raise ValueError("values must be positive integers")
    bins, peeled_min = num_bins, None
    while bins > 1 and len(remaining) >= bins and remaining[0] * bins >= sum(remaining):
        peeled_min = remaining[0] if peeled_min is None else min(peeled_min, remaining[0])
        remaining, bins = remaining[1:], bins - 1
    if len(remaining) < bins:
        return PartitionResult(0, True)
    if bins == 1:
        value = sum(remaining)
        return PartitionResult(value if peeled_min is None else min(value, peeled_min), True)
    tracker = MaxMinTracker(bins)
    for i, v in enumerate(remaining):  # descending order into the emptiest bin: LPT
        tracker.add(i, v)
    upper = sum(remaining) // bins
    achieved = tracker.improve(upper)
    exact = achieved == upper
    if not exact and len(remaining) <= BRANCH_AND_BOUND_MAX_ITEMS:
        achieved, exact = _branch_and_bound(remaining, bins, achieved), True
    # peeled values are each >= the rest's optimum, so they never lower it
    return PartitionResult(achieved, exact, achieved if exact else upper)
