"""Joining a stage and leaving it: choosing the stage, getting its current state, handing over.

A replica never serves before it holds the stage's current state: it downloads parameters, optimizer
state and step from a live replica, or restores its checkpoint; a stage starts from its
initialisation only at step 0 (or when told to), never silently in the middle of a run. With the
run's defences on, a downloaded state is kept only if it is the one a majority of the stage's
replicas announce (same step, parameters hashing to the announced digest, every value finite); a
replica that served anything else is distrusted and the next one is asked. Leaving refuses new
work, lets work in flight and any averaging round finish, then tells the DHT.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple

import torch
from hivemind.utils import get_logger

from swarm.model.footprint import peer_fitting_stages
from swarm.policy.rebalance import choose_stage_for_new_peer, settle_join_choice
from swarm.policy.joining import StateClaim, StateSources, StateVerdict, check_downloaded_state, trusted_state_sources
from swarm.dht.records import PeerRecord, to_peer_infos
from swarm.server.averaging import StageAverager
from swarm.server.checkpoints import non_finite_indices
from swarm.server.host import CurrentStage, Records, Settings, served
from swarm.server.lifecycle import Lifecycle, PeerState
from swarm.server.runner import parameter_digest
from swarm.server.steps import DISTRUST_S, StepCoordinator

__all__ = ["Joining", "JoiningHost"]

logger = get_logger(__name__)
CATCH_UP_PERIODS = 2  # announce periods a state newer than its source's record waits for the records to name it


class StateFacts(NamedTuple):
    """What :func:`check_downloaded_state` judges a downloaded state by, in the order it takes them."""

    complete: bool  # the count and shapes of the stage's state
    all_finite: bool
    step: Optional[int]  # the step its metadata names; None if the metadata is malformed
    digest: str  # of its parameters; empty if incomplete


class _Announce(Protocol):
    async def announce(self) -> bool: ...


class _Restore(Protocol):
    async def restore(self) -> bool: ...


class JoiningHost(Settings, CurrentStage, Records, Protocol):
    """What joining and leaving a stage read of the peer: the stage and its parts, the stage's records, the
    lifecycle (the only way they change the peer's state) and :meth:`claim_stage`."""

    averager: Optional[StageAverager]
    steps: Optional[StepCoordinator]
    coordinator_task: Optional[asyncio.Task]
    lifecycle: Lifecycle

    @property
    def announcer(self) -> _Announce: ...

    @property
    def checkpoints(self) -> _Restore: ...

    def claim_stage(self, stage: int) -> None: ...


class Joining:
    """Runs on the peer's event loop; torch work goes to its compute thread, downloads to its averager."""

    def __init__(self, peer: JoiningHost, rng: Optional[random.Random] = None):
        self.peer = peer
        self._refused: Dict[str, float] = {}  # peer id -> monotonic time until which its state is not asked for
        self._rng = rng or random.Random()  # orders the sources, so that joiners spread their load
        self.last_source: Optional[str] = None  # peer id of the replica whose state was adopted last, when known
        self.moved_on: Set[str] = set()  # sources of the last download whose state had passed the step they announced

    async def choose_stage(self) -> int:
        peer = self.peer
        if peer.config.stage != "auto":
            return int(peer.config.stage)
        snapshot = to_peer_infos(await peer.fetch_records(every_stage=True), peer.run.num_stages)
        stage = choose_stage_for_new_peer(snapshot, peer.run.num_stages, fitting=peer_fitting_stages(peer.config))
        return await self._settle_auto_stage(stage)

    async def _settle_auto_stage(self, stage: int) -> int:
        """Announce the automatic choice as 'joining', let peers that chose at the same moment
        announce theirs, and give way (see :func:`settle_join_choice`) if one of them got there first."""
        peer = self.peer
        peer.claim_stage(stage)
        await peer.announcer.announce()
        await asyncio.sleep(random.uniform(0.5, 1.5))
        snapshot = to_peer_infos(await peer.fetch_records(fresh=True, every_stage=True), peer.run.num_stages)
        settled = settle_join_choice(
            snapshot, peer.peer_id, stage, peer.run.num_stages, fitting=peer_fitting_stages(peer.config)
        )
        if settled != stage:
            logger.info(f"another peer is joining stage {stage} at the same time; joining stage {settled} instead")
        return settled

    async def join_stage(self) -> None:
        """Get the stage's current state before serving: from live replicas if there are any, else from
        this peer's checkpoint, else (only at step 0, or with ``reinitialize``) from its initialisation.

        Live replicas that all served a state other than the one they announce count as none."""
        peer = self.peer
        records = await peer.fetch_records(ask=True, fresh=True)
        others = self._online_others(records)
        if not others or not await self.download_state():
            if others and not self._all_refused(others):
                raise RuntimeError(f"could not download stage {peer.stage} state from any of {len(others)} replicas")
            if others:
                logger.warning(
                    f"stage {peer.stage}: every live replica served a state other than the one it "
                    f"announces; joining as if the stage had none"
                )
            await self._start_without_replicas(records)
        served(peer.averager, "averager").allow_state_sharing = True

    async def _start_without_replicas(self, records: Dict[str, PeerRecord]) -> None:
        peer = self.peer
        if await peer.checkpoints.restore():
            return
        # the step the run is at, from every stage: a stage with no replica left says nothing of it
        records = {**records, **await peer.fetch_records(fresh=True, every_stage=True)}
        run_step = max((r.step for r in records.values()), default=0)
        if run_step > 0 and not peer.config.reinitialize:
            raise RuntimeError(
                f"stage {peer.stage} has no live replica and no checkpoint in {peer.config.checkpoint_dir!r}, "
                f"but the run is at step {run_step}: pass --checkpoint_dir with this stage's checkpoint, or "
                f"--reinitialize true to restart the stage from scratch"
            )
        if peer.run.starts_from_checkpoint and not peer.config.init_from:
            raise RuntimeError(
                f"stage {peer.stage} has no live replica, and run {peer.run.run_id!r} starts from a checkpoint: pass "
                f"--init_from with a local copy of it (the one the organiser gave swarm bootstrap --init_from), or "
                f"join once a replica serves the stage"
            )

    def _online_others(self, records: Dict[str, PeerRecord]) -> List[PeerRecord]:
        peer = self.peer
        return [
            r for r in records.values() if r.stage == peer.stage and r.state == "online" and r.peer_id != peer.peer_id
        ]

    async def download_state(self, max_attempts: Optional[int] = None) -> bool:
        """Adopt a live replica's state; retried within ``state_download_timeout_s`` (and at most
        ``max_attempts`` times: a replica catching up gives up soon when nobody serves the state).

        With the run's defences on, only from replicas announcing the state a majority of the stage
        announces, and only a state that proves to be that one (:mod:`swarm.policy.joining`)."""
        self.moved_on = set()
        if self.peer.run.defences:
            return await self._download_trusted(max_attempts)
        return await self._download_any(max_attempts)

    # ---- without defences: whichever replica hivemind's downloader picks, unchecked ----

    async def _download_any(self, max_attempts: Optional[int]) -> bool:
        peer = self.peer
        timeout = peer.config.state_download_timeout_s
        deadline, attempts = time.monotonic() + timeout, 0
        while time.monotonic() < deadline and (max_attempts is None or attempts < max_attempts):
            attempts += 1
            if await self._adopt_any(timeout):
                return True
            await asyncio.sleep(1.0)
        return False

    async def _adopt_any(self, timeout: float) -> bool:
        """One download from the replica hivemind's downloader picks, adopted if it fits the stage. A separate
        call, so that a state let go is gone before the next download begins (it is never held twice)."""
        future = served(self.peer.averager, "averager").load_state_from_peers(wait=False, timeout=timeout)
        try:
            loaded = await asyncio.wait_for(future, timeout=timeout)
        except Exception as e:
            logger.warning(f"state download failed: {type(e).__name__}: {e}")
            return False
        if loaded is None:
            return False
        try:
            await self._adopt(*loaded, source="a replica")
        except ValueError as e:
            # a state stream can end early without an error (a short tensor list);
            # load_state checks every tensor before touching anything, so just try again
            logger.warning(f"downloaded state rejected, retrying: {e}")
            return False
        return True

    async def _adopt(
        self, metadata: Dict[str, Any], tensors: Sequence[torch.Tensor], source: str, source_id: Optional[str] = None
    ) -> None:
        """Load a downloaded state (ValueError if it does not fit the stage; nothing changes then); ``source_id``:
        the peer id of the replica that served it, when known (it is then :attr:`last_source`)."""
        peer, runner = self.peer, served(self.peer.runner, "runner")
        first_dropped = runner.frozen.step if runner.frozen is not None else runner.accum_step
        dropped_from = min(peer.steps.tentative, default=None) if peer.steps is not None else None
        await peer.compute.run(runner.load_state, metadata, tensors, dropped_from)
        if peer.steps is not None:
            peer.steps.adopted(first_dropped, runner.step)
        self.last_source = source_id
        logger.info(f"stage {peer.stage}: downloaded state at step {runner.step} from {source}")

    # ---- with defences: the majority's state, verified ----

    async def _download_trusted(self, max_attempts: Optional[int]) -> bool:
        peer = self.peer
        deadline, attempts = time.monotonic() + peer.config.state_download_timeout_s, 0
        while time.monotonic() < deadline and (max_attempts is None or attempts < max_attempts):
            attempts += 1
            records = await peer.fetch_records(ask=True)
            sources = self._sources(records)
            if sources.peer_ids and await self._adopt_first_verified(sources, deadline):
                return True
            if self._all_refused(self._online_others(records)):
                return False  # every online replica served a bad state: nothing left to ask
            if not sources.peer_ids:
                logger.info(f"stage {peer.stage}: no trusted source of the stage's state yet: {sources.reason}")
            await asyncio.sleep(1.0)
        return False

    def _sources(self, records: Dict[str, PeerRecord]) -> StateSources:
        peer = self.peer
        claims = [StateClaim(r.peer_id, r.state, r.step, r.digest) for r in records.values() if r.stage == peer.stage]
        banned = peer.steps.banned_now() if peer.steps is not None else set()
        return trusted_state_sources(claims, peer.peer_id, self._refused_now() | banned, self._rng)

    async def _adopt_first_verified(self, sources: StateSources, deadline: float) -> bool:
        """Download from ``sources`` one at a time, until one serves the announced state; refuse the others.

        Each download is let go before the next begins: a state may be gigabytes, and is never held twice."""
        remaining = list(sources.peer_ids)
        while remaining and time.monotonic() < deadline:
            downloaded = await self._fetch(remaining, deadline)
            if downloaded is None or downloaded[0] not in remaining:
                return False
            remaining = remaining[remaining.index(downloaded[0]) + 1 :]
            if await self._judge_and_adopt(sources, *downloaded, deadline):
                return True
            del downloaded
        return False

    async def _judge_and_adopt(
        self, sources: StateSources, source: str, metadata: Any, tensors: Sequence[torch.Tensor], deadline: float
    ) -> bool:
        """Adopt one downloaded state if it is the one ``sources`` announce; refuse its sender if it lied."""
        peer = self.peer
        facts = await peer.compute.run(self._inspect, metadata, tensors)
        verdict = check_downloaded_state(sources, *facts)
        if verdict.moved_on:
            verdict = await self._judge_once_announced(facts, verdict, deadline)
        if verdict.accept:
            try:
                await self._adopt(metadata, tensors, source=source, source_id=source)
                return True
            except ValueError as e:
                verdict = StateVerdict(False, reason=str(e))
        if verdict.distrust:
            logger.warning(f"stage {peer.stage}: refusing the state downloaded from {source}: {verdict.reason}")
            self._refuse(source, verdict.reason)
        else:  # a stream cut short, or a replica that stepped since it announced: nobody lied
            logger.info(f"stage {peer.stage}: not adopting the state downloaded from {source}: {verdict.reason}")
            if verdict.moved_on:
                self.moved_on.add(source)
        return False

    async def _fetch(self, peer_ids: List[str], deadline: float) -> Optional[Tuple[str, Any, List[torch.Tensor]]]:
        peer = self.peer
        future = served(peer.averager, "averager").load_state_from(
            peer_ids, timeout=peer.config.state_download_timeout_s, max_bytes=self._max_state_bytes(), wait=False
        )
        try:
            return await asyncio.wait_for(future, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as e:
            logger.warning(f"state download failed: {type(e).__name__}: {e}")
            return None

    def _inspect(self, metadata: Any, tensors: Sequence[Any]) -> StateFacts:
        """The facts of a downloaded state. Runs on the compute thread: it hashes the parameters."""
        params = served(self.peer.runner, "runner").params
        complete = _fits(params, tensors)
        all_finite = complete and not non_finite_indices(tensors)
        digest = parameter_digest(tensors[: len(params)]) if complete else ""
        return StateFacts(complete, all_finite, _state_step(metadata, served(self.peer.stage, "stage")), digest)

    async def _judge_once_announced(self, facts: StateFacts, verdict: StateVerdict, deadline: float) -> StateVerdict:
        """Judge a state that passed the step its source announced against the records once they announce its
        step, instead of downloading it again: records lag a replica by up to an announce period, and on a slow
        link a state takes far longer to download than that. Waits at most ``CATCH_UP_PERIODS`` announce
        periods; returns ``verdict`` if the majority moved past the state's step or never announced it. A state
        the majority announces another digest for at its step is left, not held against its sender (an honest
        replica may have averaged that step with a minority of the stage)."""
        config, step = self.peer.config, facts.step
        if step is None:  # a state whose metadata names no step never passed the step its source announced
            return verdict
        until = min(deadline, time.monotonic() + CATCH_UP_PERIODS * config.announce_period_s)
        while time.monotonic() < until:
            await asyncio.sleep(config.poll_period_s)
            sources = self._sources(await self.peer.fetch_records(ask=True))
            if not sources.peer_ids or sources.step < step:
                continue
            if sources.step > step:
                return verdict
            again = check_downloaded_state(sources, *facts)
            if again.accept:
                return again
            return StateVerdict(
                False,
                reason=f"the stage's replicas announce another state at its step {step} ({again.reason})",
                moved_on=True,
            )
        return verdict

    def _max_state_bytes(self) -> int:
        """Twice the bytes of the stage's state, plus room for framing: a replica sending more is refused."""
        params = served(self.peer.runner, "runner").params
        return 2 * 3 * sum(p.numel() * p.element_size() for p in params) + 2**20

    def _refuse(self, peer_id: str, why: str) -> None:
        self._refused[peer_id] = time.monotonic() + DISTRUST_S
        if self.peer.steps is not None:
            self.peer.steps.distrust([peer_id], f"it served a state other than the one it announces ({why})")

    def _refused_now(self) -> Set[str]:
        now = time.monotonic()
        self._refused = {p: until for p, until in self._refused.items() if until > now}
        return set(self._refused)

    def _all_refused(self, others: Sequence[PeerRecord]) -> bool:
        refused = self._refused_now()
        return bool(others) and all(r.peer_id in refused for r in others)

    async def leave_stage(self) -> None:
        """Refuse new work, let work in flight and any averaging round finish, then announce 'leaving'."""
        peer = self.peer
        peer.lifecycle.to(PeerState.LEAVING)  # the handlers refuse new work from now on
        if peer.steps is not None:
            peer.steps.room_may_have_changed()  # backwards waiting for room stop waiting
        deadline = time.monotonic() + peer.config.leave_timeout_s
        await peer.compute.wait_idle(peer.config.leave_timeout_s)
        if peer.coordinator_task is not None:
            try:  # the coordinator stops between averaging rounds, never in the middle of one
                await asyncio.wait_for(peer.coordinator_task, timeout=max(0.1, deadline - time.monotonic()))
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                peer.coordinator_task.cancel()
        if peer.runner is not None:
            peer.runner.drop_cached_forwards()
        await peer.announcer.announce()


def _fits(params: Sequence[torch.Tensor], tensors: Sequence[Any]) -> bool:
    """Whether ``tensors`` has the layout of the stage's state (see StageRunner.state_tensors)."""
    num = len(params)
    if len(tensors) != 3 * num + 1 or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    shapes = [p.shape for p in params] + [p.shape for p in params for _ in ("exp_avg", "exp_avg_sq")]
    return all(t.shape == shape for t, shape in zip(tensors, shapes)) and tensors[-1].numel() == 1


def _state_step(metadata: Any, stage: int) -> Optional[int]:
    """The step a downloaded state's metadata names, or None unless it is well formed for ``stage``."""
    if not isinstance(metadata, dict) or metadata.get("stage") != stage:
        return None
    values = [metadata.get(key) for key in ("step", "samples_applied")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return None
    return values[0]
