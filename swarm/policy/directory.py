"""How a stage's peer records are spread over DHT keys, and which of those keys a reader reads.

One DHT value holding every replica of a stage grows with the stage: at a few thousand replicas it
passes p2pd's 4 MiB message cap, and every reader moves every record on every poll. So a stage's
directory is cut into *shards*: at *level* ``b`` the stage has ``2**b`` shards, and a record lives
in the shard numbered by the top ``b`` bits of a hash of its owner's id. The level follows the size
of the stage (``level_for``: each shard holds about ``SHARD_CAPACITY`` records), so a small stage
stays one key, exactly the single stage key of an unsharded layout.

Writers and readers need not agree on the size exactly: a writer stores its record at every level
that a size within ``WRITE_BAND`` of its own estimate maps to (at most two), so a reader whose
estimate differs by less than that still finds it. Every reader estimates the size alike, by a
*probe*: it reads a shard at every level (at the levels next to its own between full probes,
``probe_levels``) and weights what it finds by the chance of finding it (``probe_estimate``, without
bias whichever levels the writers chose); it then reads the level of that size. Between probes it
reads its own shard and ``rotate`` more shards per poll, round robin (``shards_to_read``), so what
one read moves is bounded by the shard size whatever the swarm's size; a reader of a stage of
``2**b`` shards sees all of it within ``2**b / rotate`` polls.

Pure functions, so that the traffic model (:mod:`swarm.simulate.dht_traffic`) and tests use the
same layout as the live readers (:mod:`swarm.dht.directory`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Collection, Iterable, List, Sequence, Tuple

__all__ = [
    "SHARD_CAPACITY",
    "MAX_LEVEL",
    "WRITE_BAND",
    "level_for",
    "write_levels",
    "shard_of",
    "shard_count",
    "probe_estimate",
    "probe_levels",
    "mean_probe_levels",
    "shards_to_read",
    "probe_due",
    "coverage_polls",
    "stages_to_read",
]

# records a shard holds at most when the level matches the stage's size: what one read of a stage moves
# is about (1 + rotate) shards, so a small capacity keeps a poll's bytes flat from stages of a few replicas up
SHARD_CAPACITY = 4
# at most 1,024 shards a stage (4,096 replicas at capacity; past that shards grow, to 4 MiB at ~2 million)
MAX_LEVEL = 10
# a reader's own shard found empty makes it probe at once only when the level it reads puts more than this many
# records in a shard: an empty shard is then unlikely by chance (below e**-3), so the writers likely moved
EMPTY_HOME_SURPRISE = 3.0
WRITE_BAND = 1.4  # a writer covers sizes within this factor of its estimate (< 2: at most two levels)
# a probe reads the levels within PROBE_REACH of the reader's own, and every level on the first probe and on every
# FULL_PROBE_EVERY-th: each level is one more key whose lookup walks a beam of nodes, and the levels far from the
# stage's size hold nothing
PROBE_REACH = 1
FULL_PROBE_EVERY = 4
_HASH_BITS = 64


def level_for(stage_size: float) -> int:
    """The level at which a stage of ``stage_size`` replicas has about ``SHARD_CAPACITY`` records a shard."""
    if not stage_size > SHARD_CAPACITY:  # also NaN and negative sizes: one key
        return 0
    return min(MAX_LEVEL, math.ceil(math.log2(stage_size / SHARD_CAPACITY)))


def write_levels(stage_size: float) -> Tuple[int, ...]:
    """The levels a writer stores its record at: those of every size within ``WRITE_BAND`` of its estimate."""
    levels = {level_for(stage_size / WRITE_BAND), level_for(stage_size), level_for(stage_size * WRITE_BAND)}
    return tuple(sorted(levels))


def shard_count(level: int) -> int:
    if not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"level must be in 0..{MAX_LEVEL}, got {level}")
    return 2**level


def shard_of(record_id: str, level: int) -> int:
    """The shard of ``record_id`` at ``level``: the top ``level`` bits of its SHA-256, so that shard ``j`` at
    level ``b`` splits into shards ``2j`` and ``2j + 1`` at level ``b + 1``."""
    count = shard_count(level)
    if count == 1:
        return 0
    digest = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
    return digest >> (_HASH_BITS - level)


def probe_estimate(found_at: Iterable[int]) -> float:
    """The stage's size from a probe: ``found_at`` holds, for every distinct record the probe found, the lowest
    level it was found at. A record written at levels ``b..b+1`` is in the reader's own shard at ``b`` with
    probability ``2**-b`` and, shards being nested, whenever it is there at ``b + 1`` it is there at ``b`` too:
    so its lowest level found is its lowest level written, and weighting each record by ``2**level`` (the
    inverse of its chance to be found) estimates the size without bias, whatever level each writer chose."""
    return float(sum(shard_count(level) for level in found_at))


def probe_levels(level: int, probes_done: int) -> range:
    """The levels a probe reads, given the reader's level and its probes so far.

    ``probe_estimate`` stays without bias over a window of levels for every record written at a level inside
    it: a record's lowest written level in the window is where it is found, with the chance its weight undoes.
    Writers whose estimate is so far from the reader's that none of their levels is in the window (a stage
    that grew or shrank several-fold since the last probe) are missed until the next full probe."""
    if probes_done % FULL_PROBE_EVERY == 0:
        return range(MAX_LEVEL + 1)
    return range(max(0, level - PROBE_REACH), min(MAX_LEVEL, level + PROBE_REACH) + 1)


def mean_probe_levels(level: int) -> float:
    """Levels a probe reads on average over a reader's probes."""
    return sum(len(probe_levels(level, done)) for done in range(FULL_PROBE_EVERY)) / FULL_PROBE_EVERY


def shards_to_read(level: int, home: int, cursor: int, rotate: int) -> Tuple[List[int], int]:
    """The shards one read covers: the reader's own shard ``home`` and the next ``rotate`` others, round
    robin from ``cursor``; and the cursor for the next read. ``rotate < 0`` reads every shard."""
    count = shard_count(level)
    if rotate < 0 or rotate + 1 >= count:
        return list(range(count)), 0
    others: List[int] = []
    position = cursor % count
    while len(others) < rotate:
        if position != home:
            others.append(position)
        position = (position + 1) % count
    return [home, *others], position


def probe_due(level: int, home_count: int, estimated_size: float, since_probe_s: float, period_s: float) -> bool:
    """Whether to probe every level again: periodically, or at once when the reader's own shard says the
    stage left the range of its level (the writers may have moved to another level): it is empty where
    the size estimate makes that unlikely, or the estimate maps to a level no writer of that size uses."""
    if since_probe_s >= period_s:
        return True
    surprising = estimated_size / shard_count(level) > EMPTY_HOME_SURPRISE
    if level > 0 and home_count == 0 and surprising:  # (home_count -1: not read yet)
        return True
    return level_for(estimated_size) != level and write_levels(estimated_size).count(level) == 0


def coverage_polls(level: int, rotate: int) -> float:
    """Polls a reader needs to see every shard once."""
    count = shard_count(level)
    return 1.0 if rotate < 0 or rotate + 1 >= count else math.ceil((count - 1) / rotate)


def stages_to_read(read_at: Sequence[float], max_stages: int, urgent: Collection[int] = ()) -> List[int]:
    """The stages a reader of the whole swarm (a trainer) reads this time, in stage order: every ``urgent`` one
    (a call there failed), then those read longest ago (``read_at``: when each stage was last read), ``max_stages``
    in all unless more are urgent. Between reads such a reader learns what it routes by from its calls' replies,
    and needs a stage's records only for who serves there: a few stages a read keeps its traffic flat however
    many stages the model has, and every stage is read once in ``ceil(stages / max_stages)`` reads."""
    if max_stages < 1:
        raise ValueError(f"max_stages must be at least 1, got {max_stages}")
    chosen = {stage for stage in urgent if 0 <= stage < len(read_at)}
    for stage in sorted(range(len(read_at)), key=lambda s: (read_at[s], s)):
        if len(chosen) >= max_stages:
            break
        chosen.add(stage)
    return sorted(chosen)
