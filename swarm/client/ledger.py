"""Exactly-once accounting of gradient contributions, kept by each trainer.

A backward pass accumulates a micro-batch's gradient into one replica's *pending* global
step. If that replica dies, or its all-reduce round goes on without it, the gradient is gone
and the samples would silently vanish from training. The trainer therefore keeps, for every
(micro-batch, stage), what it needs to redo that backward pass (the stage input, the output
gradient, the targets) until the step that applied it is confirmed.

Only the replica that acknowledged a contribution (P, which said it went into its step s) is
asked about it, and only what P itself says about s counts first (:func:`decide`):
- P's record says whether its own gradients went into its applied step s
  (``contributed_to(s)``): True -> committed; False -> re-sent (P applied s without them);
  while P marks s *tentative* (a minority of the stage averaged it, so P may yet give that lineage
  up for the majority's state), the trainer waits: P later confirms s, or drops it and says False;
- P adopted another replica's state since it took the micro-batch (``resets`` went up): the adoption
  dropped what P held from ``reset_from`` on, so the micro-batch is re-sent unless it is provably below;
- P is gone (its record missing for a grace period, so that one failed or partial DHT read
  does not look like a death), leaving, or moved to another stage, and never said: the stage's
  live replicas are asked which peers step s averaged (RPC ``step_members``); a strict majority
  of those that know s decides; if none knows s yet the trainer waits, and once P has been
  gone long enough with nobody knowing s, P died before its step closed: re-sent.
A re-sent contribution goes to any live replica of the stage, which adds it to its current
step; replicas ignore a micro-batch id already in their current or frozen step.
Pure: no I/O; the trainer reads the records and asks the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Protocol, Sequence, Set, Tuple

import torch

__all__ = [
    "Contribution",
    "Ledger",
    "LedgerPolicy",
    "ReplicaRecord",
    "Resolution",
    "StepKey",
    "decide",
    "parse_step_members",
    "VERDICTS",
]

VERDICTS = ("commit", "resend", "wait", "ask")
MAX_MEMBERS = 4096  # peer ids one step_members reply may list
MAX_PEER_ID_CHARS = 128
StepKey = Tuple[int, int]  # (stage, step)


class ReplicaRecord(Protocol):
    """What the ledger reads of a replica's DHT record (:class:`swarm.dht.records.PeerRecord`): read-only, so
    that a record whose fields are narrower (``state`` a ``Literal``) is one."""

    @property
    def peer_id(self) -> str: ...

    @property
    def stage(self) -> int: ...

    @property
    def state(self) -> str:
        """Its state: "joining", "online" or "leaving"."""

    @property
    def step(self) -> int:
        """Global steps applied to its parameters."""

    @property
    def accum_step(self) -> int:
        """The step its backward passes accumulate into now."""

    @property
    def samples_frozen(self) -> int:
        """Samples of the previous step, being averaged now."""

    @property
    def resets(self) -> int:
        """States it adopted so far (each drops the gradients it held)."""

    @property
    def reset_from(self) -> int:
        """The lowest step whose gradients its latest adoption dropped."""

    def contributed_to(self, step: int) -> Optional[bool]:
        """Whether its own gradients went into its applied step ``step``; None if it cannot tell."""

    def is_tentative(self, step: int) -> bool:
        """Whether its applied step ``step`` may still be dropped (a minority of its stage averaged it)."""


@dataclass
class Contribution:
    """One micro-batch's gradient at one stage, and what it takes to compute it again."""

    micro_batch_id: str
    stage: int
    peer_id: str
    step: int
    samples: int
    inputs: torch.Tensor
    grad_outputs: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    resets: int = 0  # the holder's count of adopted states when it took the micro-batch


@dataclass(frozen=True)
class LedgerPolicy:
    """How long to trust a silent replica."""

    peer_grace_s: float = 5.0  # seconds a replica's record must be missing before the replica counts as gone
    # seconds a gone replica may stay unaccounted for (nobody knows its step) before its work is re-sent
    lost_after_s: float = 20.0

    def __post_init__(self) -> None:
        if not 0 < self.peer_grace_s <= self.lost_after_s:
            raise ValueError(f"need 0 < peer_grace_s <= lost_after_s, got {self.peer_grace_s} and {self.lost_after_s}")


@dataclass
class Resolution:
    """What :meth:`Ledger.resolve` found: contributions to re-send, and steps whose members to ask for."""

    resend: List[Contribution] = field(default_factory=list)
    ask: Set[StepKey] = field(default_factory=set)


def decide(
    item: Contribution,
    holder: Optional[ReplicaRecord],
    lost_s: float,
    answers: Optional[Sequence[Optional[bool]]],
    policy: LedgerPolicy = LedgerPolicy(),
) -> str:
    """One of :data:`VERDICTS` for ``item``, accumulated into step ``item.step`` of replica ``item.peer_id``.

    ``holder``: that replica's record in the current snapshot, or None if it is missing from it.
    ``lost_s``: seconds since the trainer last saw it online at ``item.stage``.
    ``answers``: None if the stage's live replicas were not asked about the step yet; else one per
    replica that answered: True (the step's members include the holder), False (they do not),
    None (that replica does not know the step)."""
    serving = holder if holder is not None and holder.stage == item.stage else None  # the holder, still at the stage
    if serving is not None and serving.resets != item.resets and not survived_reset(item, serving):
        return "resend"  # the holder adopted another state since it took the micro-batch, dropping it
    if serving is not None and serving.state == "online" and serving.is_tentative(item.step):
        return "wait"  # a minority of the stage averaged the step: it stands or is dropped once the stage agrees
    if serving is not None:
        included = serving.contributed_to(item.step)
        if included is not None:
            return "commit" if included else "resend"
        if serving.state == "online" and serving.step <= item.step:
            return "wait"  # its step item.step is not applied yet
    elif holder is None and lost_s < policy.peer_grace_s:
        return "wait"  # a record that lapsed for a moment is not a death
    # the holder is gone, leaving, moved, or applied the step beyond the window its record covers
    if answers is None:
        return "ask"
    known = [answer for answer in answers if answer is not None]
    listed = sum(known)
    if 2 * listed > len(known):
        return "commit"
    if 2 * (len(known) - listed) > len(known):
        return "resend"
    if known:
        return "wait"  # the replicas that know the step disagree evenly: ask again later
    if serving is not None and serving.state == "online":
        return "commit"  # it applied the step long ago and is still online: its own gradients were in it
    return "resend" if lost_s >= policy.lost_after_s else "wait"


def survived_reset(item: "Contribution", holder: ReplicaRecord) -> bool:
    """Whether the micro-batch is certainly still in the holder's steps although the holder adopted a state
    since it took it: one adoption only, which dropped nothing below the micro-batch's step. After two or
    more the dropped steps of the earlier ones are not known, so the micro-batch is re-sent (at worst it
    counts twice; a lost one would not count at all)."""
    return holder.resets == item.resets + 1 and item.step < holder.reset_from


def parse_step_members(reply: Mapping[str, object], step: int) -> FrozenSet[str]:
    """The peer ids a ``step_members`` reply lists for ``step``; ``ValueError`` says what is wrong with it."""
    if not isinstance(reply, Mapping):
        raise ValueError(f"the reply is a {type(reply).__name__}, not a map")
    answered = reply.get("step")
    if isinstance(answered, bool) or answered != step:
        raise ValueError(f"the reply is about step {answered!r}, not {step}")
    members = reply.get("members")
    if not isinstance(members, list) or len(members) > MAX_MEMBERS:
        raise ValueError(f"'members' must be a list of at most {MAX_MEMBERS} peer ids")
    if not all(isinstance(m, str) and 0 < len(m) <= MAX_PEER_ID_CHARS for m in members):
        raise ValueError(f"'members' must hold peer ids: strings of 1-{MAX_PEER_ID_CHARS} characters")
    return frozenset(members)


class Ledger:
    """Contributions not yet confirmed by a completed global step."""

    def __init__(self, policy: LedgerPolicy = LedgerPolicy()) -> None:
        self.policy = policy
        self._open: Dict[Tuple[str, int], Contribution] = {}
        self.samples_committed: Dict[int, int] = {}
        self.num_resent = 0

    def __len__(self) -> int:
        return len(self._open)

    def add(self, contribution: Contribution) -> None:
        self._open[(contribution.micro_batch_id, contribution.stage)] = contribution

    def holders(self) -> Set[Tuple[str, int]]:
        """(peer id, stage) of every replica holding an open contribution."""
        return {(item.peer_id, item.stage) for item in self._open.values()}

    def resolve(
        self,
        records: Mapping[str, ReplicaRecord],
        lost_s: Mapping[Tuple[str, int], float],
        members: Mapping[StepKey, Mapping[str, Optional[FrozenSet[str]]]],
    ) -> Resolution:
        """Commit what is confirmed; return (and keep open) what to re-send, and which steps to ask about.

        ``records``: peer id -> record of the current snapshot. ``lost_s``: (peer id, stage) ->
        seconds since that replica was last seen online at that stage (absent = 0). ``members``:
        (stage, step) -> {replica asked: the members it reported for that step, or None if it did not
        know the step}; a step missing here was not asked about yet."""
        resolution = Resolution()
        for key, item in list(self._open.items()):
            answers = members.get((item.stage, item.step))
            votes = None if answers is None else [None if m is None else item.peer_id in m for m in answers.values()]
            verdict = decide(
                item, records.get(item.peer_id), lost_s.get((item.peer_id, item.stage), 0.0), votes, self.policy
            )
            if verdict == "commit":
                del self._open[key]
                self.samples_committed[item.stage] = self.samples_committed.get(item.stage, 0) + item.samples
            elif verdict == "resend":
                resolution.resend.append(item)
            elif verdict == "ask":
                resolution.ask.add((item.stage, item.step))
        return resolution

    def all_held(self, records: Mapping[str, ReplicaRecord], clock_step: Optional[int] = None) -> bool:
        """Whether every open contribution sits in the step a live replica accumulates now, the replica not
        having adopted a state since it took it, and the step is still open on the clock stage (``clock_step``:
        the steps it has applied; None: unknown). Not one in a frozen step, nor in a step the clock already
        closed, which its stage will close next: that round may go on without the replica, which then drops
        what it held, so a trainer that is leaving waits until such a step is applied (commit) or dropped
        (re-send)."""
        return all(_held(item, records.get(item.peer_id), clock_step) for item in self._open.values())

    def resent(self, old: Contribution, peer_id: str, step: int, resets: int = 0) -> None:
        """Record that ``old`` now lives in ``peer_id``'s step ``step`` (taken at its ``resets``-th state)."""
        self.num_resent += 1
        old.peer_id, old.step, old.resets = peer_id, step, resets
        self.add(old)


def _held(item: Contribution, record: Optional[ReplicaRecord], clock_step: Optional[int]) -> bool:
    if record is None or record.state != "online" or record.stage != item.stage:
        return False
    still_open = clock_step is None or item.step >= clock_step
    return item.step == record.accum_step and record.resets == item.resets and still_open
