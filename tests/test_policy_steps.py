"""The step protocol's pure decisions on hand-built stage views."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swarm.policy.steps import (
    DISTRUST_S, FIRST_STRIKE_S, ReplicaClaim, StageView, absent_claimants, clock_step, distrust_seconds, diverged, majority_state,
    must_wait, near_target, needs_resync, others_pending, overclaimers, stage_is_full, step_alone, step_is_due, rounds_before_stepping_alone, trusted_others, confirmed_below, majority_group, min_group_size, full_group_size, stage_mates,
    round_is_over, unborne_step_claims, NEAR_TARGET_S, near_threshold, seconds_between_reads,
    clock_hint_needs_read, FOLLOWER_READ_S, AVERAGING_READ_S,
)

TARGET = 100


def view(**overrides) -> StageView:
    base = StageView(peer_id="B", is_clock=True, target_batch_size=TARGET, step=3, accum_step=3, samples_pending=0,
                     samples_admitted=0, digest="d3", averaging=False)
    return replace(base, **overrides)


def claim(peer_id: str = "A", step: int = 3, accum_step: int = 3, pending: int = 0, admitted: int = 0,
          digest: str = "d3") -> ReplicaClaim:
    return ReplicaClaim(peer_id, step, accum_step, pending, admitted, digest)


def test_clock_closes_at_target_counting_other_replicas():
    assert not step_is_due(view(samples_pending=60))
    assert step_is_due(view(samples_pending=100))
    assert not step_is_due(view(samples_pending=60, others=(claim(pending=30),)))
    assert step_is_due(view(samples_pending=60, others=(claim(pending=40),)))
    # a claim for another accumulation step does not count towards ours
    assert not step_is_due(view(samples_pending=60, others=(claim(accum_step=2, step=2, pending=90),)))


def test_other_stages_follow_the_clock():
    stage0 = view(is_clock=False, samples_pending=5)
    assert not step_is_due(stage0)
    assert not step_is_due(replace(stage0, clock_steps=(3,)))
    assert step_is_due(replace(stage0, clock_steps=(4,)))


def test_a_frozen_replica_elsewhere_makes_the_step_due():
    # another replica froze our step and waits for us to average it
    assert step_is_due(view(is_clock=False, others=(claim(accum_step=4),)))


def test_backward_waits_while_averaging_and_on_a_full_clock():
    assert must_wait(view(averaging=True))
    assert not must_wait(view(averaging=True, overlap_averaging=True))
    assert must_wait(view(samples_pending=80, samples_admitted=20))
    assert not must_wait(view(is_clock=False, samples_pending=80, samples_admitted=20))
    assert stage_is_full(view(samples_pending=50, others=(claim(pending=50),)))
    assert near_target(view(samples_pending=50)) and not near_target(view(samples_pending=49))


def test_a_slow_stage_is_near_its_target_only_in_the_last_seconds_before_it():
    # target 100: at 2 samples/s, NEAR_TARGET_S seconds hold 10 samples, so near begins at 90, not at half
    slow = view(samples_per_s=2.0)
    assert near_threshold(slow) == TARGET - 2.0 * NEAR_TARGET_S
    assert not near_target(replace(slow, samples_pending=60)) and near_target(replace(slow, samples_pending=90))
    assert near_target(replace(slow, samples_pending=50, others=(claim(pending=40),)))  # the others' claims count
    # a fast stage (or one whose rate is not known, or is idle) is near from half its batch, as before
    for rate in (100.0, None, 0.0):
        assert near_threshold(view(samples_per_s=rate)) == TARGET / 2


def test_reads_slow_down_only_far_from_the_target_at_a_known_rate():
    poll, announce = 0.25, 60.0
    # unknown rate while the stage holds samples, or nearly full: every poll period
    assert seconds_between_reads(view(samples_pending=10), poll, announce) == poll
    assert seconds_between_reads(view(samples_pending=99, samples_per_s=2.0), poll, announce) == poll
    assert seconds_between_reads(view(samples_pending=100, samples_per_s=2.0), poll, announce) == poll
    # far from it: the others re-announce only every announce period, so that is the pace of reads
    assert seconds_between_reads(view(samples_pending=10, samples_per_s=2.0, others=(claim(),)), 0.25, 1.0) == 1.0
    assert seconds_between_reads(view(samples_pending=10, samples_per_s=0.0), poll, announce) == announce
    # but never past the moment the stage could come near: 40 samples short of half at 100 samples/s is 0.4 s
    assert seconds_between_reads(view(samples_pending=10, samples_per_s=100.0), poll, announce) == 0.4
    # a configuration whose poll period is not shorter keeps its poll period
    assert seconds_between_reads(view(samples_pending=10, samples_per_s=2.0), 2.0, 1.0) == 2.0


def test_an_idle_stage_reads_once_an_announce_period_until_work_arrives():
    poll, announce = 0.25, 60.0
    assert seconds_between_reads(view(), poll, announce) == announce
    # its own first backward, a mate that holds samples, or a mate that closed the step: reads resume
    assert seconds_between_reads(view(samples_admitted=8), poll, announce) == poll
    assert seconds_between_reads(view(others=(claim(pending=8),)), poll, announce) == poll
    assert seconds_between_reads(view(others=(claim(accum_step=4),)), poll, announce) == poll


def test_near_its_target_the_clock_reads_more_often_as_the_batch_fills():
    poll, announce = 0.25, 60.0
    # target 100 at 2 samples/s: 10 samples short is 5 s, read again after half of it; then closer together
    periods = [seconds_between_reads(view(samples_pending=held, samples_per_s=2.0), poll, announce)
               for held in (90, 95, 98, 99)]
    assert periods == [2.5, 1.25, 0.5, 0.25]
    # the others' claims count as held
    assert seconds_between_reads(view(samples_pending=45, samples_per_s=2.0, others=(claim(pending=45),)),
                                 poll, announce) == 2.5
    # a stage that is not the clock reads every FOLLOWER_READ_S near its step: the trainers' hints close it
    assert seconds_between_reads(view(is_clock=False, samples_pending=95, samples_per_s=2.0),
                                 poll, announce) == FOLLOWER_READ_S
    # while a step is averaged, reads only watch for the stage moving on without this replica
    assert seconds_between_reads(view(averaging=True, samples_per_s=2.0), poll, announce) == AVERAGING_READ_S


def test_a_trainers_hint_makes_a_stage_read_the_clock_once_and_closes_nothing_by_itself():
    stage0 = view(is_clock=False, samples_pending=5, clock_steps=(3, 3))
    assert clock_hint_needs_read(stage0, 4), "the clock put a micro-batch into step 4: our step 3 may be over"
    assert not clock_hint_needs_read(stage0, 3), "the clock is on our step: nothing new"
    assert not step_is_due(stage0), "the hint alone closes nothing: the clock's replicas must say so"
    # once the clock's replicas confirmed it, the step is due and no further read is needed
    assert step_is_due(replace(stage0, clock_steps=(4, 4))) and not clock_hint_needs_read(
        replace(stage0, clock_steps=(4, 4)), 4)
    # a mate that already closed the step makes it due without asking the clock
    assert not clock_hint_needs_read(replace(stage0, others=(claim(accum_step=4),)), 4)
    assert not clock_hint_needs_read(view(samples_pending=5), 4), "the clock stage takes no hints"


def test_reserved_share_for_a_replica_still_on_the_previous_step():
    lagging = claim(step=2, accum_step=2)
    # a lagging replica will accumulate for our step too: it reserves a fair share of the batch
    assert stage_is_full(view(samples_pending=50, others=(lagging,)))
    assert not stage_is_full(view(samples_pending=49, others=(lagging,)))


def test_divergence_gives_way_to_the_lower_peer_id():
    assert diverged(view(others=(claim(peer_id="A", digest="other"),)))
    assert not diverged(view(peer_id="A", others=(claim(peer_id="B", digest="other"),)))
    assert not diverged(view(averaging=True, others=(claim(peer_id="A", digest="other"),)))
    assert needs_resync(view(others=(claim(step=4, accum_step=4),)))
    assert not needs_resync(view(others=(claim(),)))


def test_a_replica_outside_the_stage_majority_gives_way():
    # it stepped alone on its own lineage: the majority is behind, but at a state this replica never had
    alone = view(step=6, accum_step=6, digest="x6", history=((3, "d3"), (4, "x4"), (5, "x5"), (6, "x6")),
                 others=(claim(peer_id="A", step=4, digest="d4"), claim(peer_id="C", step=4, digest="d4")))
    assert majority_state(alone) == (4, "d4") and needs_resync(alone)
    # the majority merely lags on this replica's own lineage: it will catch up
    ahead = view(step=5, accum_step=5, digest="d5", history=((3, "d3"), (4, "d4"), (5, "d5")),
                 others=(claim(peer_id="A", step=4, digest="d4"), claim(peer_id="C", step=4, digest="d4")))
    assert not needs_resync(ahead)
    # the majority itself does not resync towards the lone replica ahead of it
    majority = view(step=4, accum_step=4, digest="d4", history=((4, "d4"),),
                    others=(claim(peer_id="A", step=4, digest="d4"), claim(peer_id="Z", step=6, digest="x6")))
    assert not needs_resync(majority)
    # claims ignored for step closing still vote on the stage's state; banned replicas (left out of voters) do not
    hidden = replace(alone, others=(), voters=alone.others)
    assert needs_resync(hidden)
    assert not needs_resync(replace(alone, voters=()))


def test_a_lone_replica_steps_alone_after_failed_rounds():
    assert step_is_due(view(samples_pending=100, others=(claim(pending=0),)))  # a silent "replica" does not block closing
    assert not step_alone(failed_rounds=1, max_failed_rounds=2)
    assert step_alone(failed_rounds=2, max_failed_rounds=2)
    silent = view(others=(claim(peer_id="A"), claim(peer_id="C")))
    assert step_alone(2, 2, silent)


def test_a_replica_whose_state_the_majority_holds_tries_more_rounds_before_stepping_alone():
    # A, C and D froze the same step from the same state: a round without a group was a matchmaking miss
    same = view(others=(claim(peer_id="A"), claim(peer_id="C"), claim(peer_id="D")))
    assert rounds_before_stepping_alone(same, 2) == 4
    assert not step_alone(3, rounds_before_stepping_alone(same, 2), same)
    # they already failed to average a step alone with it: gone or stuck, one round is enough
    assert rounds_before_stepping_alone(same, 2, mates_silent=True) == 1
    # no majority holds its state (two of four went elsewhere), or it has no mates: the usual count
    split = view(others=(claim(peer_id="A"), claim(peer_id="C", digest="x3"), claim(peer_id="D", digest="y3")))
    assert rounds_before_stepping_alone(split, 2) == 2
    assert rounds_before_stepping_alone(view(), 2) == 2


def test_a_replica_the_stage_went_past_does_not_step_alone():
    # A averaged our frozen step 3 without us and applied it: our answer is its state, not a lineage of our own
    passed = view(others=(claim(peer_id="A", step=4, accum_step=4, digest="d4"),))
    assert not step_alone(5, 2, passed)
    assert needs_resync(passed)
    # A's claims ignored for a while: it still holds the stage's parameters, so rounds wait for it
    assert stage_mates(replace(passed, others=(), voters=passed.others)) == passed.others
    # a claim of a step far ahead that no state backs (no digest, so no resync follows) does not stall it
    liar = view(others=(claim(peer_id="A", step=10**6, accum_step=10**6, digest=""),))
    assert not needs_resync(liar) and step_alone(2, 2, liar)


def test_a_full_group_is_the_replica_and_every_mate_whose_state_counts():
    four = view(others=(claim(peer_id="A"), claim(peer_id="C"), claim(peer_id="D")))
    assert full_group_size(four) == 4
    # a mate whose announced state does not count (distrusted) is not waited for; one whose claims alone are
    # ignored still holds the stage's parameters and is
    assert full_group_size(replace(four, voters=four.others[:2])) == 3
    assert full_group_size(replace(four, others=four.others[:1], voters=four.others)) == 4
    for n in range(1, 9):  # the full group is never below the smallest group allowed
        stage = view(others=tuple(claim(peer_id=str(i)) for i in range(n)))
        assert full_group_size(stage) >= min_group_size(stage), n


def test_a_step_averaged_by_a_minority_of_the_stage_is_tentative_until_the_majority_holds_it():
    four = view(others=(claim(peer_id="A"), claim(peer_id="C"), claim(peer_id="D")))
    assert not majority_group(2, four), "2 of 4 replicas are no majority"
    assert majority_group(3, four)
    assert majority_group(1, view()), "the only replica is the whole stage"
    # rounds form majority groups only: 4 replicas are never split into two pairs
    assert [min_group_size(view(others=tuple(claim(peer_id=str(i)) for i in range(n)))) for n in (1, 2, 3, 4)] == [2, 2, 3, 3]
    # B stepped 3 -> 4 with a minority; the others still hold step 3 of the same lineage: nothing confirmed yet
    ahead = replace(four, step=4, accum_step=4, digest="d4", history=((3, "d3"),))
    assert confirmed_below(ahead) == 3, "the majority lags on our lineage: steps below 3 are on it"
    # the majority caught up with B's state: step 3 is confirmed
    caught_up = replace(ahead, others=tuple(replace(c, step=4, accum_step=4, digest="d4") for c in four.others))
    assert confirmed_below(caught_up) == 4
    # the majority went on another lineage at step 4: nothing of B's is confirmed (it will resync)
    elsewhere = replace(ahead, others=tuple(replace(c, step=4, accum_step=4, digest="e4") for c in four.others))
    assert confirmed_below(elsewhere) == 0 and needs_resync(elsewhere)
    # no majority: 2 and 2
    split = replace(ahead, others=(claim(peer_id="A", step=4, digest="d4"), claim(peer_id="C", step=4, digest="e4"),
                                   claim(peer_id="D", step=4, digest="e4")))
    assert confirmed_below(split) == 0


def test_claims_are_capped_and_liars_are_found_and_ignored():
    liar = claim(peer_id="L", pending=10**9)
    # with one other replica a claim counts at most twice its fair share: the whole batch, never more
    assert others_pending(view(others=(liar,))) == TARGET
    honest = claim(peer_id="H", pending=10)
    capped = others_pending(view(others=(liar, honest)))
    assert capped == int(2 * TARGET / 3) + 10
    assert overclaimers({"L": 10**9, "H": 10}, {"L": 8, "H": 12, "B": 40}) == {"L"}
    assert overclaimers({"L": 80}, {"L": 30}) == {"L"}
    # a replica that claimed and stayed out of the group may have been slow: a failure, not a proven lie
    assert overclaimers({"L": 10**9, "H": 10}, {"H": 12, "B": 40}) == set()
    assert absent_claimants({"L": 10**9, "H": 10, "Z": 0}, {"H": 12, "B": 40}) == {"L"}
    assert overclaimers({"H": 80}, {"H": 80}) == set()
    assert trusted_others((liar, honest), {"L"}) == (honest,)
    # once ignored, the liar no longer makes the clock close early
    assert not step_is_due(view(samples_pending=10, others=trusted_others((liar, honest), {"L"})))


def test_clock_step_is_an_upper_median():
    assert clock_step([7]) == 7
    assert clock_step([7, 8]) == 8
    assert clock_step([7, 7, 10**9]) == 7  # one replica announcing a far step does not move the others
    assert clock_step([7, 8, 8]) == 8


def test_a_failure_an_honest_replica_can_cause_costs_less_distrust_than_a_proven_lie():
    assert distrust_seconds(None) == DISTRUST_S
    assert distrust_seconds(1) == FIRST_STRIKE_S < DISTRUST_S
    # each failure in a row doubles the time, up to the liar's
    assert [distrust_seconds(n, limit=100.0, first=10.0) for n in (1, 2, 3, 4, 5)] == [10.0, 20.0, 40.0, 80.0, 100.0]
    assert distrust_seconds(50) == DISTRUST_S


def test_a_download_that_falls_short_proves_only_its_own_source_wrong():
    """Replicas announced steps 5 and 6; the state this replica adopted is at step 5. Served by the step-6
    claimant itself, that claim was a lie; served by another replica (or by hivemind's downloader, which does
    not say whom), the step-6 replica may well hold step 6: a failure, not a lie."""
    ahead = {"A": 5, "C": 6, "D": 6}
    assert unborne_step_claims(ahead, reached=5, delivered=True, source="C") == ({"C"}, {"D"})
    assert unborne_step_claims(ahead, reached=5, delivered=True, source="A") == (set(), {"C", "D"})
    assert unborne_step_claims(ahead, reached=5, delivered=True, source=None) == (set(), {"C", "D"})
    assert unborne_step_claims(ahead, reached=6, delivered=True, source="C") == (set(), set())  # borne out
    # nothing delivered: every claim ahead is unconfirmed, whoever was asked
    assert unborne_step_claims(ahead, reached=4, delivered=False, source="C") == (set(), {"A", "C", "D"})
    # ...but a replica whose state had passed its announced step when it served it bore its claim out
    assert unborne_step_claims(ahead, reached=4, delivered=False, source=None, moved_on={"A", "C"}) == (set(), {"D"})


def test_a_round_is_over_once_a_majority_holds_a_later_state():
    """The replica averages step 3 (it holds state 3)."""
    moved = claim("A", step=4, accum_step=4, digest="d4"), claim("C", step=4, accum_step=4, digest="d4")
    assert round_is_over(view(others=moved)), "both mates applied step 3: 2 of the stage's 3"
    assert round_is_over(view(others=(*moved, claim("D", step=4, accum_step=4, digest="d4"), claim("E"))))
    assert not round_is_over(view(others=(*moved, claim("D")))), "2 of 4 is no majority"
    assert not round_is_over(view(others=(moved[0], claim("C")))), "one mate ahead is no majority"
    assert not round_is_over(view(others=(claim("A"), claim("C")))), "the majority averages our step with us"
    # a lone replica claiming to be far ahead makes no majority, so it cannot make others give up their rounds
    assert not round_is_over(view(others=(claim("A", step=90, accum_step=90, digest="d90"), claim("C"))))
    # mates whose announced state does not count (voters) do not make a majority either
    assert not round_is_over(view(others=moved, voters=(claim("C"),)))


def test_a_replica_measures_its_stages_rate_from_the_growth_of_the_stages_pending_samples(monkeypatch):
    from swarm.server import steps

    coordinator = steps.StepCoordinator(peer=None)
    clock = iter([10.0, 11.0, 12.0, 12.5, 14.0])
    monkeypatch.setattr(steps.time, "monotonic", lambda: next(clock))
    coordinator._measure_rate(view(samples_pending=10, others=(claim(pending=10),)))
    assert coordinator.samples_per_s is None, "one read gives no rate"
    coordinator._measure_rate(view(samples_pending=20, others=(claim(pending=20),)))
    assert coordinator.samples_per_s == 20.0  # 20 -> 40 samples in a second
    coordinator._measure_rate(view(samples_pending=20, others=(claim(pending=30),)))
    assert coordinator.samples_per_s == 15.0  # 10/s, weighed with the previous estimate
    coordinator._measure_rate(view(step=4, accum_step=4, samples_pending=5))
    assert coordinator.samples_per_s == 15.0, "a read after the step closed starts over"
    coordinator._measure_rate(view(step=4, accum_step=4, samples_pending=5))
    assert coordinator.samples_per_s == 7.5  # an idle stage's rate falls towards 0


def test_watchers_ask_the_clock_less_often_only_when_its_replicas_would_take_more_than_their_share():
    from swarm.policy.steps import CLOCK_CALLS_PER_POLL, clock_watch_period_s

    poll = 0.25
    assert clock_watch_period_s(2, 2, poll) == poll  # 2 watchers x 2 asked / 2 replicas: 2 calls a poll each
    assert clock_watch_period_s(8, 125, poll) == poll  # 1,000 peers of 8 stages
    assert clock_watch_period_s(1, 4, poll) == poll and clock_watch_period_s(64, 0, poll) == poll
    many = clock_watch_period_s(64, 16, poll)  # 1,000 peers of 64 stages: 63 x 2 x 3 / 16 calls a poll each
    assert many == pytest.approx(poll * 63 * 2 * 3 / 16 / CLOCK_CALLS_PER_POLL)
    assert clock_watch_period_s(64, 157, poll) < many  # more clock replicas share the calls
