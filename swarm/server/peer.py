"""A stage peer: joins the DHT, serves one stage's forward/backward, steps with its replicas.

Threads and processes: the asyncio loop of the peer's main thread runs the RPC handlers, the
DHT announcer and the step coordinator; all torch work runs on one compute thread (so requests
queue instead of competing for cores); the DHT and the averager are hivemind's own processes.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import torch
from hivemind import DHT
from hivemind.utils import get_logger

from swarm import PROTOCOL_VERSION
from swarm.config import PeerConfig
from swarm.dht import start_dht
from swarm.dht_io import fetch_records, store_record
from swarm.policy.rebalance import choose_stage_for_new_peer, decide_move, next_period_s, settle_join_choice
from swarm.records import PeerRecord, peers_key, to_peer_infos
from swarm.rpc import NAMESPACE, RemoteError, RPCServicer
from swarm.server.averaging import StageAverager
from swarm.server.batching import ForwardBatcher
from swarm.server.checkpoints import checkpoint_path, load_checkpoint, save_checkpoint
from swarm.server.runner import StageRunner

__all__ = ["StagePeer"]

logger = get_logger(__name__)
CONTRIBUTOR_HISTORY = 64  # completed steps whose group members a peer keeps announcing
FAST_ANNOUNCE_S = 0.05  # announce period (seconds) while a stage nears its global batch


class StagePeer:
    """One replica of one stage. Use ``await start()``, then ``await leave()`` (or ``shutdown()``)."""

    def __init__(self, config: PeerConfig, dht: Optional[DHT] = None):
        self.config, self.run = config, config.run
        self.dht = dht
        self.state = "joining"
        self.stage: Optional[int] = None
        self.runner: Optional[StageRunner] = None
        self.averager: Optional[StageAverager] = None
        self.contributors: Dict[int, List[str]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._queued = 0
        self._in_flight = 0
        self._others_pending = 0  # samples the stage's other replicas hold for our accum_step (last poll)
        self._admitted = 0  # samples of backward requests admitted but not yet accumulated
        self._others_reserved = 0.0  # what the other replicas hold or are about to hold for our step
        # set when gradients arrive: one wakes the announcer, the other the coordinator
        self._progress = {"announce": asyncio.Event(), "coordinate": asyncio.Event()}
        self._tasks: List[asyncio.Task] = []
        self._coordinator: Optional[asyncio.Task] = None
        self._stopping = asyncio.Event()  # the peer is leaving the swarm
        self._stage_done = asyncio.Event()  # the peer is leaving its current stage (to move, or to leave)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    # ---- lifecycle ----

    async def start(self) -> None:
        torch.set_num_threads(self.config.num_threads)
        if self.dht is None:
            self.dht = start_dht(self.config.network)
        stage = await self._choose_stage()
        if self.config.stage == "auto":
            stage = await self._settle_auto_stage(stage)
        await self._serve_stage(stage)
        p2p = await self.dht.replicate_p2p()
        handlers = {"forward": self._rpc_forward, "backward": self._rpc_backward, "info": self._rpc_info,
                    "parameters": self._rpc_parameters}
        self.servicer = RPCServicer(handlers, max_message_bytes=int(self.config.max_message_mb * 2**20))
        await self.servicer.add_p2p_handlers(p2p, namespace=NAMESPACE)
        self._tasks = [asyncio.create_task(self._announce_loop())]
        if self.config.checkpoint_dir:
            self._tasks.append(asyncio.create_task(self._checkpoint_loop()))
        if self.config.rebalance:
            self._tasks.append(asyncio.create_task(self._rebalance_loop()))

    async def _serve_stage(self, stage: int) -> None:
        """Take up ``stage``: build its module, get its current state, go online, start stepping."""
        self.stage, self.state, self.contributors = stage, "joining", {}
        self.runner = StageRunner(self.run, stage, self.config.device, self.config.delay_per_sample_s)
        self.batcher = ForwardBatcher(self.runner.forward, self._executor, self.config.max_batch_samples)
        self.averager = self._make_averager()
        await self._announce()
        await self._join_stage()
        self.state = "online"
        self._stage_done = asyncio.Event()
        self._coordinator = asyncio.create_task(self._coordinate_loop())
        await self._announce()
        logger.info(f"peer {self.peer_id} serves stage {stage} of run {self.run.run_id} at step {self.runner.step}")

    async def _choose_stage(self) -> int:
        if self.config.stage != "auto":
            return int(self.config.stage)
        snapshot = to_peer_infos(await self._peer_records(), self.run.num_stages)
        return choose_stage_for_new_peer(snapshot, self.run.num_stages)

    async def _settle_auto_stage(self, stage: int) -> int:
        """Announce the automatic choice as 'joining', let peers that chose at the same moment
        announce theirs, and give way (see :func:`settle_join_choice`) if one of them got there first."""
        self.stage, self.state = stage, "joining"
        await self._announce()
        await asyncio.sleep(random.uniform(0.5, 1.5))
        snapshot = to_peer_infos(await self._peer_records(), self.run.num_stages)
        settled = settle_join_choice(snapshot, self.peer_id, stage, self.run.num_stages)
        if settled != stage:
            logger.info(f"another peer is joining stage {stage} at the same time; joining stage {settled} instead")
        return settled

    def _make_averager(self) -> StageAverager:
        return StageAverager(
            self.runner.params, self._shared_state, dht=self.dht, start=True,
            prefix=f"{self.run.run_id}_stage{self.stage}", min_group_size=2,
            min_matchmaking_time=self.config.matchmaking_time_s, request_timeout=self.config.matchmaking_time_s / 2,
            allreduce_timeout=self.config.averaging_timeout_s, allow_state_sharing=False,
            # a groupmate that stops sending parts (it gave up, died) fails the round in seconds, not at the timeout
            next_chunk_timeout=min(self.config.averaging_timeout_s, 3 * self.config.matchmaking_time_s),
            declare_state_period=self.config.announce_period_s * 2, initial_group_bits="0" * 16,
        )

    def _shared_state(self):
        return self.runner.state_metadata(), self.runner.state_tensors()

    async def _join_stage(self) -> None:
        """Get the stage's current state before serving: from live replicas if there are any, else
        from this peer's checkpoint; a stage is started from its initialisation only at step 0 (or
        with ``reinitialize``), never silently in the middle of a run."""
        records = await self._peer_records()
        others = [r for r in records.values() if r.stage == self.stage and r.state == "online" and r.peer_id != self.peer_id]
        if others:
            if not await self._download_state():
                raise RuntimeError(f"could not download stage {self.stage} state from any of {len(others)} replicas")
        elif not await self._restore_checkpoint():
            run_step = max((r.step for r in records.values()), default=0)
            if run_step > 0 and not self.config.reinitialize:
                raise RuntimeError(
                    f"stage {self.stage} has no live replica and no checkpoint in {self.config.checkpoint_dir!r}, "
                    f"but the run is at step {run_step}: pass --checkpoint_dir with this stage's checkpoint, or "
                    f"--reinitialize true to restart the stage from scratch")
        self.averager.allow_state_sharing = True

    async def _restore_checkpoint(self) -> bool:
        if not self.config.checkpoint_dir:
            return False
        path = checkpoint_path(self.config.checkpoint_dir, self.run.run_id, self.stage)
        loaded = await asyncio.get_running_loop().run_in_executor(None, load_checkpoint, path, self.run.run_id, self.stage)
        if loaded is None:
            return False
        await self._compute(self.runner.load_state, *loaded)
        logger.info(f"stage {self.stage}: restored from checkpoint {path} at step {self.runner.step}")
        return True

    async def save_checkpoint(self) -> Optional[Path]:
        if not self.config.checkpoint_dir or self.runner is None or self.state != "online":
            return None
        path = checkpoint_path(self.config.checkpoint_dir, self.run.run_id, self.stage)
        metadata, tensors = await self._compute(self._shared_state)
        await asyncio.get_running_loop().run_in_executor(None, save_checkpoint, path, self.run.run_id, metadata, tensors)
        return path

    async def _checkpoint_loop(self) -> None:
        while not self._stopping.is_set():
            await self._sleep_or_progress(None, self.config.checkpoint_period_s, self.config.checkpoint_period_s)
            try:
                await self.save_checkpoint()
            except Exception:
                logger.exception("checkpoint failed")

    # ---- rebalancing ----

    async def _rebalance_loop(self) -> None:
        """Every (jittered) period, ask the shared pure policy whether this peer should move."""
        rng = random.Random(self.peer_id)
        while not self._stopping.is_set():
            if self.runner.meter.samples_per_s <= 0:  # decide on measured throughput only: wait for real work
                await self._sleep_or_progress(None, 0.5, 0.5)
                continue
            await self._sleep_or_progress(None, next_period_s(self.config.rebalance_policy, rng), 0.0)
            if self._stopping.is_set() or self.state != "online":
                continue
            snapshot = to_peer_infos(await self._peer_records(), self.run.num_stages)
            target = decide_move(snapshot, self.peer_id, self.run.num_stages, self.config.rebalance_policy)
            if target is not None and target != self.stage:
                try:
                    await self.move_to(target)
                except Exception:
                    logger.exception(f"moving to stage {target} failed; leaving the swarm")
                    self._stopping.set()

    async def move_to(self, stage: int) -> None:
        """Leave the current stage gracefully and serve ``stage``, after downloading its state."""
        logger.info(f"rebalancing: moving from stage {self.stage} to stage {stage}")
        await self._leave_stage()
        self.averager.shutdown()
        await self._serve_stage(stage)

    async def _leave_stage(self) -> None:
        """Refuse new work, let work in flight and any averaging round finish, then announce 'leaving'."""
        self.state = "leaving"
        self._stage_done.set()
        deadline = time.monotonic() + self.config.leave_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._coordinator is not None:
            try:  # the coordinator stops between averaging rounds, never in the middle of one
                await asyncio.wait_for(self._coordinator, timeout=max(0.1, deadline - time.monotonic()))
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                self._coordinator.cancel()
        await self._announce()

    async def _download_state(self) -> bool:
        deadline = time.monotonic() + self.config.state_download_timeout_s
        while time.monotonic() < deadline:
            future = self.averager.load_state_from_peers(wait=False, timeout=self.config.state_download_timeout_s)
            try:
                loaded = await asyncio.wait_for(future, timeout=self.config.state_download_timeout_s)
            except Exception as e:
                logger.warning(f"state download failed: {type(e).__name__}: {e}")
                loaded = None
            if loaded is not None:
                metadata, tensors = loaded
                try:
                    await self._compute(self.runner.load_state, metadata, tensors)
                except ValueError as e:
                    # hivemind's state stream can end early without an error (a short tensor list);
                    # load_state checks every tensor before touching anything, so just try again
                    logger.warning(f"downloaded state rejected, retrying: {e}")
                    await asyncio.sleep(1.0)
                    continue
                logger.info(f"stage {self.stage}: downloaded state at step {self.runner.step}")
                return True
            await asyncio.sleep(1.0)
        return False

    async def leave(self) -> None:
        """Graceful leave (SIGTERM): refuse new work, finish what is in flight, checkpoint, announce, shut down."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.state == "online":
            try:
                await self.save_checkpoint()
            except Exception:
                logger.exception("final checkpoint failed")
        await self._leave_stage()
        self.shutdown()

    def shutdown(self) -> None:
        for task in self._tasks + ([self._coordinator] if self._coordinator else []):
            task.cancel()
        if self.averager is not None and self.averager.is_alive():
            self.averager.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.dht is not None and self.dht.is_alive():
            self.dht.shutdown()

    # ---- compute ----

    async def _compute(self, fn, *args):
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._queued -= 1

    def _check_request(self, request: Dict[str, Any]) -> None:
        if self.state != "online":
            raise RemoteError(f"peer is {self.state}, not taking new work", "unavailable")
        if request.get("stage") != self.stage:
            raise RemoteError(f"this peer serves stage {self.stage}, not {request.get('stage')!r}", "wrong_stage")
        inputs = request.get("inputs")
        if inputs is not None and getattr(inputs, "ndim", 0) >= 1 and inputs.shape[0] > self.config.max_batch_samples:
            raise ValueError(f"batch of {inputs.shape[0]} samples exceeds this peer's limit of {self.config.max_batch_samples}")

    async def _rpc_forward(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        self._check_request(request)
        inputs, targets = request.get("inputs"), request.get("targets")
        self._in_flight += 1
        try:
            if self.runner.module.is_last:  # a loss per request: not mergeable
                return {"loss": float(await self._compute(self.runner.forward, inputs, targets))}
            self.runner.module.check_inputs(inputs, targets)  # refuse bad requests alone, before merging
            self._queued += 1
            try:
                return {"outputs": await self.batcher.forward(inputs)}
            finally:
                self._queued -= 1
        finally:
            self._in_flight -= 1

    async def _rpc_backward(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        self._check_request(request)
        micro_batch_id = request.get("micro_batch_id")
        if not isinstance(micro_batch_id, str) or not micro_batch_id:
            raise ValueError("backward needs a non-empty string micro_batch_id")
        samples = int(request["inputs"].shape[0]) if isinstance(request.get("inputs"), torch.Tensor) else 0
        self._in_flight += 1
        await self._wait_for_room(samples)
        try:
            grad_inputs, loss, step = await self._compute(
                self.runner.backward, micro_batch_id, request.get("inputs"), request.get("grad_outputs"),
                request.get("targets"))
        finally:
            self._in_flight -= 1
            self._admitted -= samples
        self._notify_progress()
        reply: Dict[str, Any] = {"step": step}
        if grad_inputs is not None:
            reply["grad_inputs"] = grad_inputs
        if loss is not None:
            reply["loss"] = loss
        return reply

    def _notify_progress(self) -> None:
        for event in self._progress.values():
            event.set()

    def _near_target(self) -> bool:
        """Close enough to a global step that progress should travel fast (announce and check often)."""
        return 2 * (self.runner.samples_pending + self._admitted + self._others_reserved) >= self.run.target_batch_size

    def _stage_is_full(self) -> bool:
        pending = self.runner.samples_pending + self._admitted + self._others_reserved
        return pending >= self.run.target_batch_size

    def _must_wait(self) -> bool:
        averaging = self.runner.frozen is not None and not self.config.overlap_averaging
        # only the last stage (the clock) holds gradients back because its batch is full: an earlier
        # stage doing so would hold the very micro-batches whose successors the clock is waiting for
        clock_full = self.stage == self.run.num_stages - 1 and self._stage_is_full()
        return self.state == "online" and (averaging or clock_full)

    async def _wait_for_room(self, samples: int) -> None:
        """Backpressure, bounded in time. Once the stage holds a whole global batch, new gradients wait
        until that step closes, so steps stay close to the target batch size however fast trainers are;
        unless ``overlap_averaging``, they also wait while a step is averaged, so that every gradient is
        computed on the parameters it will update (no staleness)."""
        deadline = time.monotonic() + self.config.averaging_timeout_s
        while self._must_wait() and time.monotonic() < deadline:
            self._notify_progress()
            await asyncio.sleep(0.01)
        self._admitted += samples

    async def _rpc_info(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        return self._record().model_dump(mode="json")

    async def _rpc_parameters(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        """The stage's parameters (to export a trained model, or to check replicas agree); with
        ``gradients: true`` also the mean gradient accumulated so far for the current step."""
        return await self._compute(self.runner.export, bool(request.get("gradients", False)))

    # ---- DHT ----

    def _record(self) -> PeerRecord:
        runner = self.runner
        frozen = runner.frozen.samples if runner is not None and runner.frozen is not None else 0
        return PeerRecord(
            version=PROTOCOL_VERSION, peer_id=self.peer_id, stage=self.stage, state=self.state,
            throughput=runner.meter.samples_per_s if runner else 0.0, queue_length=self._queued,
            step=runner.step if runner else 0, accum_step=runner.accum_step if runner else 0,
            samples_pending=runner.samples_pending if runner else 0, samples_frozen=frozen,
            samples_admitted=self._admitted,
            samples_applied=runner.samples_applied if runner else 0, contributors=dict(self.contributors),
            digest=runner.digest if runner else "", samples_processed=runner.samples_processed if runner else 0,
        )

    async def _announce(self) -> None:
        await store_record(self.dht, peers_key(self.run.run_id), self.peer_id, self._record(), self.config.expiration_s)

    async def _announce_loop(self) -> None:
        """Announce every announce period, and every ``FAST_ANNOUNCE_S`` while the stage nears its
        global batch, so that replicas see each other's progress in time to close steps on target."""
        while not self._stopping.is_set():
            await self._announce()
            if self._near_target():
                await self._sleep_or_progress("announce", FAST_ANNOUNCE_S, FAST_ANNOUNCE_S)
            else:  # far from a step: no need to tell anyone about every backward pass
                await self._sleep_or_progress(None, self.config.announce_period_s, 0.0)

    async def _sleep_or_progress(self, waker: Optional[str], period_s: float, min_period_s: float) -> None:
        """Wait ``period_s``, or less (but at least ``min_period_s``) when gradients arrive; stop on leave."""
        started = time.monotonic()
        events = [self._stopping, self._stage_done] if waker == "coordinate" else [self._stopping]
        if waker is not None:
            self._progress[waker].clear()
            events.append(self._progress[waker])
        waiters = {asyncio.ensure_future(event.wait()) for event in events}
        try:
            await asyncio.wait(waiters, timeout=period_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        remaining = min_period_s - (time.monotonic() - started)
        if remaining > 0 and not self._stopping.is_set():
            await asyncio.sleep(remaining)

    async def _peer_records(self) -> Dict[str, PeerRecord]:
        return await fetch_records(self.dht, peers_key(self.run.run_id), PeerRecord)

    # ---- global steps ----

    async def _coordinate_loop(self) -> None:
        """Every poll period: catch up if behind, and run a global step once the stage has the global batch."""
        while not self._stopping.is_set() and not self._stage_done.is_set():
            try:
                await self._coordinate_once()
            except Exception:
                logger.exception("step coordination failed; retrying")
            waker = "coordinate" if self._near_target() or self.runner.frozen is not None else None
            await self._sleep_or_progress(waker, self.config.poll_period_s, FAST_ANNOUNCE_S)

    async def _coordinate_once(self) -> None:
        records = await self._peer_records()
        others = [r for r in records.values()
                  if r.stage == self.stage and r.peer_id != self.peer_id and r.state == "online"]
        if any(r.step > self.runner.step for r in others) or self._diverged(others):
            logger.info(f"stage {self.stage}: out of sync with the other replicas at step {self.runner.step}; "
                        f"downloading their state")
            await self._download_state()
            return
        mine, share = self.runner.accum_step, self.run.target_batch_size / (len(others) + 1)
        self._others_pending = sum(r.samples_pending for r in others if r.accum_step == mine)
        # admission also counts what others are computing, and reserves a fair share for replicas whose
        # record still shows an older step: they are about to accumulate for this one too
        self._others_reserved = sum(r.samples_pending + r.samples_admitted if r.accum_step == mine else share
                                    for r in others if r.accum_step <= mine)
        if self.runner.frozen is not None or self._step_is_due(records.values(), others):
            await self._global_step(others)

    def _diverged(self, others: List[PeerRecord]) -> bool:
        """Same step, different parameters: the replica with the higher peer id gives way."""
        if self.runner.frozen is not None:
            return False
        return any(r.step == self.runner.step and r.digest and r.digest != self.runner.digest
                   and r.peer_id < self.peer_id for r in others)

    def _step_is_due(self, records, others: List[PeerRecord]) -> bool:
        """The last stage is the swarm's clock: it closes step s once its replicas hold the global
        batch; every other stage closes its own step s as soon as the last stage has finished s.
        So all stages take the same number of steps; micro-batches still in flight between stages
        when a step closes simply count towards the next one (as in SWARM)."""
        if any(r.accum_step > self.runner.accum_step for r in others):
            return True  # another replica already froze our current step and waits for us to average it
        last = self.run.num_stages - 1
        if self.stage == last:
            return self.runner.samples_pending + self._others_pending >= self.run.target_batch_size
        clock = [r.step for r in records if r.stage == last and r.state in ("online", "leaving")]
        return bool(clock) and max(clock) > self.runner.accum_step

    async def _global_step(self, online: List[PeerRecord]) -> None:
        frozen = await self._compute(self.runner.freeze)
        if not online:
            await self._apply(frozen.mean_grads, frozen.samples, [self.peer_id])
            return
        gather = {"step": frozen.step, "samples": frozen.samples, "peer_id": self.peer_id}
        started = time.monotonic()
        logger.info(f"stage {self.stage}: averaging step {frozen.step} ({frozen.samples} local samples) "
                    f"with {len(online)} other replicas")
        result = await self.averager.average(
            frozen.step, frozen.mean_grads, frozen.samples, gather, matchmaking_timeout=3 * self.config.matchmaking_time_s,
            timeout=self.config.averaging_timeout_s)
        logger.info(f"stage {self.stage}: averaging step {frozen.step} {'failed' if result is None else 'done'} "
                    f"after {time.monotonic() - started:.2f}s")
        if result is None:
            return  # the frozen step stays; the next poll retries, resyncs if others moved on, or steps alone
        averaged, gathered = result
        steps = {data.get("step") for data in gathered.values() if isinstance(data, dict)}
        if steps != {frozen.step}:
            logger.warning(f"stage {self.stage}: group gathered mismatched steps {steps}; dropping this round")
            return
        total = sum(int(data.get("samples", 0)) for data in gathered.values())
        await self._apply(averaged, total, sorted(gathered))

    async def _apply(self, mean_grads, total_samples: int, members: List[str]) -> None:
        step = self.runner.frozen.step
        await self._compute(self.runner.apply, mean_grads, total_samples)
        self.contributors[step] = members
        for old in sorted(self.contributors)[:-CONTRIBUTOR_HISTORY]:
            del self.contributors[old]
        logger.info(f"stage {self.stage}: global step {step + 1} with {total_samples} samples from {len(members)} replicas")
        await self._announce()
