"""The dashboard's data, ``/api/state``, as a pure function of a DHT snapshot, the history and the join info.

Fields of ``/api/state`` (a JSON object; ``STATE_VERSION`` grows when a field changes meaning, new fields
may be added at any time and readers ignore the ones they do not know):

- ``version`` (int), ``run_id`` (str), ``num_stages`` (int)
- ``updated_at``: Unix time (seconds) of the snapshot; ``uptime_s``: seconds since the dashboard started
- ``poll``: ``{"ok": bool, "error": str or null}``, whether the last DHT read succeeded (on failure the
  other fields hold the last good snapshot)
- ``global_step``: the step of the last stage's most advanced online replica (the last stage is the clock),
  or of any online replica when the last stage has none; null when no replica is online
- ``swarm``: ``loss`` (mean over trainers that announce one, or null), ``samples_per_s`` and ``tokens_per_s``
  (summed over trainers), ``num_peers`` (online), ``num_trainers``
- ``stages``: one object per stage ``0..num_stages-1``: ``stage``, ``replicas`` (online), ``joining``,
  ``leaving``, ``throughput`` (samples/s summed over online replicas), ``queue`` (summed queue lengths),
  ``step`` (the highest step of its online replicas, or null), ``samples_pending`` (summed)
- ``peers``: one object per announced peer, sorted by stage then id: ``peer_id``, ``stage``, ``state``
  ("joining", "online" or "leaving"), ``step``, ``throughput`` (samples/s), ``queue``, ``samples_processed``,
  ``excluded`` (stage-mates it banned from averaging), ``excluded_by`` (stage-mates that banned it),
  ``banned`` (a majority of its stage-mates banned it, so trainers route around it), ``accused_by``
  (trainers whose latest accusation names it)
- ``trainers``: ``trainer_id``, ``samples_per_s``, ``tokens_per_s``, ``loss`` (or null), ``samples_sent``
- ``accusations``: each trainer's latest: ``trainer_id``, ``accused``, ``witness``, ``referee``, ``stage``,
  ``method``, ``step``
- ``history``: parallel lists ``t`` (seconds since start), ``loss``, ``samples_per_s``, ``tokens_per_s``,
  ``global_step``, one entry per snapshot, at most the dashboard's ``history_len``
- ``steps``: the global-step timeline, ``[{"step": int, "t": seconds since start}]``, when each step was
  first seen
- ``join``: ``peer`` and ``trainer`` (the commands to paste), ``via`` ("manifest" or "initial_peers"),
  ``complete`` (false while the run's settings are unknown), ``address`` (the manifest's address or null)
- ``sample``: null until the dashboard first samples text from the run's model (see
  :mod:`swarm.dashboard.sample`), then the latest sample: ``prompt``, ``text`` (the continuation; on a failure,
  what came before it), ``num_tokens`` (tokens generated), ``step`` (the global step when sampling began, or
  null), ``tokens_per_s`` (null on a failure), ``sampled_at`` (Unix time the sample ended), ``error`` (why it
  failed, or null)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from swarm.dashboard.history import History, HistoryPoint
from swarm.dashboard.join import JoinInfo, join_commands
from swarm.policy.aggregation import banned_by_majority
from swarm.dht.records import AccusationRecord, PeerRecord, TrainerRecord, excluded_by

__all__ = ["STATE_VERSION", "Snapshot", "Sample", "history_point", "build_state", "global_step"]

STATE_VERSION = 1


@dataclass(frozen=True)
class Snapshot:
    """The run's records as one poll of the DHT found them."""

    peers: Mapping[str, PeerRecord] = field(default_factory=dict)
    trainers: Mapping[str, TrainerRecord] = field(default_factory=dict)
    accusations: Mapping[str, AccusationRecord] = field(default_factory=dict)
    fetched_at: float = 0.0  # Unix time of the poll
    error: Optional[str] = None  # why the poll failed; the records are then the last good ones


@dataclass(frozen=True)
class Sample:
    """Text the run's model wrote from a prompt, or why it could not (kept here, as plain data, so that
    :func:`build_state` stays pure; :mod:`swarm.dashboard.sample` takes them)."""

    prompt: str
    text: str  # the continuation; on a failure, the part generated before it
    num_tokens: int  # tokens generated
    step: Optional[int]  # the run's global step when sampling began, None when unknown
    tokens_per_s: Optional[float]  # None on a failure
    sampled_at: float  # Unix time the sample ended
    error: Optional[str] = None  # why sampling failed; None for a whole sample

    def to_json(self) -> Dict[str, Any]:
        """The ``sample`` object of ``/api/state``."""
        rate = None if self.tokens_per_s is None else round(self.tokens_per_s, 3)
        return {
            "prompt": self.prompt,
            "text": self.text,
            "num_tokens": self.num_tokens,
            "step": self.step,
            "tokens_per_s": rate,
            "sampled_at": round(self.sampled_at, 3),
            "error": self.error,
        }


def _mean_loss(trainers: Mapping[str, TrainerRecord]) -> Optional[float]:
    losses = [t.loss for t in trainers.values() if t.loss is not None]
    return sum(losses) / len(losses) if losses else None


def global_step(peers: Mapping[str, PeerRecord], num_stages: int) -> Optional[int]:
    """The run's global step: the last stage closes steps first and the others follow it."""
    online = [p for p in peers.values() if p.state == "online" and p.stage < num_stages]
    clock = [p.step for p in online if p.stage == num_stages - 1] or [p.step for p in online]
    return max(clock) if clock else None


def history_point(snapshot: Snapshot, num_stages: int, t: float) -> HistoryPoint:
    """The figures of ``snapshot`` that the charts keep, ``t`` seconds after the dashboard started."""
    trainers = snapshot.trainers.values()
    return HistoryPoint(
        t=t,
        loss=_mean_loss(snapshot.trainers),
        samples_per_s=sum(x.samples_per_s for x in trainers),
        tokens_per_s=sum(x.tokens_per_s for x in trainers),
        global_step=global_step(snapshot.peers, num_stages),
    )


def _stages(peers: Mapping[str, PeerRecord], num_stages: int) -> List[Dict[str, Any]]:
    stages = []
    for stage in range(num_stages):
        mine = [p for p in peers.values() if p.stage == stage]
        online = [p for p in mine if p.state == "online"]
        stages.append(
            {
                "stage": stage,
                "replicas": len(online),
                "joining": sum(p.state == "joining" for p in mine),
                "leaving": sum(p.state == "leaving" for p in mine),
                "throughput": round(sum(p.throughput for p in online), 3),
                "queue": sum(p.queue_length for p in online),
                "step": max((p.step for p in online), default=None),
                "samples_pending": sum(p.samples_pending for p in online),
            }
        )
    return stages


def _peers(snapshot: Snapshot, num_stages: int) -> List[Dict[str, Any]]:
    peers = snapshot.peers
    banned = set().union(*(banned_by_majority(excluded_by(dict(peers), stage)) for stage in range(num_stages)))
    accused_by: Dict[str, List[str]] = {}
    for accusation in snapshot.accusations.values():
        accused_by.setdefault(accusation.accused, []).append(accusation.trainer_id)
    rows = []
    for p in sorted(peers.values(), key=lambda p: (p.stage, p.peer_id)):
        rows.append(
            {
                "peer_id": p.peer_id,
                "stage": p.stage,
                "state": p.state,
                "step": p.step,
                "throughput": round(p.throughput, 3),
                "queue": p.queue_length,
                "samples_processed": p.samples_processed,
                "excluded": p.excluded_peers,
                "excluded_by": sorted(
                    q.peer_id for q in peers.values() if q.stage == p.stage and p.peer_id in q.excluded_peers
                ),
                "banned": p.peer_id in banned,
                "accused_by": sorted(accused_by.get(p.peer_id, [])),
            }
        )
    return rows


def build_state(
    snapshot: Snapshot, history: History, join: JoinInfo, uptime_s: float, sample: Optional[Sample] = None
) -> Dict[str, Any]:
    """``/api/state`` (fields in the module docstring) of ``snapshot``, ``history`` and the latest ``sample``."""
    num_stages = join.num_stages
    trainers = sorted(snapshot.trainers.values(), key=lambda t: t.trainer_id)
    return {
        "version": STATE_VERSION,
        "run_id": join.run_id,
        "num_stages": num_stages,
        "updated_at": snapshot.fetched_at,
        "uptime_s": round(uptime_s, 3),
        "poll": {"ok": snapshot.error is None, "error": snapshot.error},
        "global_step": global_step(snapshot.peers, num_stages),
        "swarm": {
            "loss": _mean_loss(snapshot.trainers),
            "samples_per_s": round(sum(t.samples_per_s for t in trainers), 3),
            "tokens_per_s": round(sum(t.tokens_per_s for t in trainers), 3),
            "num_peers": sum(p.state == "online" for p in snapshot.peers.values()),
            "num_trainers": len(trainers),
        },
        "stages": _stages(snapshot.peers, num_stages),
        "peers": _peers(snapshot, num_stages),
        "trainers": [
            {
                "trainer_id": t.trainer_id,
                "samples_per_s": round(t.samples_per_s, 3),
                "tokens_per_s": round(t.tokens_per_s, 3),
                "loss": t.loss,
                "samples_sent": t.samples_sent,
            }
            for t in trainers
        ],
        "accusations": [
            {
                "trainer_id": a.trainer_id,
                "accused": a.accused,
                "witness": a.witness,
                "referee": a.referee,
                "stage": a.stage,
                "method": a.method,
                "step": a.step,
            }
            for a in sorted(snapshot.accusations.values(), key=lambda a: a.trainer_id)
        ],
        "history": history.series(),
        "steps": history.step_marks(),
        "join": join_commands(join),
        "sample": None if sample is None else sample.to_json(),
    }
