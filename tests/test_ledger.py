"""The trainer's exactly-once accounting: what is committed, what is re-sent, what is waited for or asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import pytest
import torch

from swarm.client.ledger import Contribution, Ledger, LedgerPolicy, decide, parse_step_members

POLICY = LedgerPolicy(peer_grace_s=5.0, lost_after_s=20.0)


@dataclass
class FakeRecord:
    """The part of a replica's record the ledger reads; ``contributed`` maps step -> own gradients included."""

    peer_id: str
    stage: int = 1
    state: str = "online"
    step: int = 3
    accum_step: int = 3
    samples_frozen: int = 0
    resets: int = 0
    reset_from: int = 0
    contributed: Dict[int, bool] = field(default_factory=dict)
    tentative: Tuple[int, ...] = ()

    def contributed_to(self, step: int) -> Optional[bool]:
        return None if step in self.tentative else self.contributed.get(step)

    def is_tentative(self, step: int) -> bool:
        return step in self.tentative


def record(peer_id: str, **kwargs) -> FakeRecord:
    return FakeRecord(peer_id, **kwargs)


def contribution(micro_batch_id: str, peer_id: str, step: int, stage: int = 1) -> Contribution:
    return Contribution(micro_batch_id, stage, peer_id, step, 8, torch.zeros(8, 4))


# ---- decide: one contribution of replica "a" at stage 1, step 2 ----

ITEM = contribution("m", "a", 2)


def test_the_holders_own_record_decides_first():
    assert decide(ITEM, record("a", contributed={2: True}), 0.0, None, POLICY) == "commit"
    assert decide(ITEM, record("a", contributed={2: False}), 0.0, None, POLICY) == "resend"
    # even a holder that is leaving by now, or whose peers would say otherwise
    assert decide(ITEM, record("a", state="leaving", contributed={2: True}), 0.0, [False, False], POLICY) == "commit"


def test_a_live_holder_that_has_not_applied_the_step_is_waited_for():
    assert decide(ITEM, record("a", step=2, accum_step=2), 0.0, None, POLICY) == "wait"
    assert decide(ITEM, record("a", step=1, accum_step=2, samples_frozen=8), 0.0, None, POLICY) == "wait"


def test_a_step_a_minority_of_the_stage_averaged_is_waited_for_while_its_holder_serves():
    tentative = record("a", contributed={2: True}, tentative=(2,))
    assert decide(ITEM, tentative, 0.0, None, POLICY) == "wait"
    assert decide(ITEM, tentative, 0.0, [False, False], POLICY) == "wait", "the majority's other lineage may yet win"
    # the holder confirmed it, or dropped it for the majority's state (then it says so)
    assert decide(ITEM, record("a", contributed={2: True}), 0.0, None, POLICY) == "commit"
    assert decide(ITEM, record("a", contributed={2: False}), 0.0, None, POLICY) == "resend"
    # a holder that leaves with a tentative step: its lineage leaves with it, the stage's replicas decide
    leaving = record("a", state="leaving", contributed={2: True}, tentative=(2,))
    assert decide(ITEM, leaving, 0.0, None, POLICY) == "ask"
    assert decide(ITEM, leaving, 0.0, [False, False], POLICY) == "resend"


def test_a_holder_that_adopted_a_state_since_is_believed_only_below_what_it_dropped():
    # "a" took the micro-batch into step 2 at its first state (resets 0), then adopted another state
    assert decide(ITEM, record("a", resets=1, reset_from=2, contributed={2: True}), 0.0, None, POLICY) == "resend"
    assert decide(ITEM, record("a", resets=1, reset_from=3, contributed={2: True}), 0.0, None, POLICY) == "commit"
    assert decide(ITEM, record("a", resets=1, reset_from=3, step=2, accum_step=2), 0.0, None, POLICY) == "wait"
    # two adoptions: what the first dropped is not known any more
    assert decide(ITEM, record("a", resets=2, reset_from=3, contributed={2: True}), 0.0, None, POLICY) == "resend"
    # the same step number on the new lineage says nothing of this micro-batch
    assert decide(ITEM, record("a", resets=1, reset_from=0, step=5, contributed={2: True}), 0.0, None, POLICY) == "resend"


def test_a_holder_missing_from_one_read_is_waited_for_until_its_grace_ends():
    assert decide(ITEM, None, 4.9, None, POLICY) == "wait"
    assert decide(ITEM, None, 5.0, None, POLICY) == "ask"


@pytest.mark.parametrize("holder", [None, record("a", state="leaving", step=2), record("a", stage=0, step=9)],
                         ids=["gone", "leaving", "moved"])
def test_a_holder_that_cannot_tell_is_settled_by_the_majority_of_replicas_that_know_the_step(holder):
    lost = 6.0
    assert decide(ITEM, holder, lost, None, POLICY) == "ask"
    assert decide(ITEM, holder, lost, [True, True, False], POLICY) == "commit"
    assert decide(ITEM, holder, lost, [True, None, None], POLICY) == "commit"  # those that do not know do not vote
    assert decide(ITEM, holder, lost, [False, False, True], POLICY) == "resend"
    assert decide(ITEM, holder, lost, [True, False], POLICY) == "wait"  # an even split: ask again later
    assert decide(ITEM, holder, lost, [None, None], POLICY) == "wait"  # nobody knows the step yet
    assert decide(ITEM, holder, lost, [], POLICY) == "wait"
    # gone long enough with nobody knowing its step: it died before the step closed
    assert decide(ITEM, holder, 20.0, [None, None], POLICY) == "resend"
    assert decide(ITEM, holder, 20.0, [], POLICY) == "resend"
    assert decide(ITEM, holder, 20.0, [True], POLICY) == "commit"


def test_a_live_holder_past_its_record_window_is_asked_about():
    holder = record("a", step=200, accum_step=200)  # applied step 2 long ago; its record no longer covers it
    assert decide(ITEM, holder, 0.0, None, POLICY) == "ask"
    assert decide(ITEM, holder, 0.0, [False, False, None], POLICY) == "resend"
    assert decide(ITEM, holder, 0.0, [None], POLICY) == "commit"  # online throughout: its own step had its gradients


def test_policy_validation():
    with pytest.raises(ValueError, match="peer_grace_s"):
        LedgerPolicy(peer_grace_s=10.0, lost_after_s=5.0)
    with pytest.raises(ValueError):
        LedgerPolicy(peer_grace_s=0.0)


# ---- the ledger over many contributions ----

def test_committed_when_the_holder_confirms_and_resent_when_it_applied_the_step_without_them():
    ledger = Ledger(POLICY)
    ledger.add(contribution("m1", "a", 2))
    ledger.add(contribution("m2", "b", 2))
    records = {"a": record("a", contributed={2: True}), "b": record("b", contributed={2: False})}
    resolution = ledger.resolve(records, {}, {})
    assert [c.micro_batch_id for c in resolution.resend] == ["m2"] and resolution.ask == set()
    assert ledger.samples_committed == {1: 8} and len(ledger) == 1


def test_a_gone_holder_is_asked_about_then_settled_by_the_answers():
    ledger = Ledger(POLICY)
    ledger.add(contribution("m1", "a", 2))
    ledger.add(contribution("m2", "a", 3))
    ledger.add(contribution("m3", "c", 2))
    records = {"b": record("b"), "c": record("c", step=2, accum_step=2)}
    assert ledger.resolve(records, {("a", 1): 1.0}, {}).ask == set()  # a lapsed record is not a death
    resolution = ledger.resolve(records, {("a", 1): 6.0}, {})
    assert resolution.ask == {(1, 2), (1, 3)} and resolution.resend == []
    members = {(1, 2): {"b": frozenset({"a", "b"}), "d": frozenset({"a", "b", "d"})},
               (1, 3): {"b": frozenset({"b"}), "d": None}}
    resolution = ledger.resolve(records, {("a", 1): 6.0}, members)
    assert [c.micro_batch_id for c in resolution.resend] == ["m2"]
    assert ledger.samples_committed == {1: 8} and len(ledger) == 2  # m1 committed, m3 still waits on c


def test_resent_items_are_tracked_and_holders_listed():
    ledger = Ledger(POLICY)
    ledger.add(contribution("m1", "a", 3))
    ledger.add(contribution("m2", "c", 3, stage=0))
    assert ledger.holders() == {("a", 1), ("c", 0)}
    item = ledger.resolve({"a": record("a", contributed={3: False}), "c": record("c", stage=0)}, {}, {}).resend[0]
    ledger.resent(item, "b", 4)
    assert ledger.num_resent == 1 and len(ledger) == 2 and ledger.holders() == {("b", 1), ("c", 0)}


def test_all_held_needs_every_item_in_the_step_a_live_replica_accumulates():
    ledger = Ledger(POLICY)
    ledger.add(contribution("m1", "a", 3))
    ledger.add(contribution("m2", "b", 2))
    assert not ledger.all_held({"a": record("a"), "b": record("b")})
    assert ledger.all_held({"a": record("a"), "b": record("b", step=1, accum_step=2)})
    # a frozen step's round may go on without its replica, which then drops what it froze
    assert not ledger.all_held({"a": record("a"), "b": record("b", step=2, accum_step=3, samples_frozen=8)})
    assert not ledger.all_held({"a": record("a"), "b": record("b", step=1, accum_step=2, resets=1)})  # dropped
    assert not ledger.all_held({"a": record("a")})
    assert not ledger.all_held({"a": record("a", state="leaving"), "b": record("b", step=1, accum_step=2)})
    # a step the clock stage already closed is closed next by its stage, maybe without the replica holding it
    assert ledger.all_held({"a": record("a"), "b": record("b", step=1, accum_step=2)}, clock_step=2)
    assert not ledger.all_held({"a": record("a"), "b": record("b", step=1, accum_step=2)}, clock_step=3)


def test_step_members_replies_are_checked():
    assert parse_step_members({"step": 4, "members": ["a", "b"]}, 4) == frozenset({"a", "b"})
    for reply, reason in [({"step": 5, "members": []}, "not 4"), ({"step": True, "members": []}, "not 4"),
                          ({"step": 4, "members": "ab"}, "list"), ({"step": 4, "members": [1]}, "strings"),
                          ({"step": 4, "members": ["x" * 200]}, "strings"), ([4], "not a map"),
                          ({"step": 4, "members": ["a"] * 5000}, "list")]:
        with pytest.raises(ValueError, match=reason):
            parse_step_members(reply, 4)


def test_real_peer_records_drive_the_ledger():
    from swarm.dht.records import PeerRecord, update_contributed

    base, bits = 0, 0
    for step, included in [(0, True), (1, False), (2, True)]:
        base, bits = update_contributed(base, bits, step, included)

    def peer(peer_id: str, step: int) -> PeerRecord:
        return PeerRecord(version=1, peer_id=peer_id, stage=1, state="online", throughput=1.0, queue_length=0,
                          step=step, accum_step=step, samples_pending=0, samples_applied=0,
                          contributed_base=base, contributed_bits=bits)

    ledger = Ledger(POLICY)
    for n in range(4):
        ledger.add(contribution(f"m{n}", "a", n))
    resolution = ledger.resolve({"a": peer("a", 3)}, {}, {})
    assert [c.micro_batch_id for c in resolution.resend] == ["m1"]
    assert ledger.samples_committed == {1: 16} and len(ledger) == 2  # m0 and m2 committed; m3 not applied yet
