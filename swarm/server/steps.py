"""Global steps of one stage: admission of backward passes, closing steps, all-reduce, applying.

The decisions (when to close, who waits, when to resync, whom to stop believing) are the pure
functions of :mod:`swarm.policy.steps`; this module feeds them a :class:`StageView` built from the
runner, the stage's DHT records (read once an announce period) and the stage-mates' answers to
progress calls (:mod:`swarm.server.progress`, near a step every poll period), and carries them out:
freezing the accumulator, averaging it with the other replicas through :class:`StageAverager`,
applying the result. The DHT record is not stored again for a step: the stage-mates learn of it from
progress calls, trainers from the next announcement.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from typing import Deque, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from hivemind.utils import get_logger

from swarm.metrics import count_ban, observe_allreduce
from swarm.policy.aggregation import banned_by_majority
from swarm.policy.steps import (
    DISTRUST_S,
    ReplicaClaim,
    StageView,
    absent_claimants,
    confirmed_below,
    FOLLOWER_READ_S,
    clock_hint_needs_read,
    distrust_seconds,
    majority_group,
    full_group_size,
    min_group_size,
    must_wait,
    near_target,
    needs_resync,
    others_pending,
    overclaimers,
    round_is_over,
    rounds_before_stepping_alone,
    seconds_between_reads,
    stage_mates,
    step_alone,
    step_is_due,
    trusted_others,
    unborne_step_claims,
)
from swarm.dht.records import (
    CONTRIBUTION_WINDOW,
    MAX_EXCLUDED,
    PeerRecord,
    excluded_by,
    rewind_contributed,
    update_contributed,
)

from swarm.server.averaging import StageAverager
from swarm.server.host import CurrentStage, Loops, Records, Settings, served
from swarm.server.lifecycle import PeerState

__all__ = ["StepCoordinator", "StepsHost", "DISTRUST_S", "FAST_PERIOD_S", "MEMBER_HISTORY"]

logger = get_logger(__name__)
FAST_PERIOD_S = 0.05  # announce/check period (seconds) while a stage nears its global batch
MEMBER_HISTORY = 256  # applied steps whose group members a replica remembers (the step_members RPC)
HISTORY_STEPS = 64  # past (step, digest) pairs a replica remembers: a majority that lags on them needs no resync
MAX_FAILED_ROUNDS = 2  # averaging rounds without a group before a replica applies a step alone
RESYNC_ATTEMPTS = 3  # state downloads a replica tries when it finds itself behind
BAN_S = 3600.0  # seconds a replica caught lying in averaging stays banned (by this replica's averager too)
TENTATIVE_S = 30.0  # seconds a step a minority averaged stays tentative before its replica stands by it
RATE_MEMORY = 0.5  # weight of the previous estimate of the stage's rate when a read gives a new one


class _Resync(Protocol):
    """How a replica that fell behind downloads the stage's state (:class:`swarm.server.joining.Joining`)."""

    last_source: Optional[str]
    moved_on: Set[str]

    async def download_state(self, max_attempts: Optional[int] = None) -> bool: ...


class StepsHost(Settings, CurrentStage, Loops, Records, Protocol):
    """What the step protocol reads of the peer: the stage it serves and its parts, the stage's records (the
    DHT's and the replicas' own answers), and the lifecycle's events and waits."""

    averager: Optional[StageAverager]

    @property
    def joining(self) -> _Resync: ...

    @property
    def stage_done(self) -> asyncio.Event: ...

    def notify_progress(self) -> None: ...


class StepCoordinator:
    """Runs the global-step protocol for the stage ``peer`` serves now (one coordinator per stage taken up)."""

    def __init__(self, peer: StepsHost):
        self.peer = peer
        # set whenever what decides whether a backward must wait may have changed (see wait_for_room)
        self._room_changed = asyncio.Event()
        self.admitted = 0  # samples of backward passes admitted but not yet accumulated
        self.members: "OrderedDict[int, List[str]]" = OrderedDict()  # applied step -> peers whose gradients it averaged
        self.contributed = (0, 0)  # (base, bits): steps that included this replica's gradients
        self._distrusted: Dict[str, float] = {}  # peer id -> monotonic time until which its claims are ignored
        self._strikes: Dict[str, int] = {}  # peer id -> consecutive failures it may not be to blame for
        self._banned: Dict[str, float] = {}  # peer id -> monotonic time it was banned from averaging (newest last)
        self._others: Tuple[ReplicaClaim, ...] = ()
        self._voters: Tuple[ReplicaClaim, ...] = ()  # stage-mates whose announced state counts (see StageView.voters)
        self._state_distrusted: Dict[str, float] = {}  # peer id -> until when its announced state does not count
        self.history: Deque[Tuple[int, str]] = deque(maxlen=HISTORY_STEPS)  # (step, digest) of our recent states
        self._clock_steps: Tuple[int, ...] = ()
        self._failed_rounds = 0
        self._failed_step = -1  # the frozen step that _failed_rounds counts rounds for
        self._silent: Set[str] = set()  # stage-mates distrusted for announcing themselves online but not averaging
        self.tentative: Dict[int, float] = {}  # applied step a minority of the stage averaged -> when (majority_group)
        self.samples_per_s: Optional[float] = None  # what the whole stage accumulates, from successive reads
        self._last_read: Optional[Tuple[float, int, int]] = None  # (monotonic time, accum step, stage's pending)
        self._asked_at = -math.inf  # when the stage-mates were last asked for their progress (monotonic)
        self._clock_hint = 0  # the highest clock step a trainer's backward call reported (a hint, not a fact)
        self._hint_read = (0, -math.inf)  # the hint for which the clock stage was last asked, and when (monotonic)
        self.allreduce_bytes = 0  # the averager's robust-round bytes (sent and received), as of its last round

    # ---- the view the policy decides on ----

    def view(self) -> StageView:
        peer, runner = self.peer, served(self.peer.runner, "runner")
        step, digest = runner.version
        return StageView(
            peer_id=peer.peer_id,
            is_clock=peer.stage == peer.run.num_stages - 1,
            target_batch_size=peer.run.target_batch_size,
            step=step,
            accum_step=runner.accum_step,
            samples_pending=runner.samples_pending,
            samples_admitted=self.admitted,
            digest=digest,
            averaging=runner.frozen is not None,
            others=self._others,
            clock_steps=self._clock_steps,
            overlap_averaging=peer.config.overlap_averaging,
            voters=self._voters,
            history=tuple(self.history) + ((step, digest),),
            samples_per_s=self.samples_per_s,
        )

    def _measure_rate(self, view: StageView) -> None:
        """Update :attr:`samples_per_s` from the growth of the stage's pending samples (this replica's and the
        others' claims) since the previous read; a read after a step closed starts over (what the closed
        step held last is not known), so a stage whose steps are shorter than its reads keeps no rate."""
        now, pending = time.monotonic(), view.samples_pending + others_pending(view)
        last, self._last_read = self._last_read, (now, view.accum_step, pending)
        if last is None or last[1] != view.accum_step or now <= last[0]:
            return
        sample = max(0, pending - last[2]) / (now - last[0])
        self.samples_per_s = (
            sample if self.samples_per_s is None else (RATE_MEMORY * self.samples_per_s + (1 - RATE_MEMORY) * sample)
        )

    def _observe(self, records: Dict[str, PeerRecord]) -> None:
        """Take the stage's claims from a DHT snapshot, leaving out replicas caught lying."""
        peer, now = self.peer, time.monotonic()
        self._distrusted = {p: until for p, until in self._distrusted.items() if until > now}
        self._state_distrusted = {p: until for p, until in self._state_distrusted.items() if until > now}
        claims = [
            ReplicaClaim(r.peer_id, r.step, r.accum_step, r.samples_pending, r.samples_admitted, r.digest)
            for r in records.values()
            if r.stage == peer.stage and r.peer_id != peer.peer_id and r.state == "online"
        ]
        self._adopt_stage_bans(records)
        self._others = trusted_others(claims, {**self._distrusted, **self._banned})
        self._voters = trusted_others(claims, {**self._state_distrusted, **self._banned})
        last = peer.run.num_stages - 1
        # the step each clock replica accumulates for: once a majority froze step s (moved on to s + 1), the
        # micro-batches that reach this stage next went into the clock's s + 1, so this stage closes s too
        self._clock_steps = tuple(
            r.accum_step
            for r in records.values()
            if r.stage == last and r.state in ("online", "leaving") and r.peer_id not in self._distrusted
        )
        self.room_may_have_changed()

    def _adopt_stage_bans(self, records: Dict[str, PeerRecord]) -> None:
        """Ban, here too, a stage-mate that most of the stage banned from averaging: a replica that was not in
        the round that caught it would otherwise still average with it (alone with it, in a group of two)."""
        if not self.peer.run.defences:
            return
        peer = self.peer
        votes = {**excluded_by(records, served(peer.stage, "stage")), peer.peer_id: self.excluded()}
        for peer_id in sorted(banned_by_majority(votes) - set(self._banned) - {peer.peer_id}):
            logger.warning(f"stage {peer.stage}: excluding {peer_id} from averaging: most of the stage banned it")
            count_ban("peer", "stage_majority")
            self._banned[peer_id] = time.monotonic()
            self.distrust([peer_id], "banned from averaging by most of the stage")
            served(peer.averager, "averager").ban([peer_id], BAN_S)

    def distrust(self, peer_ids, why: str, transient: bool = False) -> None:
        """Ignore the claims of ``peer_ids``: for :data:`DISTRUST_S` after a proven lie, for an escalating
        while after a ``transient`` failure (see :func:`distrust_seconds`)."""
        for peer_id in peer_ids:
            strikes = None
            if transient:
                strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
            seconds = distrust_seconds(strikes)
            if peer_id not in self._distrusted:
                logger.warning(f"stage {self.peer.stage}: ignoring the claims of {peer_id} for {seconds:.0f}s: {why}")
            self._distrusted[peer_id] = max(self._distrusted.get(peer_id, 0.0), time.monotonic() + seconds)

    def _delivered(self, peer_ids) -> None:
        """These replicas did what they announced (averaged with us, served their state): strikes forgotten."""
        for peer_id in peer_ids:
            self._strikes.pop(peer_id, None)

    # ---- admission (called by the backward handler) ----

    def near_target(self) -> bool:
        return near_target(self.view())

    def must_wait(self) -> bool:
        return self.peer.state == PeerState.ONLINE and must_wait(self.view())

    async def wait_for_room(self, samples: int) -> None:
        """Backpressure, bounded in time: wait while the policy says new gradients must wait, then admit.

        What the policy decides on changes when a backward is released, a step is frozen or applied, or the
        stage's records are read: each of those signals :meth:`room_may_have_changed`, and only then is the
        decision taken again."""
        deadline = time.monotonic() + self.peer.config.averaging_timeout_s
        while self.must_wait() and time.monotonic() < deadline:
            self._room_changed.clear()
            self.peer.notify_progress()  # the coordinator closes the step that holds this backward back
            try:
                await asyncio.wait_for(self._room_changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        self.admitted += samples

    def release(self, samples: int) -> None:
        self.admitted -= samples
        self.room_may_have_changed()

    def room_may_have_changed(self) -> None:
        """Wake the backwards waiting for room, to take the decision again."""
        self._room_changed.set()

    # ---- the loop ----

    async def run(self) -> None:
        """Every poll period: catch up if behind, and run a global step once the stage has the global batch."""
        peer = self.peer
        while not peer.stopping.is_set() and not peer.stage_done.is_set():
            try:
                await self.coordinate_once()
            except Exception:
                logger.exception("step coordination failed; retrying")
            finally:
                self.room_may_have_changed()
            # gradients accumulated here and progress a stage-mate sent wake the loop: deciding on what is known
            # costs no message (the stage-mates are asked no more often than seconds_between_reads says)
            period = seconds_between_reads(self.view(), peer.config.poll_period_s, peer.config.announce_period_s)
            await peer.sleep_or_progress("coordinate", period, FAST_PERIOD_S)

    def hear_clock_hint(self, step: object) -> None:
        """A trainer's backward call says the clock stage accumulated its part of the micro-batch into ``step``:
        if that is news, the coordinator wakes and asks the clock's replicas (:func:`clock_hint_needs_read`).
        Anything but a plausible step number is ignored: the hint is the trainer's, not a replica's, word."""
        if isinstance(step, bool) or not isinstance(step, int) or step <= self._clock_hint:
            return
        runner = self.peer.runner
        if runner is not None and step > runner.accum_step + 1:
            step = runner.accum_step + 1  # what a hint can make this replica do is close the step it is on
        if step > self._clock_hint:
            self._clock_hint = step
            self.peer.notify_progress()

    async def _read_view(self) -> StageView:
        """The view after a read of the stage's records: the DHT's, at most once an announce period, and the
        replicas' own answers to progress calls, once :func:`seconds_between_reads` passed since they were last
        asked (a wake-up in between, for gradients this replica accumulated or progress a replica sent,
        decides on what is known); and the clock stage's replicas' answers as soon as a trainer's hint says
        the clock moved on."""
        config, now, view = self.peer.config, time.monotonic(), self.view()
        ask = now - self._asked_at >= seconds_between_reads(view, config.poll_period_s, config.announce_period_s)
        # a hint is read at once, and again every FOLLOWER_READ_S while the clock's replicas do not bear it out
        # (their answers raced the step): a trainer that lies costs a read a second, as the plain reads do
        last_hint, read_at = self._hint_read
        news = self._clock_hint > last_hint or now - read_at >= FOLLOWER_READ_S
        hinted = news and clock_hint_needs_read(view, self._clock_hint)
        if ask:
            self._asked_at = now
        if hinted:
            self._hint_read = (self._clock_hint, now)
        self._observe(await self.peer.fetch_records(ask=ask, ask_clock=hinted))
        self._measure_rate(self.view())
        return self.view()

    async def coordinate_once(self) -> None:
        peer = self.peer
        view = await self._read_view()
        self._confirm(view)
        if needs_resync(view):
            await self._resync(view)
            return
        if served(peer.runner, "runner").frozen is not None or step_is_due(view):
            await self._global_step(view)

    async def _resync(self, view: StageView) -> None:
        peer = self.peer
        ahead = [c for c in view.others if c.step > view.step]
        logger.info(
            f"stage {peer.stage}: out of sync with the other replicas at step {view.step}; downloading their state"
        )
        delivered = await peer.joining.download_state(max_attempts=RESYNC_ATTEMPTS)
        runner = served(peer.runner, "runner")
        # a claim that no download could bear out is ignored for a while (then believed again, if still made):
        # for long only where the claimant itself served a state behind its claim
        proven, unconfirmed = unborne_step_claims(
            {c.peer_id: c.step for c in ahead},
            runner.step,
            delivered,
            peer.joining.last_source if delivered else None,
            peer.joining.moved_on,
        )
        outcome = f"reached only step {runner.step}" if delivered else "failed"
        claimed = max((c.step for c in ahead), default=0)
        self.distrust(proven, f"announced step {claimed}, but the state it served {outcome}")
        self.distrust(unconfirmed, f"announced step {claimed}, but the state download {outcome}", transient=True)
        for peer_id in proven | unconfirmed:
            self._state_distrusted[peer_id] = self._distrusted[peer_id]
        self._failed_rounds = 0
        if delivered:
            self._delivered(c.peer_id for c in ahead if c.peer_id not in proven | unconfirmed)
            self.history.clear()  # a state of the stage's lineage replaced ours

    async def _global_step(self, view: StageView) -> None:
        peer = self.peer
        claims = {c.peer_id: c.samples_pending for c in view.others if c.accum_step == view.accum_step}
        frozen = await peer.compute.run(served(peer.runner, "runner").freeze)
        if frozen.step != self._failed_step:
            # tell the stage-mates at once that this step is closed: they close it too and join the all-reduce
            self._asked_at = time.monotonic()
            await peer.fetch_records(ask=True, tell=True)
            self._failed_step, self._failed_rounds = frozen.step, 0
        mates = stage_mates(view)
        if not mates:
            await self.apply(frozen.mean_grads, frozen.samples, [peer.peer_id])
            return
        gather = {"step": frozen.step, "samples": frozen.samples, "peer_id": peer.peer_id}
        started = time.monotonic()
        logger.info(
            f"stage {peer.stage}: averaging step {frozen.step} ({frozen.samples} local samples) "
            f"with {len(mates)} other replicas"
        )
        over = asyncio.Event()
        # with one mate, a majority past this step would have to include this replica: nothing to watch for
        watch = (lambda: self._until_round_is_over(over)) if len(mates) >= 2 else None
        result = await served(peer.averager, "averager").average(
            frozen.step,
            frozen.mean_grads,
            frozen.samples,
            gather,
            matchmaking_timeout=3 * peer.config.matchmaking_time_s,
            timeout=peer.config.averaging_timeout_s,
            min_group_size=min_group_size(view),
            full_group_size=full_group_size(view),
            give_up=watch,
        )
        if result is None and over.is_set():
            logger.info(
                f"stage {peer.stage}: most of the stage applied step {frozen.step} without this replica; catching up"
            )
            return  # the next poll downloads the stage's state; no failed round: nobody failed to average
        logger.info(
            f"stage {peer.stage}: averaging step {frozen.step} {'failed' if result is None else 'done'} "
            f"after {time.monotonic() - started:.2f}s"
        )
        observe_allreduce(time.monotonic() - started, ok=result is not None)
        if result is None:
            self._failed_rounds += 1
            # replicas that already failed to average a step alone with us get one round, not several
            limit = rounds_before_stepping_alone(view, MAX_FAILED_ROUNDS, {c.peer_id for c in mates} <= self._silent)
            if step_alone(self._failed_rounds, limit, view):
                logger.warning(
                    f"stage {peer.stage}: no replica averaged step {frozen.step} in {self._failed_rounds} "
                    f"rounds; applying it alone"
                )
                silent = [c.peer_id for c in mates]
                self.distrust(silent, "announced itself online but did not average", transient=True)
                self._silent.update(silent)
                await self.apply(frozen.mean_grads, frozen.samples, [peer.peer_id], tentative=True)
            return  # otherwise the frozen step stays: the next poll retries, or resyncs if others moved on
        self.allreduce_bytes = max(self.allreduce_bytes, result.wire_bytes)
        gathered = result.gathered
        steps = {data.get("step") for data in gathered.values() if isinstance(data, dict)}
        if steps != {frozen.step}:
            logger.warning(f"stage {peer.stage}: group gathered mismatched steps {steps}; dropping this round")
            return
        self._report_exclusions(result)
        samples = {peer_id: int(data.get("samples", 0)) for peer_id, data in gathered.items() if isinstance(data, dict)}
        liars = overclaimers(claims, samples)
        if liars:
            self.distrust(liars, "announced pending samples that its all-reduce contribution did not bear out")
        absent = absent_claimants(claims, samples)
        if absent:
            self.distrust(absent, "announced pending samples but did not join the step's all-reduce", transient=True)
        self._silent.difference_update(gathered)
        self._delivered(gathered)
        # the samples of every gradient that went in, whatever its weight
        included = [p for p in result.included if p in samples]
        await self.apply(
            result.tensors,
            sum(samples[p] for p in included),
            sorted(included),
            tentative=not majority_group(len(set(gathered) - set(result.banned)), view),
        )

    async def _until_round_is_over(self, over: asyncio.Event) -> None:
        """Watch the stage's records while this replica looks for an averaging group; return (setting
        ``over``) once a majority of the stage holds a state past the step being averaged
        (:func:`round_is_over`): a replica that downloaded the stage's state while the others were already
        averaging its step would otherwise look for their group until its search timed out, by which time
        they are steps further on, and never catch up with a stage that steps back to back."""
        peer = self.peer
        while True:
            await asyncio.sleep(peer.config.poll_period_s)
            try:
                view = await self._read_view()
            except Exception as e:  # a lookup that failed says nothing about the round: keep looking for the group
                logger.debug(f"stage {peer.stage}: could not read the stage's records while averaging: {e!r}")
                continue
            if round_is_over(view):
                over.set()
                return

    def _report_exclusions(self, result) -> None:
        """Log whom a robust round left out or banned (a replica whose gradients kept pointing against the
        others' is banned after a round it was part of), and stop believing the claims of those it banned."""
        for peer_id, why in {**result.excluded, **result.banned}.items():
            if peer_id in result.banned:
                logger.warning(f"stage {self.peer.stage}: excluding {peer_id} from averaging: {why}")
                count_ban("peer", "averaging")
            else:
                logger.info(f"stage {self.peer.stage}: left {peer_id} out of this round: {why}")
        if result.banned:
            self.distrust(list(result.banned), "banned from averaging")
            for peer_id in result.banned:
                self._banned.pop(peer_id, None)
                self._banned[peer_id] = time.monotonic()

    def banned_now(self) -> Set[str]:
        """Stage-mates banned from averaging within the last ``BAN_S`` seconds."""
        now = time.monotonic()
        return {
            p for p, t in list(self._banned.items()) if now - t < BAN_S
        }  # a copy: metrics read it from their thread

    def excluded(self) -> List[str]:
        """Stage-mates banned from averaging within the last ``BAN_S`` seconds, newest first (for the record)."""
        now = time.monotonic()
        self._banned = {p: t for p, t in self._banned.items() if now - t < BAN_S}
        return list(reversed(self._banned))[:MAX_EXCLUDED]

    async def apply(
        self, mean_grads: Sequence, total_samples: int, members: List[str], tentative: bool = False
    ) -> None:
        """Apply the frozen step with the group's mean gradient, remember who contributed, announce.

        ``tentative``: a minority of the stage averaged the step; trainers wait before they count its
        samples (:attr:`PeerRecord.tentative_bits`) until :meth:`_confirm` or :meth:`adopted` settles it."""
        peer, runner = self.peer, served(self.peer.runner, "runner")
        if runner.frozen is None:
            raise RuntimeError(f"stage {peer.stage}: no step is frozen, so there is none to apply")
        step = runner.frozen.step
        self.history.append(runner.version)
        await peer.compute.run(runner.apply, mean_grads, total_samples)
        self.room_may_have_changed()
        self._failed_rounds = 0
        self.remember(step, members)
        if tentative:
            self.tentative[step] = time.monotonic()
        logger.info(
            f"stage {peer.stage}: global step {step + 1} with {total_samples} samples from {len(members)} replicas"
            f"{' (tentative: a minority of the stage)' if tentative else ''}"
        )

    def _confirm(self, view: StageView) -> None:
        """Settle the tentative steps that the stage's majority now holds (its state descends from them),
        and those that no majority confirmed or replaced within ``TENTATIVE_S``: a stage without a majority
        (or with replicas that announce a state they never average) must not hold its trainers' accounting
        back for ever."""
        if not self.tentative:
            return
        below, now = confirmed_below(view), time.monotonic()
        stale = sorted(step for step, at in self.tentative.items() if step >= below and now - at > TENTATIVE_S)
        if stale:
            logger.info(
                f"stage {self.peer.stage}: standing by steps {stale}: no majority of the stage confirmed or "
                f"replaced them in {TENTATIVE_S:.0f}s"
            )
        self.tentative = {step: at for step, at in self.tentative.items() if step >= below and step not in stale}

    def tentative_bits(self) -> int:
        """:attr:`PeerRecord.tentative_bits` for the current ``contributed`` window."""
        base, bits = self.contributed[0], 0
        for step in self.tentative:
            if 0 <= base - step < CONTRIBUTION_WINDOW:
                bits |= 1 << (base - step)
        return bits

    def adopted(self, first_dropped: int, step: int) -> None:
        """The replica gave up its own state for the stage's state at ``step``: its tentative steps are
        dropped (their gradients are in no step the stage keeps), and so are the gradients it held from
        ``first_dropped`` on."""
        base, bits = self.contributed
        if step <= base:
            base, bits = rewind_contributed(base, bits, step)
        for dropped in self.tentative:
            if dropped < step and 0 <= base - dropped < CONTRIBUTION_WINDOW:
                bits &= ~(1 << (base - dropped))
        for dropped in [s for s in self.members if s >= step or s in self.tentative]:
            del self.members[dropped]  # the members of another lineage's steps say nothing of the stage's
        self.contributed, self.tentative = (base, bits), {}
        self._failed_rounds = 0
        self.skipped(first_dropped, step)

    def remember(self, step: int, members: List[str]) -> None:
        """Record the members of an applied step (for trainers that ask) and whether ours were among them."""
        self.members[step] = list(members)
        while len(self.members) > MEMBER_HISTORY:
            self.members.popitem(last=False)
        self.contributed = update_contributed(*self.contributed, step, self.peer.peer_id in members)

    def skipped(self, from_step: int, to_step: int) -> None:
        """Steps applied by the stage without this replica's gradients (it downloaded their result)."""
        for step in range(max(from_step, to_step - 64), to_step):
            self.contributed = update_contributed(*self.contributed, step, False)
