"""Beyond the paper's equal groups: drop devices or make groups unequal when that is faster.

A best-improvement descent over three moves: leave a device out, move a device to another
group, bring a left-out device back into a group. Each pass prices every move with the full
cost model (which handles unequal groups, see ``cost``) and takes the best one that lowers
the iteration time; it stops at a local minimum or at the deadline. A typical win: a device
much slower than its group's other members is dropped, so it no longer sets the pace.
"""

from __future__ import annotations

import time
from typing import Iterator

from swarm.planner.cost import CostModel

__all__ = ["improve_uneven"]

Groups = list[list[int]]


def _neighbours(groups: Groups, unused: list[int]) -> Iterator[tuple[Groups, list[int]]]:
    for g, members in enumerate(groups):
        if len(members) <= 1:
            continue
        for d in members:
            rest = [x for x in members if x != d]
            yield groups[:g] + [rest] + groups[g + 1 :], unused + [d]
            for h in range(len(groups)):
                if h != g:
                    moved = [list(m) for m in groups]
                    moved[g], moved[h] = rest, groups[h] + [d]
                    yield moved, list(unused)
    for d in unused:
        others = [x for x in unused if x != d]
        for h in range(len(groups)):
            added = [list(m) for m in groups]
            added[h] = groups[h] + [d]
            yield added, others


def improve_uneven(
    model: CostModel, groups: Groups, unused: list[int], deadline: float
) -> tuple[Groups, list[int], int]:
    """Descend from (groups, unused) until no move helps or ``deadline`` (perf_counter) passes."""
    current = model.total_s(groups)
    evaluations = 0
    while time.perf_counter() < deadline:
        best = None
        for candidate, left_out in _neighbours(groups, unused):
            if time.perf_counter() >= deadline:
                break
            evaluations += 1
            cost = model.total_s(candidate)
            if cost < current - 1e-9 and (best is None or cost < best[0]):
                best = (cost, candidate, left_out)
        if best is None:
            break
        current, groups, unused = best
    return groups, unused, evaluations
