"""Progress calls (swarm/server/progress.py): replicas exchange their records directly; a record that names
another peer or another run is refused, a fresh answer replaces the DHT's copy, and a replica that stops
answering leaves the view (and is asked again only once an announce period)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Dict

import pytest

import swarm.server.progress as progress_module
from swarm import PROTOCOL_VERSION
from swarm.dht.records import PeerRecord
from swarm.net.rpc import RemoteError
from swarm.policy.steps import CLOCK_ASKED, CLOCK_WATCH_S, CLOCK_WATCHERS, clock_watch_period_s
from swarm.server.progress import MAX_ASKED, PROGRESS_FIELDS, SILENT_CALLS, StageProgress, progress_of

RUN_HASH = "abcd"


def _record(peer_id: str, stage: int = 0, **fields) -> PeerRecord:
    values = dict(version=PROTOCOL_VERSION, peer_id=peer_id, stage=stage, state="online", throughput=1.0,
                  queue_length=0, step=0, accum_step=0, samples_pending=0, samples_applied=0, run_hash=RUN_HASH)
    return PeerRecord(**{**values, **fields})


class _Peer(SimpleNamespace):
    """What the progress exchange reads of a peer: its id, stage, run and record."""

    def __init__(self, peer_id: str, stage=0, num_stages: int = 2, **record_fields):
        super().__init__(peer_id=peer_id, stage=stage, run=SimpleNamespace(num_stages=num_stages), run_hash=RUN_HASH,
                         config=SimpleNamespace(announce_period_s=30.0, poll_period_s=0.25), p2p=object(),
                         progressed=0, runner=None)
        self.fields = record_fields
        self.announcer = SimpleNamespace(record=lambda: _record(self.peer_id, self.stage, **self.fields))

    def notify_progress(self) -> None:
        self.progressed += 1


def _network(monkeypatch, progresses: Dict[str, StageProgress], dead=()):
    """Route progress calls to the StageProgress of the peer called, as p2pd would (the caller authenticated)."""

    async def call_peer(p2p, peer_id, method, message, **kwargs):
        callee = str(peer_id)
        if callee in dead or callee not in progresses:
            raise ConnectionError(f"{callee} does not answer")
        caller = next(pid for pid, progress in progresses.items() if progress.peer.p2p is p2p)
        return await progresses[callee].answer(message, caller)

    monkeypatch.setattr(progress_module, "call_peer", call_peer)
    monkeypatch.setattr(progress_module.PeerID, "from_base58", staticmethod(lambda value: value))


def test_what_is_heard_is_the_sender_s_progress_checked_like_a_record():
    progress = StageProgress(_Peer("QmA"))
    record = _record("QmB", samples_pending=12, throughput=50.0, maddrs="/ip4/10.0.0.1/tcp/1")
    heard = progress.hear(progress_of(record), "QmB")
    assert heard.peer_id == "QmB" and heard.samples_pending == 12 and heard.run_hash == RUN_HASH
    assert progress.peer.progressed == 1, "the step coordinator is woken to decide on the news"
    assert set(progress_of(record)) == set(PROGRESS_FIELDS) and "maddrs" not in progress_of(record)
    with pytest.raises(ValueError):
        progress.hear({**progress_of(record), "samples_pending": -1}, "QmB")
    with pytest.raises(ValueError, match="lacks"):
        progress.hear({"step": 3}, "QmB")
    with pytest.raises(ValueError, match="mapping"):
        progress.hear(b"junk", "QmB")
    assert set(progress.heard) == {"QmB"} and progress.heard["QmB"].record.samples_pending == 12


def test_heard_progress_replaces_only_the_progress_fields_of_the_dht_record():
    progress = StageProgress(_Peer("QmA"))
    dht = {"QmB": _record("QmB", throughput=50.0, maddrs="/ip4/10.0.0.1/tcp/1", samples_pending=1)}
    progress.hear(progress_of(_record("QmB", samples_pending=30, step=2, accum_step=2)), "QmB")
    merged = progress.merged(dht, 30.0)["QmB"]
    assert (merged.samples_pending, merged.step, merged.accum_step) == (30, 2, 2)
    assert merged.throughput == 50.0 and merged.maddrs == "/ip4/10.0.0.1/tcp/1"
    progress.hear(progress_of(_record("QmJ", state="joining")), "QmJ")  # not read from the DHT yet
    assert progress.merged(dht, 30.0)["QmJ"].state == "joining"


async def test_a_call_tells_both_sides_and_the_answer_replaces_the_dht_copy(monkeypatch):
    a, b = StageProgress(_Peer("QmA", samples_pending=3)), StageProgress(_Peer("QmB", samples_pending=7))
    b.peer.p2p = object()
    _network(monkeypatch, {"QmA": a, "QmB": b})
    dht = {"QmA": _record("QmA"), "QmB": _record("QmB")}  # as the DHT last showed them: nothing pending
    await a.ask(a.whom_to_ask(dht))
    assert a.merged(dht, 30.0)["QmB"].samples_pending == 7
    assert b.merged(dht, 30.0)["QmA"].samples_pending == 3, "the caller's record came with its call"
    assert a.merged(dht, 0.0)["QmB"].samples_pending == 0, "an answer older than the DHT's copy does not count"


async def test_a_replica_that_stops_answering_leaves_the_view_and_is_asked_once_an_announce_period(monkeypatch):
    a = StageProgress(_Peer("QmA"))
    _network(monkeypatch, {"QmA": a}, dead={"QmDead"})
    dht = {"QmA": _record("QmA"), "QmDead": _record("QmDead")}
    for calls in range(1, SILENT_CALLS + 1):
        assert a.whom_to_ask(dht) == ["QmDead"]
        assert "QmDead" in a.merged(dht, 30.0), "a replica keeps its place for a few failed calls"
        await a.ask(a.whom_to_ask(dht))
        assert a.silent["QmDead"] == calls
    assert "QmDead" not in a.merged(dht, 30.0)
    assert a.whom_to_ask(dht) == ["QmDead"]  # asked once more now (the first time since it fell silent) ...
    assert a.whom_to_ask(dht) == []  # ... and not again within the announce period


def test_whom_to_ask_is_the_stage_and_on_other_stages_the_clock():
    records = {pid: _record(pid, stage) for pid, stage in
               [("QmA", 0), ("QmB", 0), ("QmC", 1), ("QmD", 1), ("QmE", 2)]}
    records["QmF"] = _record("QmF", 0, state="joining")
    records["QmG"] = _record("QmG", 2, state="joining")
    assert StageProgress(_Peer("QmA", 0, num_stages=3)).whom_to_ask(records) == ["QmB", "QmF", "QmE"]
    assert StageProgress(_Peer("QmC", 1, num_stages=3)).whom_to_ask(records) == ["QmD", "QmE"]
    # the clock stage asks only its own stage-mates; a joiner there is one of them
    assert StageProgress(_Peer("QmE", 2, num_stages=3)).whom_to_ask(records) == ["QmG"]


async def test_with_many_stages_a_watcher_asks_a_clock_replica_once_a_clock_watch_period(monkeypatch):
    """64 stages, 2 clock replicas: each is asked by 63 x 2 watchers; a watcher that heard a clock replica asks
    it again only a clock-watch period later, and its stage-mates every poll period as before."""
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    records = {pid: _record(pid, stage) for pid, stage in [("QmA", 0), ("QmB", 0), ("QmY", 63), ("QmZ", 63)]}
    watcher = StageProgress(_Peer("QmA", 0, num_stages=64))
    monkeypatch.setattr(watcher, "watches_clock", lambda records: True)
    period = clock_watch_period_s(64, 2, max(0.25, CLOCK_WATCH_S))
    assert period == pytest.approx(CLOCK_WATCH_S * 63 * 2 * 2 / 2 / 2)
    assert watcher.whom_to_ask(records) == ["QmB", "QmY", "QmZ"]
    for pid in ("QmB", "QmY", "QmZ"):
        watcher.hear(progress_of(_record(pid, records[pid].stage)), pid)
    now[0] += 0.25
    assert watcher.whom_to_ask(records) == ["QmB"], "the clock replicas were heard within the watch period"
    now[0] += period
    assert watcher.whom_to_ask(records) == ["QmB", "QmY", "QmZ"]


async def test_a_trainers_hint_asks_the_clock_now_and_a_closed_step_is_told_to_every_mate(monkeypatch):
    """A hint asks the clock's replicas whatever the clock-watch period, and them only; a replica that closed a
    step tells the stage-mates that called it a moment ago too (their view of it is stale)."""
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    records = {pid: _record(pid, stage) for pid, stage in [("QmA", 0), ("QmB", 0), ("QmY", 1), ("QmZ", 1)]}
    replica = StageProgress(_Peer("QmA", 0, num_stages=2))
    watches = [False]
    monkeypatch.setattr(replica, "watches_clock", lambda records: watches[0])
    assert replica.whom_to_ask(records) == ["QmB"], "not a watcher: the clock is not asked on a read"
    assert replica.whom_to_ask(records, mates=False, clock_now=True) == [], "nor on a hint: the watchers ask"
    watches[0] = True
    for pid in ("QmB", "QmY", "QmZ"):
        replica.hear(progress_of(_record(pid, records[pid].stage)), pid)
    now[0] += 0.1
    assert replica.whom_to_ask(records) == [], "everyone was heard from within the poll period"
    assert replica.whom_to_ask(records, mates=False, clock_now=True) == ["QmY", "QmZ"]
    assert replica.whom_to_ask(records, tell=True) == ["QmB"]


async def test_a_large_stage_is_asked_a_bounded_share_at_a_time_and_a_mate_that_just_called_is_not_asked(monkeypatch):
    progresses = {f"QmS{i:02d}": StageProgress(_Peer(f"QmS{i:02d}", 0)) for i in range(20)}
    progresses.update({f"QmK{i}": StageProgress(_Peer(f"QmK{i}", 1)) for i in range(6)})
    for progress in progresses.values():
        progress.peer.p2p = object()
    _network(monkeypatch, progresses)
    records = {peer_id: progress.peer.announcer.record() for peer_id, progress in progresses.items()}
    watchers = [peer_id for peer_id in progresses if peer_id.startswith("QmS")
                and progresses[peer_id].watches_clock(records)]
    assert len(watchers) == CLOCK_WATCHERS, "a few replicas of the stage ask the clock, not all of them"
    for peer_id in progresses:
        if peer_id.startswith("QmS"):
            asked = progresses[peer_id].whom_to_ask(records)
            mates, clock = [p for p in asked if p.startswith("QmS")], [p for p in asked if p.startswith("QmK")]
            assert len(mates) == MAX_ASKED and peer_id not in asked
            assert len(clock) == (CLOCK_ASKED if peer_id in watchers else 0)
    progress = progresses[watchers[0]]
    covered = set()
    for _ in range(3):  # those heard from longest ago first: the whole stage within a few reads
        asked = progress.whom_to_ask(records)
        covered |= set(asked)
        await progress.ask(asked)
        for heard in progress.heard.values():  # as if a poll period passed since
            object.__setattr__(heard, "at", heard.at - 1.0)
    assert covered >= {peer_id for peer_id in records if peer_id.startswith("QmS")} - {watchers[0]}
    caller = next(peer_id for peer_id in records if peer_id.startswith("QmS") and peer_id != watchers[0])
    progress.hear(progress_of(records[caller]), caller)  # it called: both sides know each other now
    assert caller not in progress.whom_to_ask(records)


async def test_a_peer_without_a_stage_answers_unavailable():
    progress = StageProgress(_Peer("QmA", stage=None))
    with pytest.raises(RemoteError) as raised:
        await progress.answer({}, "QmB")
    assert raised.value.kind == "unavailable"


async def test_a_malformed_record_in_a_call_is_refused_and_nothing_is_heard():
    progress = StageProgress(_Peer("QmA"))
    with pytest.raises(ValueError):
        await progress.answer({"record": {"peer_id": "QmB", "step": "many"}}, "QmB")
    assert not progress.heard


async def test_the_oldest_records_are_forgotten_past_the_bound(monkeypatch):
    monkeypatch.setattr(progress_module, "MAX_HEARD", 3)
    progress = StageProgress(_Peer("QmA"))
    for index in range(5):
        progress.hear(progress_of(_record(f"QmP{index}")), f"QmP{index}")
        await asyncio.sleep(0)
    assert list(progress.heard) == ["QmP2", "QmP3", "QmP4"]


class _Directory:
    """A directory that records which stages each read covered; every stage is due."""

    def __init__(self, num_stages: int):
        self.num_stages, self.reads = num_stages, []

    def stages_due(self, period_s):
        return list(range(self.num_stages))

    async def read(self, stages, whole=False):
        self.reads.append(sorted(stages))
        self.whole = whole

    def records(self):
        return {}


@pytest.mark.parametrize("kwargs, expected", [({}, [1, 3]), ({"every_stage": True}, [0, 1, 2, 3]),
                                              ({"fresh": True}, [1, 3]),
                                              ({"fresh": True, "every_stage": True}, [0, 1, 2, 3])])
async def test_a_peer_reads_its_own_stage_and_the_clock_unless_it_needs_every_stage(kwargs, expected):
    from swarm.config.settings import PeerConfig, RunConfig
    from swarm.server.peer import StagePeer

    peer = StagePeer(PeerConfig(run=RunConfig(num_stages=4)))
    peer.directory, peer.stage = _Directory(4), 1
    await peer.fetch_records(**kwargs)
    assert peer.directory.reads == [expected]
    assert peer.directory.whole == bool(kwargs.get("fresh"))  # joining asks every node near each key


@pytest.mark.parametrize("stage, expected", [("2", [2, 3]), ("3", [3]), ("auto", None)])
def test_a_joiner_reads_every_stage_only_to_choose_one(stage, expected):
    from swarm.config.settings import PeerConfig, RunConfig
    from swarm.server.peer import StagePeer

    assert StagePeer(PeerConfig(run=RunConfig(num_stages=4), stage=stage))._stages_to_join() == expected
