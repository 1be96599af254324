"""Stage-mates' progress, exchanged by direct calls: what the step protocol decides on between DHT reads.

A replica stores its DHT record once an announce period (tens of seconds), far too rarely for the
replicas of a stage to close a step on target, and reading the DHT many times a second would cost every
peer more than the activations it carries. So the step coordinator asks its stage-mates (and, on any
stage but the last, the clock stage's replicas) for their current record with a ``progress`` call, as
often as the step policy says it must look (:func:`swarm.policy.steps.seconds_between_reads`: rarely
far from a step, a few times as the clock stage fills its batch, every :data:`~swarm.policy.steps.FOLLOWER_READ_S`
on the other stages, whose step closes when a trainer's backward call says the clock moved on and the clock's
replicas confirm it). A replica that closes a step tells its stage-mates at once. The call carries the caller's own record, so one call
tells each side of the other, and a replica that just joined is known to the replicas it calls before
its DHT record is read.

A call carries only what the step protocol reads of a record (:data:`PROGRESS_FIELDS`, about 200 bytes),
not the whole signed record: p2pd says who sent it (the calls go through p2pd, which every peer has, so
that a stage's direct channel carries its data alone). It is still a claim,
like a DHT record: the step policy decides how far to believe it. The cost is bounded per read: a replica
does not ask a stage-mate that called it within the poll period (that call told both sides), asks at
most ``MAX_ASKED`` stage-mates (those it heard from longest ago, so a large stage is covered over a few
reads); and on each stage but the last, ``CLOCK_WATCHERS`` replicas ask ``CLOCK_ASKED`` replicas of the
clock stage, whose step is the median of what they answer, and the others follow them; with many stages, each
clock replica less often (:func:`swarm.policy.steps.clock_watch_period_s`). A
replica that does not answer keeps its last known record for ``SILENT_CALLS`` calls in a row, then drops
out of the view; it is asked again once an announce period until it answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Protocol

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger

from swarm.dht.records import PeerRecord
from swarm.net.rpc import RemoteError, call_peer
from swarm.policy.steps import CLOCK_ASKED, CLOCK_WATCH_S, CLOCK_WATCHERS, clock_watch_period_s
from swarm.server.host import CurrentStage, Settings, served

__all__ = [
    "StageProgress",
    "ProgressHost",
    "progress_of",
    "PROGRESS_METHOD",
    "PROGRESS_FIELDS",
    "PROGRESS_TIMEOUT_S",
    "SILENT_CALLS",
    "MAX_HEARD",
    "MAX_ASKED",
]

logger = get_logger(__name__)
PROGRESS_METHOD = "progress"
PROGRESS_TIMEOUT_S = 2.0  # seconds one progress call may take
SILENT_CALLS = 3  # failed calls in a row after which a replica leaves the view until it answers again
MAX_HEARD = 1024  # records remembered from calls (the oldest are forgotten first)
MAX_ASKED = 8  # stage-mates asked per read at most
# what a progress call carries of a record: what the step protocol decides on
PROGRESS_FIELDS = (
    "version",
    "stage",
    "state",
    "step",
    "accum_step",
    "samples_pending",
    "samples_frozen",
    "samples_admitted",
    "digest",
    "excluded",
)


class _Announced(Protocol):
    def record(self) -> PeerRecord: ...


class ProgressHost(Settings, CurrentStage, Protocol):
    """What the progress exchange reads of the peer: its record, its run, the p2p it calls through."""

    run_hash: str
    p2p: Optional[P2P]

    @property
    def announcer(self) -> _Announced: ...

    def notify_progress(self) -> None: ...


def progress_of(record: PeerRecord) -> Dict[str, Any]:
    """What a progress call carries of ``record``."""
    return {name: getattr(record, name) for name in PROGRESS_FIELDS}


@dataclass(frozen=True)
class _Heard:
    record: PeerRecord  # the fields heard, the others at their defaults (see StageProgress.merged)
    at: float  # monotonic time it arrived


class StageProgress:
    """The freshest record of every stage-mate (and clock replica) this replica heard from by direct calls."""

    def __init__(self, peer: ProgressHost):
        self.peer = peer
        self.heard: "OrderedDict[str, _Heard]" = OrderedDict()
        self.silent: Dict[str, int] = {}  # peer id -> progress calls in a row it did not answer
        self._asked_silent_at: Dict[str, float] = {}  # peer id -> when a silent replica was last asked anyway

    # ---- answering ----

    async def answer(self, request: Mapping[str, Any], caller: str) -> Dict[str, Any]:
        """The ``progress`` RPC: take the caller's record (if it sent one) and reply with ours."""
        peer = self.peer
        if peer.stage is None:
            raise RemoteError("this peer serves no stage yet", "unavailable")
        sent = request.get("record")
        if sent is not None:
            self.hear(sent, caller)
        return {"record": progress_of(peer.announcer.record())}

    def hear(self, sent: Any, sender: str) -> PeerRecord:
        """Remember ``sent``, the progress ``sender`` sent or answered with; ValueError if it is not one."""
        if not isinstance(sent, dict):
            raise ValueError(f"record must be a mapping, got {type(sent).__name__}")
        missing = [name for name in PROGRESS_FIELDS if name not in sent]
        if missing:
            raise ValueError(f"the record lacks {missing}")
        fields = {name: sent[name] for name in PROGRESS_FIELDS}
        # the rest at neutral values; merged() keeps the DHT's where it has the peer's record
        record = PeerRecord.model_validate(  # pydantic's ValidationError is a ValueError
            {
                **fields,
                "peer_id": sender,
                "run_hash": self.peer.run_hash,
                "throughput": 0.0,
                "queue_length": 0,
                "samples_applied": 0,
            }
        )
        self.heard.pop(sender, None)
        self.heard[sender] = _Heard(record, time.monotonic())
        while len(self.heard) > MAX_HEARD:
            self.heard.popitem(last=False)
        self.silent.pop(sender, None)
        self.peer.notify_progress()  # what the step coordinator decides on may have changed
        return record

    # ---- asking ----

    def whom_to_ask(
        self, records: Mapping[str, PeerRecord], mates: bool = True, tell: bool = False, clock_now: bool = False
    ) -> List[str]:
        """The replicas whose progress the step protocol needs now: up to ``MAX_ASKED`` stage-mates (with ``mates``)
        and, on any stage but the last, ``CLOCK_ASKED`` replicas of the clock stage, those heard from longest ago
        first (so a large stage is covered over a few reads); a silent one at most once an announce period.

        Not the stage-mates that called within the poll period (that call told both sides), unless ``tell``: this
        replica's own progress changed in a way they must learn at once (it closed a step). The clock stage's
        replicas only if this replica watches the clock (:meth:`watches_clock`: a few replicas of the stage, so
        that the clock's replicas take a bounded number of calls however many replicas the other stages have),
        and not within the clock-watch period, unless ``clock_now`` (a trainer's backward call said the clock
        moved on: :func:`swarm.policy.steps.clock_hint_needs_read`). The other replicas learn it from the
        watcher that closes the step (it tells them)."""
        peer, now = self.peer, time.monotonic()
        stage, last = served(peer.stage, "stage"), peer.run.num_stages - 1

        def oldest_news(in_stage: int, states, count: int, period_s: float) -> List[str]:
            due = [
                r.peer_id
                for r in records.values()
                if r.peer_id != peer.peer_id
                and r.stage == in_stage
                and r.state in states
                and self._due(r.peer_id, now, period_s)
            ]
            due.sort(key=lambda peer_id: (self.last_heard(peer_id) or -math.inf, peer_id))
            return due[:count]

        poll_s = peer.config.poll_period_s
        asked = (
            oldest_news(stage, ("online", "leaving", "joining"), MAX_ASKED, 0.0 if tell else poll_s) if mates else []
        )
        if stage != last and (clock_now or mates) and self.watches_clock(records):
            clock = sum(r.stage == last and r.state in ("online", "leaving") for r in records.values())
            watch_s = max(poll_s, CLOCK_WATCH_S)
            period_s = 0.0 if clock_now else clock_watch_period_s(peer.run.num_stages, clock, watch_s)
            asked += oldest_news(last, ("online", "leaving"), CLOCK_ASKED, period_s)
        for peer_id in asked:
            if self.silent.get(peer_id, 0) >= SILENT_CALLS:
                self._asked_silent_at[peer_id] = now
        return asked

    def watches_clock(self, records: Mapping[str, PeerRecord]) -> bool:
        """Whether this replica is one of the ``CLOCK_WATCHERS`` of its stage that ask the clock stage, chosen anew
        for every step by a hash of the step and the peer ids: once one of them closes the step, its
        stage-mates follow its claim (:func:`swarm.policy.steps.step_is_due`), so the clock's replicas are not
        asked by every replica of every stage."""
        peer, runner = self.peer, self.peer.runner
        step = runner.accum_step if runner is not None else 0
        stage = served(peer.stage, "stage")
        mates = sorted(
            {r.peer_id for r in records.values() if r.stage == stage and r.state in ("online", "leaving")}
            | {peer.peer_id},
            key=lambda peer_id: hashlib.sha256(f"{step}:{peer_id}".encode()).digest(),
        )
        return peer.peer_id in mates[:CLOCK_WATCHERS]

    def _due(self, peer_id: str, now: float, period_s: float) -> bool:
        """Whether to ask ``peer_id``: not if it was heard from (it called or answered) within ``period_s``, and a
        silent replica once an announce period."""
        config = self.peer.config
        if self.silent.get(peer_id, 0) >= SILENT_CALLS:
            return now - self._asked_silent_at.get(peer_id, -1e9) >= config.announce_period_s
        heard = self.heard.get(peer_id)
        return heard is None or now - heard.at >= period_s

    async def ask(self, peer_ids: List[str]) -> None:
        """Exchange records with ``peer_ids`` at once; each answer lands in :attr:`heard`."""
        if not peer_ids:
            return
        mine = progress_of(self.peer.announcer.record())
        await asyncio.gather(*(self._ask_one(peer_id, mine) for peer_id in peer_ids))

    async def _ask_one(self, peer_id: str, mine: Dict[str, Any]) -> None:
        p2p = self.peer.p2p
        if p2p is None:
            raise RuntimeError("the peer has not started: it has no p2p to call through")
        try:
            reply = await call_peer(
                p2p,
                PeerID.from_base58(peer_id),
                PROGRESS_METHOD,
                {"record": mine},
                timeout=PROGRESS_TIMEOUT_S,
                max_reply_bytes=2**16,
            )
            self.hear(reply.get("record"), peer_id)
        except Exception as e:  # a dead peer, a timeout, a refusal, a malformed answer
            failures = self.silent[peer_id] = self.silent.get(peer_id, 0) + 1
            if failures == SILENT_CALLS:
                logger.warning(
                    f"stage {self.peer.stage}: {peer_id} did not answer {failures} progress calls in a row "
                    f"({type(e).__name__}: {str(e)[:200]}); leaving it out of the step protocol until it answers"
                )
            else:
                logger.debug(f"progress from {peer_id} failed: {type(e).__name__}: {e}")

    # ---- the view ----

    def merged(self, records: Mapping[str, PeerRecord], fresh_for_s: float) -> Dict[str, PeerRecord]:
        """``records`` (the DHT's) with the progress heard within ``fresh_for_s`` seconds in place of the DHT's
        (the rest of a record, its addresses and speed, stays the DHT's), and replicas silent for
        ``SILENT_CALLS`` calls left out."""
        now = time.monotonic()
        view = dict(records)
        for peer_id, heard in self.heard.items():
            if now - heard.at <= fresh_for_s:
                known = view.get(peer_id)
                view[peer_id] = heard.record if known is None else known.model_copy(update=progress_of(heard.record))
        for peer_id, failures in self.silent.items():
            if failures >= SILENT_CALLS:
                view.pop(peer_id, None)
        return view

    def last_heard(self, peer_id: str) -> Optional[float]:
        heard = self.heard.get(peer_id)
        return None if heard is None else heard.at
