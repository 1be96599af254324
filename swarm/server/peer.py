"""A stage peer: joins the DHT, serves one stage's forward/backward, steps with its replicas.

:class:`StagePeer` owns the parts its mechanisms share and wires them together; each mechanism lives in
its own module and declares, as a ``Protocol`` next to it, the few things it reads of the peer: the RPC
methods (:mod:`.handlers`), announcing (:mod:`.announcer`), global steps and averaging (:mod:`.steps`,
deciding with :mod:`swarm.policy.steps`), joining and leaving a stage (:mod:`.joining`), checkpoints
(:mod:`.checkpoints`), standing by (:mod:`.slow_replicas`), moving stages (:mod:`.rebalance`) and the
reachability check at start (:mod:`.reachability`). The peer's state is an explicit state machine
(:mod:`.lifecycle`); the only ways a mechanism changes the peer are the lifecycle's transitions, the
compute thread's counters (:mod:`.compute`) and :meth:`StagePeer.claim_stage`.

Threads and processes: the asyncio loop of the peer's main thread runs the RPC handlers, the
announcer and the step coordinator; all torch work runs on one compute thread (so requests queue
instead of competing for cores); the DHT and the averager are hivemind's own processes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_logger

from swarm.dht.agreement import RunFilter, check_run_agreement
from swarm.config.settings import PeerConfig
from swarm.dht.auth import Allowlist
from swarm.dht.node import identity_of, start_run_dht, stop_dht
from swarm.net.direct import DIRECT_SESSION_METHOD, DirectServer, listen_hosts
from swarm.dht.directory import Directory, fresh_for, probe_period_for, settle_for
from swarm.model.footprint import check_peer_fits
from swarm.model.initial_weights import CheckpointSignature, initial_stage_tensors
from swarm.metrics import MetricsServer, PeerSnapshot, peer_families, role_registry, start_metrics_server
from swarm.net.dialing import Dialer, dialer_for
from swarm.net.reachability import DIAL_BACK_METHOD, Verdict, dial_back_handler
from swarm.dht.records import PeerRecord
from swarm.net.rpc import NAMESPACE, RPCServicer, payload_timeout
from swarm.server.announcer import Announcer
from swarm.server.averaging import StageAverager
from swarm.server.batching import BackwardBatcher, ForwardBatcher
from swarm.server.checkpoints import Checkpointer
from swarm.server.compute import ComputeThread
from swarm.server.handlers import COMPRESSED_METHODS, HandlerTable, StageHandlers
from swarm.server.host import served
from swarm.server.joining import Joining
from swarm.server.lifecycle import Lifecycle, PeerState
from swarm.server.progress import PROGRESS_METHOD, StageProgress
from swarm.server.reachability import reach_or_relay
from swarm.server.rebalance import rebalance_loop
from swarm.server.runner import StageRunner
from swarm.server.slow_replicas import StandbyWatch
from swarm.server.steps import BAN_S, StepCoordinator

__all__ = ["StagePeer"]

logger = get_logger(__name__)


class StagePeer:
    """One replica of one stage. Use ``await start()``, then ``await leave()`` (or ``shutdown()``)."""

    # what averages the stage: a factory of StageAverager (an emulated faulty replica changes what it contributes)
    averager_class: Callable[..., StageAverager] = StageAverager
    # what computes the stage: a factory of StageRunner (an emulated slower device sleeps per sample of backward)
    runner_class: Callable[..., StageRunner] = StageRunner

    def __init__(self, config: PeerConfig, dht: Optional[DHT] = None):
        self.config, self.run = config, config.run
        self.dht = dht
        self._same_run = RunFilter(self.run)
        self.run_hash = self._same_run.run_hash
        self.lifecycle = Lifecycle()
        self.stage: Optional[int] = None
        self.runner: Optional[StageRunner] = None
        self.averager: Optional[StageAverager] = None
        self.batcher: Optional[ForwardBatcher] = None
        self.backward_batcher: Optional[BackwardBatcher] = None  # None: backward requests run one per call
        self.steps: Optional[StepCoordinator] = None
        self.directory: Optional[Directory] = None  # the run's stage directories as this peer reads them
        self.dialer: Optional[Dialer] = None  # connects p2pd to stage-mates at the addresses they announce
        self.maddrs: List[str] = []  # the addresses this peer announces
        self.reachability: Optional[Verdict] = None  # whether other machines can reach it, checked at start
        self.coordinator_task: Optional[asyncio.Task] = None
        self.compute = ComputeThread()  # the one thread all torch work runs on
        self.announcer, self.joining, self.checkpoints = Announcer(self), Joining(self), Checkpointer(self)
        self.standby = StandbyWatch(self)  # whether this replica is too slow to be worth routing to
        self.handlers: HandlerTable = StageHandlers(self)  # an emulated faulty replica wraps them (faults.py)
        # the state this replica serves to replicas that download it: the one it holds, unless a fault says otherwise
        self.served_state: Callable[[], Tuple[Dict[str, Any], List[torch.Tensor]]] = self.shared_state
        self._tasks: List[asyncio.Task] = []
        self.metrics_server: Optional[MetricsServer] = None  # with --metrics_port
        self.direct: Optional[DirectServer] = None  # large requests around p2pd; None with --direct_port -1
        self.p2p: Optional[P2P] = None  # the DHT's p2p, which the peer calls other peers through
        self.progress = StageProgress(self)  # stage-mates' records by direct calls (the step protocol's view)

    @property
    def peer_id(self) -> str:
        if self.dht is None:
            raise RuntimeError("the peer has not started: it has no DHT, hence no peer id, yet")
        return str(self.dht.peer_id)

    @property
    def state(self) -> PeerState:
        return self.lifecycle.state

    @property
    def stopping(self) -> asyncio.Event:
        """Set when the peer is leaving the run."""
        return self.lifecycle.stopping

    @property
    def stage_done(self) -> asyncio.Event:
        """Set when the peer is leaving its current stage (to move, or to leave)."""
        return self.lifecycle.stage_done

    @property
    def queued(self) -> int:
        return self.compute.queued

    @property
    def in_flight(self) -> int:
        return self.compute.in_flight

    # ---- lifecycle ----

    async def start(self) -> None:
        torch.set_num_threads(self.config.num_threads)
        if self.config.metrics_port:  # first: a port in use fails the start before anything else began
            self.metrics_server = start_metrics_server(
                self.config.metrics_port, role_registry(self.snapshot, peer_families), self.config.metrics_host
            )
        owns_dht = self.dht is None
        if owns_dht:
            self.dht = start_run_dht(self.config.network, self.run)
        reach = await reach_or_relay(self.dht, self.config.network, self.run, owns_dht)
        self.dht, self.maddrs, self.reachability = reach.dht, reach.maddrs, reach.verdict
        p2p = self.p2p = await self.dht.replicate_p2p()
        self.dialer = dialer_for(p2p)
        self.directory = Directory(
            self.dht,
            self.run.run_id,
            self.run.num_stages,
            home=self.peer_id,
            probe_period_s=probe_period_for(self.config.announce_period_s),
            fresh_s=fresh_for(self.config.expiration_s, self.config.announce_period_s),
            settle_s=settle_for(self.config.announce_period_s),
        )
        stages = self._stages_to_join()
        await self.directory.read(stages)
        if stages is not None and not set(self.directory.records()) - {self.peer_id}:
            await self.directory.read()  # nobody there yet: the run's settings are checked against the other stages
        await check_run_agreement(p2p, self.directory.records(), self.run)
        await self._serve_stage(await self.joining.choose_stage())
        self.servicer = RPCServicer(
            {**self.handlers.table(), DIAL_BACK_METHOD: dial_back_handler(), PROGRESS_METHOD: self.progress.answer},
            max_message_bytes=int(self.config.max_message_mb * 2**20),
            max_requests_per_caller=self.config.max_requests_per_caller,
            max_bytes_per_caller=int(self.config.max_mb_per_caller * 2**20),
            authorize=Allowlist.of(self.run.allowlist).allows,
            compression=self.run.compression,
            block_size=self.run.compression_block_size,
            compress_replies=COMPRESSED_METHODS,
        )
        await self._serve_direct()
        await self.servicer.add_p2p_handlers(p2p, namespace=NAMESPACE)
        self._tasks = [asyncio.create_task(self.announcer.run()), asyncio.create_task(self.standby.run())]
        if self.config.checkpoint_dir:
            self._tasks.append(asyncio.create_task(self.checkpoints.run()))
        if self.config.rebalance:
            self._tasks.append(asyncio.create_task(rebalance_loop(self)))

    def _stages_to_join(self) -> Optional[List[int]]:
        """The stages a joiner reads before it serves: every stage when it chooses one (``--stage auto``), else
        its own and the clock stage, the only ones it reads while it serves (and every stage after all when nobody
        serves those yet, so that its run settings are checked against someone's). Reading every stage costs a
        first probe of each (tens of keys a stage), which at a run's start, when every peer joins at once, is most
        of what the bootstrap serves."""
        if self.config.stage == "auto":
            return None
        return self._stages_read_serving(int(self.config.stage))

    def _stages_read_serving(self, stage: int) -> List[int]:
        """The stages a peer serving ``stage`` reads: its own, and the clock stage, whose replicas tell the step."""
        return sorted({stage, self.run.num_stages - 1})

    async def _serve_direct(self) -> None:
        """Listen for direct calls on the hosts p2pd listens on; a port that cannot be had is logged, and
        every call then goes through p2pd."""
        if self.config.direct_port < 0:
            return
        hosts = listen_hosts(self.config.network.host_maddrs)
        if not hosts:
            return
        direct = DirectServer(self.servicer, hosts, self.config.direct_port, payload_timeout)
        try:
            port = await direct.start()
        except OSError as e:
            direct.close()
            logger.warning(
                f"cannot listen for direct calls on {hosts} port {self.config.direct_port}: {e}; "
                f"every call goes through p2pd"
            )
            return
        self.direct = direct
        self.servicer.handlers[DIRECT_SESSION_METHOD] = direct.session
        logger.info(f"direct calls: listening on {', '.join(hosts)} port {port}")

    def claim_stage(self, stage: int) -> None:
        """Announce-worthy from now on: this peer is joining ``stage``."""
        self.lifecycle.to(PeerState.JOINING)
        self.stage = stage

    async def _serve_stage(self, stage: int) -> None:
        """Take up ``stage``: build its module, get its current state, go online, start stepping."""
        check_peer_fits(self.config, stage)
        self.claim_stage(stage)
        initial = await self.compute.run(self._initial_tensors, stage) if self.config.init_from else None
        self.runner = self.runner_class(
            self.run,
            stage,
            self.config.device,
            forward_cache_bytes=int(self.config.forward_cache_mb * 2**20),
            dtype=self.config.dtype,
            checkpoint_activations=self.config.checkpoint_activations,
            initial=initial,
        )
        del initial  # the module holds the tensors now; no second copy stays alive
        executor = self.compute.executor
        self.batcher = ForwardBatcher(self.runner.forward_per_sample, executor, self.config.max_batch_samples)
        if self.config.merge_backward:
            self.backward_batcher = BackwardBatcher(self.runner.backward_batch, executor, self.config.max_batch_samples)
        self.steps = StepCoordinator(self)
        self.averager = self._make_averager()
        await self.standby.measure_speed()
        await self.announcer.announce()
        await self.joining.join_stage()
        self.lifecycle.to(PeerState.ONLINE)
        self.coordinator_task = asyncio.create_task(self.steps.run())
        await self.announcer.announce()
        logger.info(f"peer {self.peer_id} serves stage {stage} of run {self.run.run_id} at step {self.runner.step}")

    def _initial_tensors(self, stage: int) -> Dict[str, torch.Tensor]:
        """``stage``'s tensors from the local copy of the run's checkpoint (``--init_from``), checked against the
        hashes its manifest signs."""
        run, path = self.run, self.config.init_from
        if path is None or not run.starts_from_checkpoint:
            raise ValueError(
                f"--init_from {path}: run {run.run_id!r} starts from no checkpoint (its organiser gives "
                "one with swarm bootstrap --init_from); leave --init_from out"
            )
        signature = CheckpointSignature(run.init_config_sha256, run.init_stage_digests)
        tensors = initial_stage_tensors(path, run.model, stage, run.num_stages, signature)
        logger.info(f"stage {stage}: loaded {len(tensors)} tensors from {path}, as the manifest signs")
        return tensors

    def _make_averager(self) -> StageAverager:
        config = self.config
        return self.averager_class(
            served(self.runner, "runner").params,
            self.served_state,
            dht=self.dht,
            start=True,
            prefix=f"{self.run.run_id}_stage{self.stage}",
            min_group_size=2,
            # a peer behind NAT is a DHT client, but its stage-mates still reach its averager (through a relay)
            client_mode=False,
            min_matchmaking_time=config.matchmaking_time_s,
            request_timeout=config.matchmaking_time_s / 2,
            allreduce_timeout=config.averaging_timeout_s,
            allow_state_sharing=False,
            # a groupmate that stops sending parts (it gave up, died) fails the round in seconds, not at the timeout
            next_chunk_timeout=min(config.averaging_timeout_s, 3 * config.matchmaking_time_s),
            declare_state_period=config.announce_period_s * 2,
            initial_group_bits="0" * 16,
            allowlist=self.run.allowlist,
            aggregation=self.run.aggregation if self.run.defences else None,
            signing_key=identity_of(self.dht).private_key,
            max_samples=float(self.run.target_batch_size),
            ban_s=BAN_S,
            compression=self.run.gradient_codec,
            block_size=self.run.compression_block_size,
        )

    def snapshot(self) -> PeerSnapshot:
        """This peer's figures now, for metrics and the progress line (any thread: reads only)."""
        runner, steps = self.runner, self.steps
        return PeerSnapshot(
            run_id=self.run.run_id,
            peer_id=self.peer_id if self.dht is not None else "",
            state=self.state,
            stage=self.stage,
            step=runner.step if runner else 0,
            samples_processed=runner.samples_processed if runner else 0,
            samples_applied=runner.samples_applied if runner else 0,
            samples_pending=runner.samples_pending if runner else 0,
            queue_length=self.queued,
            in_flight=self.in_flight,
            throughput=runner.meter.samples_per_s if runner else 0.0,
            forwards=runner.num_forwards if runner else 0,
            recomputed=runner.num_recomputed if runner else 0,
            forward_cache=runner.forward_cache.stats() if runner else {},
            banned_replicas=len(steps.banned_now()) if steps is not None else 0,
            allreduce_bytes=steps.allreduce_bytes if steps is not None else 0,
            dht_nodes_known=self.directory.nodes_known if self.directory is not None else -1,
        )

    def shared_state(self) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
        """The stage's state as this replica holds it (what its checkpoints store): (metadata, tensors)."""
        return served(self.runner, "runner").state()

    async def move_to(self, stage: int) -> None:
        """Leave the current stage gracefully and serve ``stage``, after downloading its state."""
        logger.info(f"rebalancing: moving from stage {self.stage} to stage {stage}")
        await self.joining.leave_stage()
        served(self.averager, "averager").shutdown()
        await self._serve_stage(stage)

    async def leave(self) -> None:
        """Graceful leave (SIGTERM): refuse new work, finish what is in flight, checkpoint, announce, shut down."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if self.lifecycle.online:
            try:
                await self.checkpoints.save()
            except Exception:
                logger.exception("final checkpoint failed")
        await self.joining.leave_stage()
        self.shutdown()

    def shutdown(self) -> None:
        """Stop every task and process the peer started; a second call (after :meth:`leave`) does nothing."""
        if self.state is PeerState.STOPPED:
            return
        self.lifecycle.to(PeerState.STOPPED)
        self.stopping.set()
        for task in self._tasks + ([self.coordinator_task] if self.coordinator_task else []):
            task.cancel()
        if self.averager is not None and self.averager.is_alive():
            self.averager.shutdown()
        self.compute.shutdown()
        stop_dht(self.dht)
        server, self.metrics_server = self.metrics_server, None
        if server is not None:
            server.shutdown()
        if self.direct is not None:
            self.direct.close()

    # ---- shared by the mechanisms ----

    async def fetch_records(
        self,
        ask: bool = False,
        fresh: bool = False,
        every_stage: bool = False,
        tell: bool = False,
        ask_clock: bool = False,
    ) -> Dict[str, PeerRecord]:
        """The run's peer records as this peer sees them; records of peers with other run settings are left out.

        Its own stage and the clock stage (whose replicas tell the step) are read from the DHT at most once an
        announce period (records are stored no more often), the other stages only with ``every_stage`` (to
        rebalance); the records its stage-mates and the clock stage's replicas sent or answered by progress
        calls (:mod:`.progress`) replace the DHT's copies, and with ``ask`` they are asked for them now (with ``tell``
        even those heard from within the poll period: this peer's progress changed; with ``ask_clock`` the clock
        stage's replicas, whatever the clock-watch period). With
        ``fresh`` the stages it reads are read from the DHT now, from every node near their keys (joining: with
        ``every_stage`` too, every stage, to choose one). Connects
        p2pd to the stage-mates it is not connected to yet, at the addresses they announce: averaging and
        state downloads reach them by peer id alone."""
        directory = self.directory
        if directory is None:
            raise RuntimeError("the peer has not started: it has no directory to read")
        period = self.config.announce_period_s
        due = directory.stages_due(None if fresh else period)
        if not (every_stage or self.stage is None):
            due = [stage for stage in due if stage in self._stages_read_serving(self.stage)]
        if due:
            await directory.read(due, whole=fresh)
        records = self._same_run(directory.records())
        if (ask or ask_clock) and self.stage is not None:
            await self.progress.ask(self.progress.whom_to_ask(records, mates=ask, tell=tell, clock_now=ask_clock))
        records = self.progress.merged(records, period)
        if self.dialer is not None:
            await self.dialer.ensure_all(
                r.peer_id for r in records.values() if r.stage == self.stage and r.peer_id != self.peer_id
            )
        return records

    def notify_progress(self) -> None:
        self.lifecycle.notify_progress()

    async def sleep_or_progress(self, waker: Optional[str], period_s: float, min_period_s: float) -> None:
        await self.lifecycle.sleep_or_progress(waker, period_s, min_period_s)
