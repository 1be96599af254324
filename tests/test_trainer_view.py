"""What a trainer knows of the swarm between its DHT reads: a few stages read a refresh (the failed ones first),
the records of the others held past their expiry, and the ledger fields its backward replies carry laid over them,
so that its ledger commits without waiting for a stage to be read again."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from swarm.client.ledger import Contribution, Ledger, LedgerPolicy
from swarm.client.trainer import Trainer
from swarm.client.view import held_records, with_replies
from swarm.config.settings import RunConfig, TrainerConfig
from swarm.dht.manifest import run_hash
from swarm.dht.ledger_fields import LEDGER_FIELDS, ledger_fields_of, ledger_order, newest, with_ledger_fields
from swarm.dht.records import PeerRecord, update_contributed
from swarm.model.gpt import ModelConfig
from swarm.policy.directory import stages_to_read

RUN = RunConfig(run_id="view", num_stages=16, model=ModelConfig(num_layers=16, hidden_size=8, num_heads=2))


def peer(peer_id: str, stage: int, step: int = 0, contributed: Sequence[int] = (), **fields) -> PeerRecord:
    """A replica's record at ``step``, its own gradients in the applied steps ``contributed``."""
    base, bits = 0, 0
    for applied in range(step):
        base, bits = update_contributed(base, bits, applied, applied in contributed)
    values = dict(version=1, peer_id=peer_id, stage=stage, state="online", throughput=1.0, queue_length=0, step=step,
                  accum_step=step, samples_pending=0, samples_applied=0, contributed_base=base, contributed_bits=bits,
                  run_hash=run_hash(RUN))
    return PeerRecord(**{**values, **fields})


# ---- which stages a refresh reads ----

def test_a_refresh_reads_the_failed_stages_then_those_read_longest_ago():
    read_at = [10.0 * stage for stage in range(16)]
    assert stages_to_read(read_at, 4) == [0, 1, 2, 3]
    assert stages_to_read(read_at, 4, urgent={9}) == [0, 1, 2, 9]
    assert stages_to_read(read_at, 2, urgent={9, 12, 15}) == [9, 12, 15], "every failed stage, past the bound"
    assert stages_to_read(read_at, 40) == list(range(16))
    assert stages_to_read(read_at, 4, urgent={99, -1}) == [0, 1, 2, 3], "stages that do not exist are not read"
    with pytest.raises(ValueError, match="max_stages"):
        stages_to_read(read_at, 0)


def test_round_robin_reads_every_stage_once_in_ceil_stages_over_the_bound_refreshes():
    read_at: List[float] = [-math.inf] * 64
    seen: List[int] = []
    for now in range(8):
        chosen = stages_to_read(read_at, 8)
        seen += chosen
        for stage in chosen:
            read_at[stage] = float(now)
    assert sorted(seen) == list(range(64))


# ---- ledger fields on replies ----

def test_a_reply_carries_the_fields_the_ledger_reads_checked_like_a_record():
    record = peer("a", 1, step=3, contributed=[1, 2])
    assert set(ledger_fields_of(record)) == set(LEDGER_FIELDS)
    later = ledger_fields_of(peer("a", 1, step=5, contributed=[1, 2, 4]))
    merged = with_ledger_fields(record, later)
    assert merged.step == 5 and merged.contributed_to(4) is True and merged.contributed_to(3) is False
    assert merged.throughput == record.throughput and merged.peer_id == "a", "only the ledger's fields change"
    for bad in ({**later, "step": -1}, {**later, "state": "asleep"}, {k: v for k, v in later.items() if k != "step"},
                {**later, "extra": 1}, [1, 2, 3], None, {**later, "contributed_bits": 2**64}):
        with pytest.raises(ValueError):
            with_ledger_fields(record, bad)


def test_the_newer_of_a_record_and_a_reply_wins():
    old, new = peer("a", 1, step=3), peer("a", 1, step=4)
    assert newest(old, ledger_fields_of(new)).step == 4
    assert newest(new, ledger_fields_of(old)).step == 4, "an older reply does not take the record back"
    adopted = ledger_fields_of(peer("a", 1, step=2, resets=1, reset_from=2))
    assert newest(new, adopted).step == 2, "a state adopted since is newer whatever its step"
    # a tentative step confirmed changes nothing else: the confirmation is the newer
    tentative = peer("a", 1, step=4, contributed=[3], tentative_bits=1)
    assert ledger_order(ledger_fields_of(new)) > ledger_order(ledger_fields_of(tentative))
    assert newest(tentative, ledger_fields_of(new)).is_tentative(3) is False


# ---- records held between reads ----

def test_records_of_unread_stages_are_held_and_read_stages_replace_theirs():
    previous = {"a": peer("a", 0), "b": peer("b", 1), "c": peer("c", 1), "d": peer("d", 2)}
    fresh = {"c": peer("c", 0, step=1), "e": peer("e", 0)}  # stage 0 read: a is gone, c moved there, e joined
    held = held_records(previous, fresh, read=[0])
    assert set(held) == {"b", "c", "d", "e"}
    assert held["c"].stage == 0 and held["b"] is previous["b"] and held["d"] is previous["d"]


def test_a_reply_is_laid_over_the_record_of_the_stage_it_was_for_only():
    records = {"a": peer("a", 1, step=2), "b": peer("b", 1, step=2)}
    replied = {"a": (1, ledger_fields_of(peer("a", 1, step=3))), "b": (0, ledger_fields_of(peer("b", 0, step=9)))}
    merged = with_replies(records, replied)
    assert merged["a"].step == 3 and merged["b"] is records["b"]


def test_a_contribution_commits_from_the_replies_before_any_record_says_so():
    ledger = Ledger(LedgerPolicy(peer_grace_s=5.0, lost_after_s=20.0))
    ledger.add(Contribution("m", 1, "a", 2, 8, torch.zeros(8, 4)))
    announced = {"a": peer("a", 1, step=2)}  # read before step 2 was applied
    assert ledger.resolve(announced, {}, {}).resend == [] and len(ledger) == 1
    replied = {"a": (1, ledger_fields_of(peer("a", 1, step=3, contributed=[2])))}
    ledger.resolve(with_replies(announced, replied), {}, {})
    assert len(ledger) == 0 and ledger.samples_committed == {1: 8}


# ---- the trainer ----

class _Directory:
    """A directory of fixed records that, like the live one, forgets the records of stages it did not read lately:
    here, every stage not read in the latest read."""

    def __init__(self, by_stage: Dict[int, Dict[str, PeerRecord]], num_stages: int):
        self.by_stage = by_stage
        self.stages = [SimpleNamespace(read_at=-math.inf) for _ in range(num_stages)]
        self.reads: List[List[int]] = []

    async def read(self, stages: Optional[Sequence[int]] = None, timeout: float = 5.0, strict: bool = False) -> bool:
        stages = list(range(len(self.stages))) if stages is None else list(stages)
        self.reads.append(stages)
        for stage in stages:
            self.stages[stage].read_at = time.monotonic()
        return True

    def records(self) -> Dict[str, PeerRecord]:
        return {pid: r for stage in self.reads[-1] for pid, r in self.by_stage.get(stage, {}).items()}


def _trainer(by_stage: Dict[int, Dict[str, PeerRecord]]) -> Trainer:
    config = TrainerConfig(run=RUN, stages_per_refresh=4)
    trainer = Trainer(config, dht=SimpleNamespace(peer_id="trainer"), corpus=object())
    trainer.directory = _Directory(by_stage, RUN.num_stages)  # type: ignore[assignment]
    return trainer


async def test_the_trainer_reads_a_few_stages_a_refresh_holds_the_rest_and_commits_from_replies():
    by_stage = {stage: {f"p{stage}": peer(f"p{stage}", stage)} for stage in range(16)}
    trainer = _trainer(by_stage)
    await trainer.refresh(list(range(16)))  # the start reads every stage
    assert len(trainer.records) == 16
    await trainer.refresh()
    assert trainer.directory.reads[-1] == [0, 1, 2, 3]
    assert len(trainer.records) == 16, "the records of the 12 stages not read are held"
    trainer._on_stale(9)  # a call at stage 9 failed
    await trainer.refresh()
    assert trainer.directory.reads[-1] == [4, 5, 6, 9]
    # a contribution at stage 12, step 0, committed by the replica's next reply: no read of stage 12 needed
    trainer.ledger.add(Contribution("m", 12, "p12", 0, 8, torch.zeros(8, 4)))
    trainer._on_ledger_fields("p12", 12, ledger_fields_of(peer("p12", 12, step=1, contributed=[0])))
    trainer._on_ledger_fields("p12", 12, ledger_fields_of(peer("p12", 12, step=0)))  # an older reply, arrived late
    trainer._on_ledger_fields("p12", 12, {"step": "x"})  # malformed: ignored
    trainer._update_view(time.monotonic())
    assert trainer.records["p12"].step == 1
    assert len(trainer.ledger) == 0 and trainer.ledger.samples_committed == {12: 8}
    # a record read again replaces a held one; a reply for another stage than the record's is not laid over
    trainer._on_ledger_fields("p3", 5, ledger_fields_of(peer("p3", 5, step=7)))
    await trainer.refresh([3])
    assert trainer.records["p3"].step == 0


async def test_a_trainer_held_by_its_ledger_bound_says_why(caplog):
    config = TrainerConfig(run=RUN, max_uncommitted=1)
    trainer = Trainer(config, dht=SimpleNamespace(peer_id="trainer"), corpus=object())
    for stage in range(RUN.num_stages):  # one micro-batch's contributions at every stage: the bound
        trainer.ledger.add(Contribution("m", stage, f"p{stage}", 0, 8, torch.zeros(8, 4)))
    with caplog.at_level("WARNING"):
        await trainer._wait_for_commits(time.monotonic() + 0.2)
    warnings = [r.getMessage() for r in caplog.records if "waiting for global steps" in r.getMessage()]
    assert len(warnings) == 1 and "max_uncommitted" in warnings[0]
