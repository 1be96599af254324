"""Whom a joining or resyncing replica downloads its stage's state from, and whether to keep what came.

A replica's record announces its step and the digest of its parameters at that step, but a record is
a claim: a replica may serve a state other than the one it announces. So the downloader
- trusts only the (step, digest) that a strict majority of the stage's other online replicas announce
  (with one other replica that one is the majority: there is nobody to outvote it), leaving out the
  replicas it already caught serving a bad state;
- downloads only from replicas that announced that digest, in random order so that joiners spread
  their load over them;
- keeps a downloaded state only if it is complete, every value is finite and its parameters hash to
  the trusted digest (:func:`check_downloaded_state`); a replica whose state fails those checks served
  something other than what it announced, and is distrusted.

Pure decisions over plain data: no clocks, no I/O, no torch; the caller computes the digest.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Optional, Sequence, Tuple

__all__ = ["StateClaim", "StateSources", "StateVerdict", "trusted_state_sources", "check_downloaded_state"]


@dataclass(frozen=True)
class StateClaim:
    """What one replica of the stage announces about its state (its DHT record, reduced)."""

    peer_id: str
    state: str  # "joining", "online" or "leaving": only online replicas serve their state
    step: int  # global steps applied to its parameters
    digest: str  # hash of its parameters at `step`; empty = unknown


@dataclass(frozen=True)
class StateSources:
    """The state to download (its step and digest) and the replicas to ask for it, in order."""

    peer_ids: Tuple[str, ...]  # empty: no trusted source (see `reason`)
    step: int = -1
    digest: str = ""
    reason: str = ""  # why there is no trusted source


@dataclass(frozen=True)
class StateVerdict:
    """Whether to adopt a downloaded state and, if not, whether its sender lied about it."""

    accept: bool
    distrust: bool = False  # the sender served a state other than the one it announced
    reason: str = ""
    moved_on: bool = False  # the sender's state is at a later step than announced: its claim holds, and more


def trusted_state_sources(
    claims: Sequence[StateClaim], own_id: str, distrusted: Collection[str], rng: random.Random
) -> StateSources:
    """The peers to download the stage's state from: those announcing the (step, digest) held by a
    strict majority of the other online replicas that are not distrusted (at most one pair can be).
    No majority, no source: the caller waits for the replicas to agree. A majority of all voters,
    not of those at one step, so that a minority cannot win by announcing a step ahead of the rest."""
    voters = [c for c in claims if c.state == "online" and c.peer_id != own_id and c.peer_id not in distrusted]
    if not voters:
        return StateSources((), reason="no trusted online replica")
    votes = Counter((c.step, c.digest) for c in voters if c.digest)
    majority = [key for key, count in votes.items() if 2 * count > len(voters)]
    if not majority:
        seen = ", ".join(
            f"{count} at step {step} ({digest or 'no digest'})"
            for (step, digest), count in sorted(votes.items(), reverse=True)
        )
        return StateSources(
            (), reason=f"no strict majority among {len(voters)} online replicas: {seen or 'no digests'}"
        )
    ((step, digest),) = majority
    peer_ids = sorted(c.peer_id for c in voters if (c.step, c.digest) == (step, digest))
    rng.shuffle(peer_ids)
    return StateSources(tuple(peer_ids), step, digest)


def check_downloaded_state(
    sources: StateSources, complete: bool, all_finite: bool, step: Optional[int], digest: str
) -> StateVerdict:
    """Judge a state downloaded from one of ``sources``.

    ``complete``: the tensors have the count and shapes of the stage's state (a stream can end early
    without an error, so an incomplete state is retried, not held against its sender); ``step``: the
    step its metadata names (None if the metadata is malformed); ``digest``: the hash of its parameters.
    A sender that moved on to a later step since its announcement is not lying: the state is merely
    stale, and records read later will show its new step."""
    if not complete:
        return StateVerdict(False, reason="the state is incomplete (wrong number or shapes of tensors)")
    if not all_finite:
        return StateVerdict(False, distrust=True, reason="the state holds NaN or infinite values")
    if step is None:
        return StateVerdict(False, distrust=True, reason="the state's metadata is malformed")
    if step != sources.step:
        return StateVerdict(
            False,
            reason=f"the state is at step {step}, not at the announced step {sources.step}",
            moved_on=step > sources.step,
        )
    if digest != sources.digest:
        return StateVerdict(
            False,
            distrust=True,
            reason=f"its parameters hash to {digest}, not to the announced digest {sources.digest}",
        )
    return StateVerdict(True)
