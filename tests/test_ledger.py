"""The trainer's exactly-once accounting: what is committed, what is re-sent, what is waited for."""

from __future__ import annotations

import torch

from swarm.client.ledger import Contribution, Ledger
from swarm.records import PeerRecord


def record(peer_id: str, stage: int = 1, step: int = 3, accum_step: int = 3, state: str = "online",
           contributors=None, frozen: int = 0) -> PeerRecord:
    return PeerRecord(version=1, peer_id=peer_id, stage=stage, state=state, throughput=1.0, queue_length=0,
                      step=step, accum_step=accum_step, samples_pending=0, samples_frozen=frozen, samples_applied=0,
                      contributors=contributors or {})


def contribution(micro_batch_id: str, peer_id: str, step: int, stage: int = 1) -> Contribution:
    return Contribution(micro_batch_id, stage, peer_id, step, 8, torch.zeros(8, 4))


def test_committed_when_the_step_lists_the_holder_and_resent_when_it_does_not():
    ledger = Ledger()
    ledger.add(contribution("m1", "a", 2))
    ledger.add(contribution("m2", "b", 2))
    records = {"a": record("a", contributors={2: ["a"]}), "b": record("b")}
    resend = ledger.resolve(records, gone=set())
    assert [c.micro_batch_id for c in resend] == ["m2"]  # step 2 went on without b: its gradient is lost
    assert ledger.samples_committed == {1: 8} and len(ledger) == 1


def test_a_holder_missing_from_one_read_is_waited_for_until_it_is_gone():
    ledger = Ledger()
    ledger.add(contribution("m1", "a", 3))
    assert ledger.resolve({"b": record("b")}, gone=set()) == []  # a lapsed record is not a death
    assert [c.micro_batch_id for c in ledger.resolve({"b": record("b")}, gone={"a"})] == ["m1"]


def test_leaving_or_moved_holders_are_resent_and_resent_items_are_tracked():
    ledger = Ledger()
    ledger.add(contribution("m1", "a", 3))
    ledger.add(contribution("m2", "c", 3))
    records = {"a": record("a", state="leaving"), "c": record("c", stage=0)}
    resend = ledger.resolve(records, gone=set())
    assert sorted(c.micro_batch_id for c in resend) == ["m1", "m2"]
    ledger.resent(resend[0], "b", 4)
    assert ledger.num_resent == 1 and len(ledger) == 2


def test_all_held_needs_every_item_in_a_live_current_or_frozen_step():
    ledger = Ledger()
    ledger.add(contribution("m1", "a", 3))
    ledger.add(contribution("m2", "b", 2))
    assert not ledger.all_held({"a": record("a"), "b": record("b")})
    assert ledger.all_held({"a": record("a"), "b": record("b", step=2, accum_step=3, frozen=8)})
    assert not ledger.all_held({"a": record("a")})
