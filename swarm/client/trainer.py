"""A trainer: draws micro-batches, keeps several in flight through the swarm, accounts for them.

Runs in one asyncio loop: ``max_in_flight`` workers each push micro-batches through
:class:`PipelineClient`; a refresher reads the records of ``stages_per_refresh`` stages from the DHT every
``refresh_period_s`` (those where a call failed, at once, then those read longest ago) and keeps the rest
(:mod:`swarm.client.view`), feeds the router, and every ``SETTLE_PERIOD_S`` settles the ledger with what the
records and the replicas' replies (:mod:`swarm.dht.ledger_fields`) say: it re-sends contributions that
were lost and, in the background, asks a stage's replicas which peers a step averaged when the
replica that took a contribution can no longer say. No reply, and no failure of one
micro-batch, ends the trainer: a worker logs the failure and goes on with the next one.
With the run's defences on, a :class:`ReplyVerifier` spot-checks replies on other replicas, publishes
accusations of replicas it outvotes, and every ``ACCUSATIONS_PERIOD_S`` (or refresh period) reads other
trainers' accusations.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Union

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from swarm import PROTOCOL_VERSION
from swarm.dht.agreement import RunFilter, check_run_agreement
from swarm.client.attacks import TrainerAttack
from swarm.client.ledger import Contribution, Ledger, LedgerPolicy, StepKey, parse_step_members
from swarm.client.pipeline import PipelineClient, StageUnavailable, Unauthorized
from swarm.client.verification import ReplyVerifier
from swarm.client.view import held_records, with_replies
from swarm.config.settings import PeerConfig, TrainerConfig
from swarm.training.data import Corpus, load_corpus, load_hf_dataset, validation_batches
from swarm.training.tokenized import TokenizedCorpus, load_tokenized_corpus, make_sampler
from swarm.training.tokenizer import load_run_tokenizer
from swarm.dht.node import start_run_dht, stop_dht
from swarm.dht.directory import Directory, fresh_for, probe_period_for, settle_for
from swarm.dht.ledger_fields import ledger_order, with_ledger_fields
from swarm.dht.store import fetch_records, store_record
from swarm.metrics import MetricsServer, TrainerSnapshot, role_registry, start_metrics_server, trainer_families
from swarm.policy.aggregation import banned_by_majority
from swarm.policy.directory import stages_to_read
from swarm.policy.routing import Router
from swarm.policy.snapshot import PeerInfo
from swarm.policy.steps import clock_step
from swarm.policy.verification import VerificationPolicy
from swarm.dht.records import (
    AccusationRecord,
    PeerRecord,
    TrainerRecord,
    accusations_key,
    excluded_by,
    to_peer_infos,
    trainers_key,
)
from swarm.net.rpc import RemoteError, call_peer

__all__ = ["Trainer", "TrainerMetrics", "load_trainer_corpus"]

logger = get_logger(__name__)
LOST_AFTER_GRACES = 4  # a gone replica whose step nobody knows is taken as lost after this many peer_grace_s
MEMBERS_TIMEOUT_S = 5.0  # seconds one step_members call may take
_NO_ANSWER = object()  # a replica that did not answer step_members (as opposed to "unknown step": None)
ACCUSATIONS_PERIOD_S = 5.0  # seconds between reads of the run's accusations, at least (refresh_period_s if longer)
STALE_REFRESH_GAP_S = 2.0  # seconds at least between two refreshes (a failed call asks for one at once)
LEDGER_FULL_WARNING_S = 60.0  # seconds at least between two warnings that the ledger's bound holds the workers
SETTLE_PERIOD_S = 5.0  # seconds between settlings of the ledger with the replies' ledger fields, between DHT reads
ACCUSATION_EXPIRATION_S = 300.0  # seconds an accusation stays in the DHT


def load_trainer_corpus(config: TrainerConfig) -> Union[Corpus, TokenizedCorpus]:
    """Byte tokens; or, in a run that names a tokenizer, its token ids, tokenized ahead in a background thread."""
    max_bytes = None if config.max_data_mb is None else int(config.max_data_mb * 2**20)
    run = config.run
    if run.tokenizer_sha256:
        tokenizer = load_run_tokenizer(
            config.tokenizer, run.tokenizer_sha256, run.model.vocab_size, config.tokenizer_cache_dir
        )
        return load_tokenized_corpus(
            tokenizer,
            run.model.seq_len,
            config.trainer_seed,
            config.data or None,
            hf_dataset=config.hf_dataset,
            max_bytes=max_bytes,
        )
    if config.hf_dataset:
        return load_hf_dataset(config.hf_dataset, max_bytes=max_bytes)
    return load_corpus(config.data or None, max_bytes=max_bytes)


@dataclass
class TrainerMetrics:
    """What a trainer has done so far; ``losses`` holds (samples sent so far, micro-batch loss)."""

    samples_sent: int = 0
    micro_batches_failed: int = 0
    losses: List[Tuple[int, float]] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    _window: List[Tuple[float, int]] = field(default_factory=list)

    def record(self, samples: int, loss: float) -> None:
        self.samples_sent += samples
        self.losses.append((self.samples_sent, loss))
        now = time.monotonic()
        self._window.append((now, self.samples_sent))
        while len(self._window) > 2 and now - self._window[0][0] > 30.0:
            self._window.pop(0)

    @property
    def samples_per_s(self) -> float:
        if len(self._window) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def recent_loss(self, count: int = 20) -> Optional[float]:
        recent = [loss for _, loss in self.losses[-count:]]
        return sum(recent) / len(recent) if recent else None


class Trainer:
    """Use ``await start()``, then ``await train()``, ``await drain()``, and ``shutdown()``."""

    def __init__(
        self, config: TrainerConfig, dht: Optional[DHT] = None, corpus: Optional[Union[Corpus, TokenizedCorpus]] = None
    ):
        self.config, self.run = config, config.run
        self.dht, self.corpus = dht, corpus
        self.metrics = TrainerMetrics()
        self._same_run = RunFilter(self.run)
        self.ledger = Ledger(LedgerPolicy(config.peer_grace_s, LOST_AFTER_GRACES * config.peer_grace_s))
        self.records: Dict[str, PeerRecord] = {}  # what the trainer knows: the records held, with the replies' fields
        self._announced: Dict[str, PeerRecord] = {}  # the records as read, held past expiry for stages not read since
        # peer id -> (the stage it replied for, the ledger fields its newest backward reply carried)
        self._replied: Dict[str, Tuple[int, Dict[str, Any]]] = {}
        self._urgent: Set[int] = set()  # stages where a call failed since they were last read
        self._bad_replies: Set[str] = set()  # peers whose replies carried malformed ledger fields (warned once)
        self._warned_full_at = -math.inf  # when the workers' wait for commits was last explained in the log
        self.directory: Optional[Directory] = None  # the run's stage directories as this trainer reads them
        self._snapshot: Tuple[PeerInfo, ...] = ()
        self._shunned: Set[str] = set()  # replicas most of whose stage-mates banned them from averaging
        self._refresh_now = asyncio.Event()
        self._settled = asyncio.Event()  # set each time the ledger was settled against the records
        # set by drain(): workers draw no new micro-batch, even one whose cancellation a finished call swallowed
        # (asyncio.wait_for on Python 3.11 returns the result of a call that completed as it was cancelled)
        self._draining = False
        self._sampling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-sampling")
        self._resending: Set[Tuple[str, int]] = set()
        self._asking: Set[StepKey] = set()
        # (peer id, stage) -> when the trainer's view (records read or held, replies laid over them) last showed
        # that peer online at that stage
        self._last_serving: Dict[Tuple[str, int], float] = {}
        # (stage, step) -> (when asked, {replica: the step's members, or None if it did not know the step})
        self._members: Dict[StepKey, Tuple[float, Dict[str, Optional[FrozenSet[str]]]]] = {}
        self._tasks: List[asyncio.Task] = []
        self.metrics_server: Optional[MetricsServer] = None  # with --metrics_port
        # a random start, so that a restarted trainer with the same identity never reuses a micro-batch id
        self._ids = itertools.count(secrets.randbits(64))
        self.attack = TrainerAttack(config.attack, config.trainer_seed)  # honest unless emulating a poisoner

    @property
    def trainer_id(self) -> str:
        if self.dht is None:
            raise RuntimeError("the trainer has not started: it has no DHT, hence no peer id, yet")
        return str(self.dht.peer_id)

    async def start(self) -> None:
        if self.config.metrics_port:  # first: a port in use fails the start before anything else began
            self.metrics_server = start_metrics_server(
                self.config.metrics_port, role_registry(self.snapshot, trainer_families), self.config.metrics_host
            )
        if self.dht is None:
            # a DHT client unless told otherwise: a trainer behind NAT could not answer other nodes' requests
            self.dht = start_run_dht(self.config.network, self.run, client_mode=not self.config.serve_dht)
        if self.corpus is None:
            self.corpus = await asyncio.get_running_loop().run_in_executor(None, load_trainer_corpus, self.config)
        self.sampler = make_sampler(
            self.corpus, self.run.model.seq_len, self.config.batch_size, seed=self.config.trainer_seed
        )
        p2p = await self.dht.replicate_p2p()
        await check_run_agreement(p2p, await self._fetch_records(strict=False), self.run)
        self.client = PipelineClient(
            p2p,
            self.run.num_stages,
            lambda: self._snapshot,
            Router(seed=self.config.trainer_seed, slow_tolerance=self.config.slow_replica_tolerance or math.inf),
            self.ledger,
            model=self.run.model,
            forward_timeout_s=self.config.forward_timeout_s,
            backward_timeout_s=self.config.backward_timeout_s,
            max_retries=self.config.max_retries,
            on_stale_snapshot=self._on_stale,
            on_ledger_fields=self._on_ledger_fields,
            compression=self.run.compression,
            block_size=self.run.compression_block_size,
        )
        self.client.attack = self.attack
        verifier: Optional[ReplyVerifier] = None
        if self.run.defences:
            verifier = self.client.verifier = ReplyVerifier(
                self.client,
                VerificationPolicy(verify_fraction=self.config.verify_fraction),
                self.trainer_id,
                announced_steps=self._announced_steps,
                publish=self._publish_accusation,
                seed=self.config.trainer_seed,
            )
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._refresh_loop()))
        if verifier is not None:
            self._tasks.append(asyncio.create_task(self._accusations_loop(verifier)))

    async def refresh(self, stages: Optional[Sequence[int]] = None) -> None:
        """Read the records of ``stages`` from the DHT (default: those where a call failed, then those read
        longest ago, ``stages_per_refresh`` in all), keep those of the others, and settle the ledger.

        A failed read keeps the previous snapshot; a peer counts as gone only once it has been
        missing from every read for ``peer_grace_s`` (a live peer's record can lapse for a moment)."""
        if stages is None:
            stages = self._stages_due()
        try:
            fresh = await self._fetch_records(strict=True, stages=stages)
        except LookupError:
            return
        self._urgent.difference_update(stages)
        self._announced = held_records(self._announced, fresh, stages)
        self._update_view(time.monotonic())

    def _stages_due(self) -> List[int]:
        if self.directory is None:
            return list(range(self.run.num_stages))
        read_at = [known.read_at for known in self.directory.stages]
        return stages_to_read(read_at, self.config.stages_per_refresh, self._urgent)

    def _update_view(self, now: float) -> None:
        """Lay the replies' ledger fields over the records held, route by the result and settle the ledger."""
        self._replied = {peer_id: entry for peer_id, entry in self._replied.items() if peer_id in self._announced}
        self.records = with_replies(self._announced, self._replied)
        self._snapshot = to_peer_infos(self._routable(self.records), self.run.num_stages)
        self._settle(now)

    def _on_stale(self, stage: int) -> None:
        """A call to ``stage`` found a dead, moved or missing peer: read that stage at the next refresh, now."""
        self._urgent.add(stage)
        self._refresh_now.set()

    def _on_ledger_fields(self, peer_id: str, stage: int, fields: Any) -> None:
        """Keep the newest ledger fields a replica's reply carried; malformed ones are ignored (the replica's
        record still tells the ledger what it needs, later)."""
        record = self._announced.get(peer_id)
        if record is None or record.stage != stage:
            return  # a peer not read at that stage yet: its fields have no record to go on
        try:
            with_ledger_fields(record, fields)
        except ValueError as e:
            if peer_id not in self._bad_replies:
                self._bad_replies.add(peer_id)
                logger.warning(f"ignoring the ledger fields in replies of {peer_id} (stage {stage}): {e}")
            return
        current = self._replied.get(peer_id)
        if current is None or current[0] != stage or ledger_order(fields) >= ledger_order(current[1]):
            self._replied[peer_id] = (stage, dict(fields))

    def snapshot(self) -> TrainerSnapshot:
        """This trainer's figures now, for metrics (any thread: reads only)."""
        m, run = self.metrics, self.run
        records = list(self.records.values())
        last = run.num_stages - 1
        steps = [r.step for r in records if r.stage == last and r.state == "online"]
        client = getattr(self, "client", None)  # made by start()
        now = time.monotonic()
        banned = 0 if client is None else sum(client.router.is_banned(r.peer_id, now) for r in records)
        return TrainerSnapshot(
            run_id=run.run_id,
            trainer_id=self.trainer_id if self.dht is not None else "",
            samples_sent=m.samples_sent,
            micro_batches_failed=m.micro_batches_failed,
            resent=self.ledger.num_resent,
            uncommitted=len(self.ledger),
            samples_committed=dict(self.ledger.samples_committed),
            loss=m.recent_loss(),
            samples_per_s=m.samples_per_s,
            tokens_per_s=m.samples_per_s * run.model.seq_len,
            global_step=max(steps, default=0),
            banned_peers=banned,
        )

    def _routable(self, records: Dict[str, PeerRecord]) -> Dict[str, PeerRecord]:
        """The records minus replicas that most of their stage-mates banned from averaging: such a replica
        would take work whose gradients never reach the stage's parameters."""
        if not self.run.defences:
            return records
        shunned: Set[str] = set()
        for stage in range(self.run.num_stages):
            shunned |= banned_by_majority(excluded_by(records, stage))
        for peer_id in sorted(shunned - self._shunned):
            logger.warning(f"not routing to peer {peer_id}: most of its stage-mates banned it from averaging")
        self._shunned = shunned
        return {key: record for key, record in records.items() if record.peer_id not in shunned}

    async def _fetch_records(self, strict: bool, stages: Optional[Sequence[int]] = None) -> Dict[str, PeerRecord]:
        """The run's peer records after a read of ``stages`` (default: all); peers that announce other run settings
        are left out."""
        if self.directory is None:
            self.directory = Directory(
                self.dht,
                self.run.run_id,
                self.run.num_stages,
                home=self.trainer_id,
                # a stage is read once in ceil(stages / stages_per_refresh) refreshes: a probe every so many of its reads
                probe_period_s=probe_period_for(
                    self.config.refresh_period_s * math.ceil(self.run.num_stages / self.config.stages_per_refresh)
                ),
                # the peers' periods are theirs to set: the defaults' margin. A DHT client keeps no values, so
                # its first fresh answer is another node's whole copy; a node that serves the DHT answers from its
                # own copy, whole only once every owner re-stored to it
                fresh_s=fresh_for(PeerConfig.expiration_s, PeerConfig.announce_period_s),
                settle_s=settle_for(PeerConfig.announce_period_s) if self.config.serve_dht else 0.0,
            )
        await self.directory.read(stages, timeout=min(self.config.refresh_period_s * 5, 10.0), strict=strict)
        return self._same_run(self.directory.records())

    def _settle(self, now: float) -> None:
        """Commit what the records confirm; start re-sends and step_members questions (never awaited here).

        A replica that most of its stage-mates banned counts as gone: its own steps do not reach the
        stage's parameters, so only what the others say of its steps decides (usually: re-send)."""
        records = {key: record for key, record in self.records.items() if record.peer_id not in self._shunned}
        for record in records.values():
            if record.state == "online":
                self._last_serving[(record.peer_id, record.stage)] = now
        holders = self.ledger.holders()
        for key in holders:
            self._last_serving.setdefault(key, now)  # a holder never seen online is timed from now
        present = {(record.peer_id, record.stage) for record in records.values()}
        self._last_serving = {key: seen for key, seen in self._last_serving.items() if key in holders or key in present}
        # answers expire: a step nobody knew may be known now, and a replica may have changed its mind
        self._members = {
            key: entry for key, entry in self._members.items() if now - entry[0] < self.config.peer_grace_s
        }
        resolution = self.ledger.resolve(
            records,
            {key: now - seen for key, seen in self._last_serving.items()},
            {key: answers for key, (_, answers) in self._members.items()},
        )
        self._settled.set()  # the ledger may have shrunk: workers waiting for room look again
        for item in resolution.resend:
            key = (item.micro_batch_id, item.stage)
            if key not in self._resending:
                self._resending.add(key)
                asyncio.create_task(self._resend(item, key))
        for step_key in resolution.ask - self._asking:
            self._asking.add(step_key)
            asyncio.create_task(self._ask_members(step_key))

    async def _resend(self, item: Contribution, key: Tuple[str, int]) -> None:
        try:
            await self.client.backward(item, resend=True)
            logger.info(f"re-sent {item.micro_batch_id} ({item.samples} samples) to stage {item.stage}")
        except Exception as e:  # a stage without live replicas, a timeout: the next refresh tries again
            logger.warning(f"re-sending {item.micro_batch_id} to stage {item.stage} failed, will retry: {e}")
        finally:
            self._resending.discard(key)

    async def _ask_members(self, key: StepKey) -> None:
        """Ask every online replica of the stage which peers step ``key[1]`` averaged."""
        stage, step = key
        replicas = sorted(r.peer_id for r in self.records.values() if r.stage == stage and r.state == "online")
        try:
            results = await asyncio.gather(*(self._step_members(peer_id, stage, step) for peer_id in replicas))
            self._members[key] = (
                time.monotonic(),
                {peer_id: result for peer_id, result in zip(replicas, results) if result is not _NO_ANSWER},
            )
            self._refresh_now.set()
        finally:
            self._asking.discard(key)

    async def _step_members(self, peer_id: str, stage: int, step: int):
        """The members one replica reports for the step, None if it does not know the step, or ``_NO_ANSWER``."""
        try:
            reply = await call_peer(
                self.client.p2p,
                PeerID.from_base58(peer_id),
                "step_members",
                {"stage": stage, "step": step},
                timeout=MEMBERS_TIMEOUT_S,
            )
            return parse_step_members(reply, step)
        except RemoteError as e:
            if e.kind == "bad_request":  # "unknown step": it never applied it, or forgot it
                return None
            logger.info(f"step_members of stage {stage} step {step} from {peer_id} failed: {e.kind}: {e}")
        except ValueError as e:
            logger.warning(f"ignoring step_members reply of {peer_id} for stage {stage} step {step}: {e}")
        except Exception as e:  # timeouts, dead peers
            logger.info(f"step_members of stage {stage} step {step} from {peer_id} failed: {type(e).__name__}: {e}")
        return _NO_ANSWER

    async def _refresh_loop(self) -> None:
        """Refresh every ``refresh_period_s``, and at once when a call found the snapshot stale (a dead or moved
        peer), but no sooner than ``STALE_REFRESH_GAP_S`` after the last: a burst of failed calls is one read.
        Between refreshes, settle the ledger with the replies' ledger fields every ``SETTLE_PERIOD_S``."""
        period = self.config.refresh_period_s
        gap, refreshed_at = min(STALE_REFRESH_GAP_S, period), time.monotonic()
        while True:
            due = refreshed_at + period
            try:
                await asyncio.wait_for(self._refresh_now.wait(), max(0.0, min(SETTLE_PERIOD_S, due - time.monotonic())))
            except asyncio.TimeoutError:
                pass
            if not self._refresh_now.is_set() and time.monotonic() < due:
                try:
                    self._update_view(time.monotonic())
                except Exception:
                    logger.exception("settling the ledger with the replies' ledger fields failed")
                continue
            wait = refreshed_at + gap - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._refresh_now.clear()
            refreshed_at = time.monotonic()
            try:
                await self.refresh()
            except Exception:
                logger.exception("refreshing the swarm snapshot failed")

    def _clock_step(self) -> Optional[int]:
        """The steps the clock stage (the last) has applied, as its replicas announce them; None if none is online."""
        steps = self._announced_steps(self.run.num_stages - 1)
        return clock_step(steps) if steps else None

    def _announced_steps(self, stage: int) -> List[int]:
        return [r.step for r in self.records.values() if r.stage == stage and r.state == "online"]

    async def _publish_accusation(self, record: AccusationRecord) -> None:
        await store_record(self.dht, accusations_key(self.run.run_id), record, expiration_s=ACCUSATION_EXPIRATION_S)

    async def _accusations_loop(self, verifier: ReplyVerifier) -> None:
        """Read the run's accusations now and every ``ACCUSATIONS_PERIOD_S`` (or refresh period, if longer);
        ``verifier`` judges them."""
        period = max(ACCUSATIONS_PERIOD_S, self.config.refresh_period_s)
        while True:
            try:
                accusations = await fetch_records(
                    self.dht, accusations_key(self.run.run_id), AccusationRecord, timeout=ACCUSATIONS_PERIOD_S
                )
                verifier.consider(accusations, time.monotonic())
            except Exception:
                logger.exception("reading the run's accusations failed")
            await asyncio.sleep(period)

    def _done(self, deadline: float) -> bool:
        max_samples = self.config.max_samples
        return (
            self._draining
            or (max_samples is not None and self._reserved >= max_samples)
            or time.monotonic() >= deadline
        )

    async def train(self, on_progress: Optional[Callable[["Trainer"], None]] = None) -> TrainerMetrics:
        """Train until max_samples were sent or duration_s passed; returns the metrics."""
        self._reserved, self._draining = 0, False
        held = self.config.max_uncommitted * self.config.batch_size
        if self.run.target_batch_size > held:
            logger.warning(
                f"the run's global batch ({self.run.target_batch_size} samples) is more than this trainer holds "
                f"unconfirmed (max_uncommitted {self.config.max_uncommitted} x batch_size {self.config.batch_size} = "
                f"{held} samples): unless other trainers send the rest, no global step closes and this trainer stops "
                f"once it holds {held}; raise --max_uncommitted (memory: every stage's inputs of each micro-batch)"
            )
        deadline = time.monotonic() + (self.config.duration_s if self.config.duration_s is not None else math.inf)
        reporter = asyncio.create_task(self._report_loop(on_progress))
        try:
            await asyncio.gather(*(self._worker(deadline) for _ in range(self.config.max_in_flight)))
        finally:
            reporter.cancel()
        await self._publish()
        return self.metrics

    async def _wait_for_commits(self, deadline: float) -> None:
        """Memory bound: the ledger keeps each stage's input of every unconfirmed micro-batch, so stop
        drawing new ones while ``max_uncommitted`` micro-batches await their global step."""
        while len(self.ledger) >= self.config.max_uncommitted * self.run.num_stages and time.monotonic() < deadline:
            now = time.monotonic()
            if now - self._warned_full_at >= LEDGER_FULL_WARNING_S:
                self._warned_full_at = now
                logger.warning(
                    f"waiting for global steps: {self.config.max_uncommitted} micro-batches await theirs "
                    f"(max_uncommitted); no new one is drawn until the stages apply a step that holds them"
                )
            self._settled.clear()
            try:
                await asyncio.wait_for(self._settled.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return

    async def _worker(self, deadline: float) -> None:
        """Push micro-batches until done; a micro-batch that fails for any reason is logged, counted and
        given up (its samples are drawn again later), and the worker backs off a little and goes on."""
        consecutive_failures = 0
        while not self._done(deadline):
            await self._wait_for_commits(deadline)
            batch = self.config.batch_size
            if self.config.max_samples is not None:
                batch = min(batch, self.config.max_samples - self._reserved)
            self._reserved += batch
            # drawn off the event loop (a tokenized corpus may make it wait for text), on one thread, in order
            inputs, targets = await asyncio.get_running_loop().run_in_executor(self._sampling, self.sampler.sample)
            inputs, targets = inputs[:batch], self.attack.targets(targets[:batch])
            micro_batch_id = f"{self.trainer_id}:{next(self._ids)}"
            try:
                loss = await self.client.train_step(micro_batch_id, inputs, targets)
            except Exception as e:  # never asyncio.CancelledError: that is a BaseException
                self._reserved -= batch
                self.metrics.micro_batches_failed += 1
                consecutive_failures += 1
                expected = isinstance(e, (StageUnavailable, Unauthorized))  # anything else is a bug: show where
                logger.warning(f"micro-batch {micro_batch_id} failed: {type(e).__name__}: {e}", exc_info=not expected)
                await asyncio.sleep(min(0.5 * 2 ** min(consecutive_failures - 1, 4), 5.0))
                continue
            consecutive_failures = 0
            self.metrics.record(batch, loss)

    async def _report_loop(self, on_progress: Optional[Callable[["Trainer"], None]]) -> None:
        """A progress line every ``log_period_s``; the trainer's DHT record (what dashboards show) every
        ``refresh_period_s`` if that is longer: a store costs the DHT nodes that keep it as much as the trainer."""
        published_at = -math.inf
        while True:
            await asyncio.sleep(self.config.log_period_s)
            if on_progress is not None:
                on_progress(self)
            if time.monotonic() - published_at >= self.config.refresh_period_s - self.config.log_period_s / 2:
                published_at = time.monotonic()
                await self._publish()

    async def _publish(self) -> None:
        loss = self.metrics.recent_loss()
        record = TrainerRecord(
            version=PROTOCOL_VERSION,
            trainer_id=self.trainer_id,
            samples_sent=self.metrics.samples_sent,
            loss=loss if loss is not None and math.isfinite(loss) else None,
            samples_per_s=self.metrics.samples_per_s,
            tokens_per_s=self.metrics.samples_per_s * self.run.model.seq_len,
        )
        period = max(self.config.log_period_s, self.config.refresh_period_s)
        await store_record(self.dht, trainers_key(self.run.run_id), record, expiration_s=max(30.0, 3 * period))

    async def evaluate(self, num_batches: int = 4, batch_size: int = 16) -> float:
        """Validation loss through the swarm (forward only), on a fixed set of held-out windows."""
        if self.corpus is None:
            raise RuntimeError("the trainer has not started: it has no corpus to evaluate on yet")
        batches = validation_batches(self.corpus.validation, self.run.model.seq_len, batch_size, num_batches)
        losses = [await self.client.evaluate(inputs, targets) for inputs, targets in batches]
        return sum(losses) / len(losses)

    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until nothing needs re-sending: every contribution is committed, or pending at a live replica in
        a step the clock stage has not closed (:meth:`Ledger.all_held`). No new micro-batch is drawn from here on."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # the stages that hold contributions, and the clock stage (whose step says what is still pending)
            await self.refresh(sorted({stage for _, stage in self.ledger.holders()} | {self.run.num_stages - 1}))
            if not self._resending and self.ledger.all_held(self.records, self._clock_step()):
                return True
            await asyncio.sleep(min(self.config.refresh_period_s, 1.0))
        return False

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._sampling.shutdown(wait=False, cancel_futures=True)
        if self.corpus is not None:
            self.corpus.close()  # a tokenized corpus stops its tokenizing thread
        stop_dht(self.dht)
        server, self.metrics_server = self.metrics_server, None
        if server is not None:
            server.shutdown()
