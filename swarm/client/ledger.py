"""Exactly-once accounting of gradient contributions, kept by each trainer.

A backward pass accumulates a micro-batch's gradient into one replica's *pending* global
step. If that replica dies, or its all-reduce round goes on without it, the gradient is gone
and the samples would silently vanish from training. The trainer therefore keeps, for every
(micro-batch, stage), what it needs to redo that backward pass (the stage input, the output
gradient, the targets) until the stage confirms the step that applied it.

Confirmation comes from the DHT: each replica announces, for recent steps, which peers'
gradients that step averaged (``PeerRecord.contributors``). For a contribution made to
replica P in step s:
- some live replica lists step s: committed if P is among its contributors, re-sent if not;
- P is gone (its record has been missing for a grace period, so that one failed or partial
  DHT read does not look like a death) or is leaving, and nobody lists step s: re-sent (P can no
  longer take part in averaging step s; a leaving peer announces 'leaving' only after its last
  round, so it cannot be mid-round);
- otherwise: wait.
A re-sent contribution goes to any live replica of the stage, which adds it to its current
step; replicas ignore a micro-batch id already in their current or frozen step. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from swarm.records import PeerRecord

__all__ = ["Contribution", "Ledger"]


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


class Ledger:
    """Contributions not yet confirmed by a completed global step."""

    def __init__(self) -> None:
        self._open: Dict[Tuple[str, int], Contribution] = {}
        self.samples_committed: Dict[int, int] = {}
        self.num_resent = 0

    def __len__(self) -> int:
        return len(self._open)

    def add(self, contribution: Contribution) -> None:
        self._open[(contribution.micro_batch_id, contribution.stage)] = contribution

    def open_contributions(self) -> List[Contribution]:
        return list(self._open.values())

    def resolve(self, records: Mapping[str, PeerRecord], gone: Collection[str]) -> List[Contribution]:
        """Commit what the DHT confirms; return (and keep open) the contributions to re-send.

        ``gone``: peers whose records have been missing long enough to call them dead; a holder
        merely absent from this one snapshot is waited for."""
        steps_seen = _contributors_by_stage_and_step(records.values())
        to_resend = []
        for key, item in list(self._open.items()):
            members = steps_seen.get((item.stage, item.step))
            if members is not None:
                if item.peer_id in members:
                    del self._open[key]
                    self.samples_committed[item.stage] = self.samples_committed.get(item.stage, 0) + item.samples
                else:
                    to_resend.append(item)
                continue
            holder = records.get(item.peer_id)
            if holder is None:
                if item.peer_id in gone:
                    to_resend.append(item)
            elif holder.state == "leaving" or holder.stage != item.stage:
                to_resend.append(item)
        return to_resend

    def all_held(self, records: Mapping[str, PeerRecord]) -> bool:
        """Whether every open contribution sits in a live replica's current or frozen step."""
        return all(_held(item, records.get(item.peer_id)) for item in self._open.values())

    def resent(self, old: Contribution, peer_id: str, step: int) -> None:
        """Record that ``old`` now lives in ``peer_id``'s step ``step``."""
        self.num_resent += 1
        old.peer_id, old.step = peer_id, step
        self.add(old)


def _contributors_by_stage_and_step(records: Iterable[PeerRecord]) -> Dict[Tuple[int, int], set]:
    seen: Dict[Tuple[int, int], set] = {}
    for record in records:
        for step, members in record.contributors.items():
            seen.setdefault((record.stage, int(step)), set()).update(members)
    return seen



def _held(item: Contribution, record: Optional[PeerRecord]) -> bool:
    if record is None or record.state != "online" or record.stage != item.stage:
        return False
    return item.step == record.accum_step or (record.samples_frozen > 0 and item.step == record.accum_step - 1)
