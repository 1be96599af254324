"""The global-step protocol of one stage, as pure decisions over a snapshot of its replicas.

Every replica of a stage accumulates gradients for its *accumulation step*; the last stage is the
swarm's clock: its replicas close step s once together they hold the global batch, and every other
stage closes its own step s as soon as the clock has finished s. Closing a step freezes the
accumulated gradients, averages them with the other replicas and applies the average.

What the other replicas announce is a claim, not a fact: a record can be stale, wrong or a lie. So
- a replica claiming a higher step is believed only until a state download fails to deliver it
  (the caller then lists it in ``distrusted``, and it is ignored; for long only if the state it served
  itself fell short of its claim, :func:`unborne_step_claims`);
- a replica's claimed pending samples count at most what the stage could plausibly hold for it, and
  a replica whose claim was not borne out by the step's all-reduce (:func:`overclaimers`) is
  distrusted for a while, one that stayed out of it (:func:`absent_claimants`) briefly;
- a failure an honest replica can cause too (it did not average, a download from it failed) costs
  it a short, escalating distrust (:func:`distrust_seconds`), a proven lie the full one;
- averaging a step needs nobody in particular: after ``max_failed_rounds`` rounds without a group,
  a replica applies the step alone (:func:`step_alone`), so a replica that announces itself online
  but never averages cannot stall the stage.

The live peer (:mod:`swarm.server.steps`) builds :class:`StageView` from its runner and the DHT;
the simulator can build it from its own state. No clocks, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections import Counter
from typing import Collection, Mapping, Optional, Sequence, Set, Tuple

__all__ = [
    "ReplicaClaim",
    "StageView",
    "trusted_others",
    "majority_state",
    "needs_resync",
    "diverged",
    "others_reserved",
    "others_pending",
    "near_target",
    "stage_is_full",
    "must_wait",
    "step_is_due",
    "step_alone",
    "overclaimers",
    "absent_claimants",
    "rounds_before_stepping_alone",
    "clock_step",
    "stage_mates",
    "min_group_size",
    "full_group_size",
    "majority_group",
    "confirmed_below",
    "distrust_seconds",
    "unborne_step_claims",
    "round_is_over",
    "near_threshold",
    "seconds_between_reads",
    "clock_hint_needs_read",
    "clock_watch_period_s",
    "CLOCK_ASKED",
    "CLOCK_WATCHERS",
    "CLOCK_CALLS_PER_POLL",
    "MAX_CLAIM_SHARE",
    "DISTRUST_S",
    "FIRST_STRIKE_S",
    "NEAR_TARGET_S",
    "FOLLOWER_READ_S",
    "CLOCK_WATCH_S",
    "AVERAGING_READ_S",
    "APPROACH_SHARE",
]

# a replica's claimed pending samples count at most this multiple of its fair share of the global batch
MAX_CLAIM_SHARE = 2.0
DISTRUST_S = 120.0  # seconds a replica's claims are ignored once they proved false
FIRST_STRIKE_S = 15.0  # seconds for a first failure that an honest replica can cause too
NEAR_TARGET_S = 5.0  # a stage that reaches its global batch within this many seconds at its rate is near it
# seconds between reads of a stage other than the clock near its step: the trainers' backward calls tell it when the
# clock moved on (clock_hint_needs_read), so its own reads only cover a replica that no trainer calls
FOLLOWER_READ_S = 1.0
# seconds between a clock watcher's own reads of the clock stage, at least (clock_watch_period_s): the trainers' hints
# close the steps; these reads cover a stage whose replicas no trainer's backward reaches with news
CLOCK_WATCH_S = 5.0
AVERAGING_READ_S = 1.0  # seconds between reads while a step is averaged (to notice the stage moved on without us)
# near its target, the clock stage reads again once this share of the time it needs to fill the batch has passed
APPROACH_SHARE = 0.5
CLOCK_WATCHERS = 2  # replicas of each other stage that ask the clock stage for its step (the watchers)
CLOCK_ASKED = 3  # replicas of the clock stage a watcher asks per read at most (its view of the clock's step)
# progress calls one clock replica takes from the other stages' watchers per poll period, on average, at most
CLOCK_CALLS_PER_POLL = 2.0


@dataclass(frozen=True)
class ReplicaClaim:
    """What another replica of the stage announces (its DHT record, reduced to what steps need)."""

    peer_id: str
    step: int  # global steps applied to its parameters
    accum_step: int  # the step it accumulates into now
    samples_pending: int = 0  # samples accumulated for accum_step
    samples_admitted: int = 0  # samples of backward passes under way
    digest: str = ""  # hash of its parameters at `step`


@dataclass(frozen=True)
class StageView:
    """One replica's view of its stage at one moment."""

    peer_id: str
    is_clock: bool  # this stage is the last one: it decides when steps close
    target_batch_size: int
    step: int
    accum_step: int
    samples_pending: int  # accumulated locally for accum_step
    samples_admitted: int  # local backward passes admitted but not accumulated yet
    digest: str
    averaging: bool  # a frozen step is being averaged now
    others: Tuple[ReplicaClaim, ...] = ()  # the other online replicas of the stage (trusted ones only)
    # the steps the clock stage's online or leaving replicas accumulate for (a replica that froze step s is on s + 1)
    clock_steps: Tuple[int, ...] = ()
    overlap_averaging: bool = False
    # the other online replicas whose announced state counts (all but the banned and those that served a false
    # state); None = ``others``. Wider than ``others``: a replica whose claims about pending work are ignored
    # for a while still holds the stage's parameters
    voters: Optional[Tuple[ReplicaClaim, ...]] = None
    history: Tuple[Tuple[int, str], ...] = ()  # (step, digest) this replica's parameters had at recent steps
    # samples/s the whole stage accumulates, as this replica last observed it; None = not known yet
    samples_per_s: Optional[float] = None


def trusted_others(claims: Sequence[ReplicaClaim], distrusted: Collection[str]) -> Tuple[ReplicaClaim, ...]:
    """The claims a replica acts on: everyone's but those of replicas caught lying."""
    return tuple(claim for claim in claims if claim.peer_id not in distrusted)


def majority_state(view: StageView) -> Optional[Tuple[int, str]]:
    """The (step, digest) that a strict majority of the stage's replicas announce, this one included; None
    if there is none. Replicas that announce no digest yet do not vote."""
    voters = view.others if view.voters is None else view.voters
    votes = Counter((claim.step, claim.digest) for claim in voters if claim.digest)
    if view.digest:
        votes[(view.step, view.digest)] += 1
    total = sum(votes.values())
    found = [key for key, count in votes.items() if 2 * count > total]
    return found[0] if found else None


def needs_resync(view: StageView) -> bool:
    """Whether to download the stage's state.

    When a strict majority of the stage (this replica included) holds one state, a replica that does not
    hold it gives way, unless the majority merely lags on this replica's own lineage (it had that state
    at that step and moved on). A majority that is behind on another lineage wins too: a replica that
    stepped alone while the others averaged returns to them instead of training on its own. Without a
    majority: resync when another replica is ahead, or when we diverged at one step (:func:`diverged`)."""
    majority = majority_state(view)
    if majority is not None:
        if majority == (view.step, view.digest):
            return False
        step, _ = majority
        return step > view.step or majority not in view.history
    return any(claim.step > view.step for claim in view.others) or diverged(view)


def confirmed_below(view: StageView) -> int:
    """Steps below this one are on the lineage a strict majority of the stage holds: the majority holds
    this replica's state, or a state this replica held at that step (it lags on this lineage). 0 when
    there is no majority or it holds another lineage."""
    majority = majority_state(view)
    if majority is None:
        return 0
    if majority == (view.step, view.digest):
        return view.step
    return majority[0] if majority in view.history else 0


def diverged(view: StageView) -> bool:
    """Same step, different parameters: the replica with the higher peer id gives way."""
    if view.averaging:
        return False
    return any(
        claim.step == view.step and claim.digest and claim.digest != view.digest and claim.peer_id < view.peer_id
        for claim in view.others
    )


def _claim_cap(view: StageView) -> float:
    return MAX_CLAIM_SHARE * view.target_batch_size / (len(view.others) + 1)


def others_pending(view: StageView) -> int:
    """Samples the other replicas hold for our accumulation step, each claim capped at its plausible share."""
    cap = _claim_cap(view)
    return int(sum(min(claim.samples_pending, cap) for claim in view.others if claim.accum_step == view.accum_step))


def others_reserved(view: StageView) -> float:
    """What the other replicas hold or are about to hold for our step: their pending and admitted samples,
    and a fair share for replicas whose record still shows an older step (they will accumulate for it too)."""
    cap, share = _claim_cap(view), view.target_batch_size / (len(view.others) + 1)
    reserved = 0.0
    for claim in view.others:
        if claim.accum_step == view.accum_step:
            reserved += min(claim.samples_pending + claim.samples_admitted, cap)
        elif claim.accum_step < view.accum_step:
            reserved += share
    return reserved


def _held(view: StageView) -> float:
    return view.samples_pending + view.samples_admitted + others_reserved(view)


def near_threshold(view: StageView) -> float:
    """The samples the stage holds (this replica's pending and admitted, the others' reserved) from which it is
    near its global step: half the global batch; and once the stage's rate is known, no earlier than
    :data:`NEAR_TARGET_S` seconds of that rate before the target. Near a step replicas announce and read
    many times a second, so that the step closes on target: on a stage whose steps take minutes that pace
    over the whole second half of every step would be most of the run's DHT traffic, for nothing."""
    half = view.target_batch_size / 2
    if not view.samples_per_s or view.samples_per_s <= 0:
        return half
    return max(half, view.target_batch_size - view.samples_per_s * NEAR_TARGET_S)


def near_target(view: StageView) -> bool:
    """Close enough to a global step that progress should travel fast (announce and check often)."""
    return _held(view) >= near_threshold(view)


def seconds_between_reads(view: StageView, poll_period_s: float, announce_period_s: float) -> float:
    """How long a replica waits before it asks its stage-mates (and the clock stage) for their progress again.

    The other replicas re-announce only every ``announce_period_s``, so far from a step that is the pace of
    reads, but no later than the stage could come near its target at its observed rate. A stage that holds no
    samples and has no rate yet is idle: it reads once an announce period too (its first backward, or a
    stage-mate's call, wakes the coordinator, and the decision is taken again). While a step is averaged:
    every :data:`AVERAGING_READ_S` (the averaging group needs no reads; they only notice the stage stepped on
    without this replica). Near the target, the clock stage closes the step on what its reads show: it reads
    again after :data:`APPROACH_SHARE` of the time the stage needs to fill the batch at its rate, so reads come
    closer together as the step nears (a few per step, not one every poll period), and every poll period once
    the batch is nearly full or the rate is unknown. Any other stage closes its step when the clock has: the
    trainers' backward calls say when (:func:`clock_hint_needs_read`), so near the target it reads only every
    :data:`FOLLOWER_READ_S`."""
    if announce_period_s <= poll_period_s:
        return poll_period_s
    if view.averaging:
        return min(announce_period_s, max(poll_period_s, AVERAGING_READ_S))
    held = _held(view)
    if view.samples_per_s is None:
        idle = held <= 0 and not any(claim.accum_step > view.accum_step for claim in view.others)
        return announce_period_s if idle else poll_period_s
    if near_target(view):
        if not view.is_clock:
            return min(announce_period_s, max(poll_period_s, FOLLOWER_READ_S))
        if view.samples_per_s <= 0:
            return poll_period_s
        until_full = (view.target_batch_size - held) / view.samples_per_s
        return min(announce_period_s, max(poll_period_s, APPROACH_SHARE * until_full))
    if view.samples_per_s <= 0:
        return announce_period_s
    until_near = (near_threshold(view) - held) / view.samples_per_s
    return min(announce_period_s, max(poll_period_s, until_near))


def clock_hint_needs_read(view: StageView, hinted_step: int) -> bool:
    """Whether a stage other than the clock reads the clock stage's replicas now, because a trainer's backward
    call said that the clock accumulates for ``hinted_step`` (the step its part of the micro-batch went into).
    A hint is only a reason to ask: the step closes on what the clock's replicas answer
    (:func:`step_is_due`), so a trainer that lies costs reads (the caller repeats an unconfirmed hint's read
    at most once a :data:`FOLLOWER_READ_S`), not a step. Not when the step is due already or the hint says
    nothing new."""
    if view.is_clock or hinted_step <= view.accum_step or step_is_due(view):
        return False
    return not view.clock_steps or clock_step(view.clock_steps) < hinted_step


def clock_watch_period_s(num_stages: int, clock_replicas: int, poll_period_s: float) -> float:
    """How often a watcher asks the clock stage's replicas on its own reads while its stage is near a step (a
    trainer's hint makes it ask at once, :func:`clock_hint_needs_read`): every ``poll_period_s`` (the caller
    passes :data:`CLOCK_WATCH_S`), or as much less often as keeps the calls one clock replica takes from every
    other stage's watchers to ``CLOCK_CALLS_PER_POLL`` such periods. A stage other than the clock never waits
    for the clock's step (it accumulates on), so hearing of it later only moves a few of its samples into the
    step it is closing: no throughput is lost, and a clock replica's traffic stays flat however many stages the
    model has."""
    if num_stages < 2 or clock_replicas < 1:
        return poll_period_s
    calls = (num_stages - 1) * CLOCK_WATCHERS * min(CLOCK_ASKED, clock_replicas) / clock_replicas
    return poll_period_s * max(1.0, calls / CLOCK_CALLS_PER_POLL)


def stage_is_full(view: StageView) -> bool:
    return _held(view) >= view.target_batch_size


def must_wait(view: StageView) -> bool:
    """Whether a new backward pass must wait before it accumulates.

    While a step is averaged (unless ``overlap_averaging``), so that every gradient is computed on the
    parameters it updates; and on the clock stage once it holds a whole global batch, so steps stay
    near the target however fast trainers are. Earlier stages never hold back for a full batch: they
    would hold the very micro-batches whose successors the clock is waiting for."""
    return (view.averaging and not view.overlap_averaging) or (view.is_clock and stage_is_full(view))


def step_is_due(view: StageView) -> bool:
    """Whether to close the accumulation step now.

    Another replica already froze it (it waits for us to average); or, on the clock stage, the replicas
    together hold the global batch; or, on any other stage, the clock has finished this step. The clock's
    step is the upper median of what its replicas announce, so that one replica announcing a step far
    ahead cannot make the other stages close step after step without samples."""
    if any(claim.accum_step > view.accum_step for claim in view.others):
        return True
    if view.is_clock:
        return view.samples_pending + others_pending(view) >= view.target_batch_size
    return bool(view.clock_steps) and clock_step(view.clock_steps) > view.accum_step


def clock_step(steps: Sequence[int]) -> int:
    """The clock stage's step: the upper median of its replicas' announced steps (the only one, or the
    larger of two, or a value that a majority has reached)."""
    ordered = sorted(steps)
    return ordered[len(ordered) // 2]


def stage_mates(view: StageView) -> Tuple[ReplicaClaim, ...]:
    """The other replicas that hold the stage's parameters (:attr:`StageView.voters`): those a step is
    averaged with, even while their claims about pending work are ignored."""
    return view.others if view.voters is None else view.voters


def round_is_over(view: StageView) -> bool:
    """Whether the averaging round this replica is looking for (for its step ``view.step``) is over without
    it: a strict majority of the stage already holds a state past that step. The majority cannot be
    waiting for this replica, so looking on for a group only lets the stage get further ahead; the
    replica gives up the round and downloads the stage's state. A lone replica announcing a later step is
    no majority and changes nothing here."""
    majority = majority_state(view)
    return majority is not None and majority[0] > view.step


def step_alone(failed_rounds: int, max_failed_rounds: int, view: Optional[StageView] = None) -> bool:
    """Whether to apply the frozen step (``view.step``) without the other replicas: none formed a group
    for it in ``max_failed_rounds`` rounds (they are gone, stuck, or were never really there). Not
    while the replica is to download the stage's state (:func:`needs_resync`): the stage went on
    without it, and its answer is the stage's state, not a lineage of its own (a claim no download
    bears out is then distrusted, which ends the wait). A replica that was merely slow notices the
    divergence by digest and downloads the stage's state."""
    if view is not None and needs_resync(view):
        return False
    return failed_rounds >= max_failed_rounds


def rounds_before_stepping_alone(view: StageView, max_failed_rounds: int, mates_silent: bool = False) -> int:
    """How many averaging rounds without a group a replica tries before it applies its frozen step alone.

    ``max_failed_rounds`` normally; one when every stage-mate already failed to average a step alone
    with it (``mates_silent``: they are gone or stuck, not busy). Twice as many while a strict majority of
    the stage announces this replica's own state (:func:`majority_state`): those replicas froze the same
    step and look for the same group, so a round that found none was a matchmaking miss (under load,
    members start their search seconds apart), and stepping alone would split the stage into lineages
    that no majority holds, which it then takes a long time to reunite."""
    if mates_silent:
        return 1
    if stage_mates(view) and majority_state(view) == (view.step, view.digest):
        return 2 * max_failed_rounds
    return max_failed_rounds


def min_group_size(view: StageView) -> int:
    """The smallest averaging group worth forming: a strict majority of the stage. Smaller groups would
    split the stage into lineages (hivemind's matchmaking, pressed for time, happily pairs four replicas
    off into two groups of two); a replica that finds no such group steps alone after failed rounds,
    tentatively (:func:`majority_group`)."""
    return (len(stage_mates(view)) + 1) // 2 + 1


def full_group_size(view: StageView) -> int:
    """The group that needs no more waiting: this replica and every one of its :func:`stage_mates`. A group
    that reaches it averages at once instead of waiting out the matchmaking time for replicas that do not
    exist; a replica this view does not know of (it joined since) finds the round assembled without it,
    as it would after the matchmaking time, and catches up by downloading the stage's state."""
    return len(stage_mates(view)) + 1


def majority_group(members: int, view: StageView) -> bool:
    """Whether a group of ``members`` replicas that averaged a step is a strict majority of the stage
    (this replica and its :func:`stage_mates`). A step a minority applied is tentative: the majority
    may go on without it, and its members then give it up for the majority's state."""
    return members >= min_group_size(view)


def overclaimers(claims: Mapping[str, int], gathered: Mapping[str, int], slack: float = 0.5) -> Set[str]:
    """Group members whose announced pending samples for a step were not borne out by its all-reduce.

    ``claims``: the pending samples each other replica announced when the step closed; ``gathered``: the
    samples each group member actually reported in the round. A member that claimed samples and then
    reported fewer than ``slack`` times its claim made the step close early on its word: a proven lie."""
    return {
        peer_id
        for peer_id, claimed in claims.items()
        if claimed > 0 and peer_id in gathered and gathered[peer_id] < slack * claimed
    }


def absent_claimants(claims: Mapping[str, int], gathered: Mapping[str, int]) -> Set[str]:
    """Replicas that announced pending samples for a step and were not in the group that averaged it.
    An honest replica that was slow to find the group looks the same, so this is a failure, not a proven
    lie (:func:`distrust_seconds` with strikes): one that keeps claiming and staying away is soon
    ignored as long as a liar."""
    return {peer_id for peer_id, claimed in claims.items() if claimed > 0 and peer_id not in gathered}


def unborne_step_claims(
    ahead: Mapping[str, int], reached: int, delivered: bool, source: Optional[str], moved_on: Collection[str] = ()
) -> Tuple[Set[str], Set[str]]:
    """After a state download meant to catch up with the replicas that announced a later step (``ahead``: peer
    id -> announced step), those whose step it did not bear out (above ``reached``, the step this replica
    holds now), as ``(proven, unconfirmed)``.

    Only the replica that served the state (``source``, when known) can be proven wrong by it: it announced a
    step above the state it holds. The others may hold what they announce while the source lagged behind
    them, or the download failed: an honest replica's state can look the same, so theirs is a failure, with
    its short, escalating distrust. Treating them as liars would let one lagging source make a replica ignore
    most of its stage for minutes, and pair off with the rest into a lineage of its own. A replica that served
    a state at a later step than it announced (``moved_on``: it stepped since) bore its claim out, and is
    neither: doubting it too could leave this replica with no stage-mate it believes, stepping alone on a
    lineage of its own until the doubt expires."""
    unborne = {peer_id for peer_id, step in ahead.items() if step > reached} - set(moved_on)
    proven = unborne & {source} if delivered and source is not None else set()
    return proven, unborne - proven


def distrust_seconds(strikes: Optional[int], limit: float = DISTRUST_S, first: float = FIRST_STRIKE_S) -> float:
    """How long to ignore a replica's claims. ``strikes=None``: its claim was proven false (it served
    another state than it announced, its all-reduce contribution did not bear out its claim): the full
    ``limit``. Otherwise ``strikes`` consecutive failures that a slow or briefly unreachable honest
    replica causes too (a round it did not join, a state download from it that failed): ``first``,
    doubling with each, up to ``limit``. A replica left behind by one such failure then catches up
    within seconds instead of minutes, while one that keeps announcing what it never delivers is
    soon ignored as long as a liar."""
    if strikes is None:
        return limit
    return min(limit, first * 2 ** max(0, strikes - 1))
