"""Honest state for joining replicas: whom to trust (pure policy), the download loop against a lying
server (with a fake averager), checkpoints that never hold a non-finite value, and a live joiner that
meets a replica serving poisoned state."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import pytest
import torch

from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
from swarm.policy.joining import StateClaim, StateSources, check_downloaded_state, trusted_state_sources
from swarm.dht.records import PeerRecord
from swarm.server.checkpoints import Checkpointer, checkpoint_path, load_checkpoint, save_checkpoint
from swarm.server.faults import corrupt_state
from swarm.server.compute import ComputeThread
from swarm.server.joining import Joining
from swarm.server.runner import StageRunner, parameter_digest
from tests.utils.probe import online

RUN = RunConfig(run_id="honest", num_stages=2, target_batch_size=8,
                model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16))
RNG = random.Random(0)


def claim(peer_id: str, step: int = 5, digest: str = "a", state: str = "online") -> StateClaim:
    return StateClaim(peer_id, state, step, digest)


# ---- the policy: whom to download from ----


def test_majority_digest_is_trusted_and_only_its_holders_are_sources():
    sources = trusted_state_sources([claim("p1"), claim("p2"), claim("p3", digest="b")], "me", (), RNG)
    assert (sources.step, sources.digest, sorted(sources.peer_ids)) == (5, "a", ["p1", "p2"])


def test_a_minority_ahead_does_not_win():
    claims = [claim("p1"), claim("p2"), claim("liar", step=9, digest="z")]
    sources = trusted_state_sources(claims, "me", (), RNG)
    assert (sources.step, sources.digest, sorted(sources.peer_ids)) == (5, "a", ["p1", "p2"])
    split = trusted_state_sources([claim("p1"), claim("p2", step=6, digest="b")], "me", (), RNG)
    assert split.peer_ids == () and "no strict majority" in split.reason


def test_a_tie_has_no_source():
    claims = [claim("p1"), claim("p2"), claim("p3", digest="b"), claim("p4", digest="b")]
    sources = trusted_state_sources(claims, "me", (), RNG)
    assert sources.peer_ids == () and "no strict majority among 4" in sources.reason


def test_a_single_other_replica_is_trusted():
    sources = trusted_state_sources([claim("only", step=3, digest="x")], "me", (), RNG)
    assert (sources.peer_ids, sources.step, sources.digest) == (("only",), 3, "x")


def test_self_distrusted_and_offline_replicas_neither_vote_nor_serve():
    claims = [claim("me", digest="b"), claim("p1"), claim("liar1", digest="b"), claim("liar2", digest="b"),
              claim("joiner", digest="b", state="joining"), claim("leaver", digest="b", state="leaving")]
    # "me" and the replicas that are not online do not count: 2 of the 3 voters say "b", so the liars win...
    assert sorted(trusted_state_sources(claims, "me", (), RNG).peer_ids) == ["liar1", "liar2"]
    sources = trusted_state_sources(claims, "me", {"liar1", "liar2"}, RNG)  # ...until they are caught
    assert sources.peer_ids == ("p1",) and sources.digest == "a"
    assert trusted_state_sources([claim("me"), claim("liar")], "me", {"liar"}, RNG).peer_ids == ()


def test_an_empty_digest_is_no_vote():
    sources = trusted_state_sources([claim("p1"), claim("p2", digest=""), claim("p3", digest="")], "me", (), RNG)
    assert sources.peer_ids == ()
    sources = trusted_state_sources([claim("p1"), claim("p2"), claim("p3", digest="")], "me", (), RNG)
    assert sorted(sources.peer_ids) == ["p1", "p2"]


def test_sources_come_in_random_order():
    claims = [claim(f"p{i}") for i in range(6)]
    orders = {trusted_state_sources(claims, "me", (), random.Random(seed)).peer_ids for seed in range(20)}
    assert len(orders) > 1 and all(sorted(order) == [f"p{i}" for i in range(6)] for order in orders)


@pytest.mark.parametrize("case, accept, distrust", [
    (dict(complete=False, all_finite=False), False, False),  # a stream cut short: retried, not held against anyone
    (dict(all_finite=False), False, True),
    (dict(step=None), False, True),
    (dict(step=6), False, False),  # the sender stepped since it announced
    (dict(step=4), False, False),  # behind: not adopted (a replica that went back to the stage's lineage does that)
    (dict(digest="other"), False, True),
    (dict(), True, False),
])
def test_verdict_on_a_downloaded_state(case: Dict[str, Any], accept: bool, distrust: bool):
    facts = {**dict(complete=True, all_finite=True, step=5, digest="a"), **case}
    verdict = check_downloaded_state(StateSources(("p1",), 5, "a"), **facts)
    assert (verdict.accept, verdict.distrust) == (accept, distrust) and (accept or verdict.reason)
    assert verdict.moved_on == (facts["step"] == 6)  # its claim (step 5) holds: it is past it


# ---- the download loop, with a fake averager: a lying server is refused, the next one is asked ----


def record(peer_id: str, runner: StageRunner, state: str = "online", step: Optional[int] = None) -> PeerRecord:
    return PeerRecord(version=1, peer_id=peer_id, stage=0, state=state, throughput=1.0, queue_length=0,
                      step=runner.step if step is None else step, accum_step=runner.accum_step, samples_pending=0,
                      samples_applied=0, digest=runner.digest)


class FakeAverager:
    """Serves each peer's (metadata, tensors) the way StageAverager.load_state_from returns them."""

    def __init__(self, served: Dict[str, Tuple[Dict[str, int], List[torch.Tensor]]]):
        self.served, self.asked, self.allow_state_sharing = served, [], False

    def load_state_from(self, peer_ids: Sequence[str], timeout: float, max_bytes: Optional[int] = None, wait: bool = True):
        async def download():
            for peer_id in peer_ids:
                self.asked.append(peer_id)
                if peer_id in self.served:
                    return (peer_id, *self.served[peer_id])
            return None
        return asyncio.ensure_future(download())

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        async def download():  # hivemind's pick: the highest declared priority, which the poisoner bids
            self.asked.append("poisoner")
            return self.served["poisoner"]
        return asyncio.ensure_future(download())


class FakeSteps:
    def __init__(self):
        self.distrusted: List[str] = []
        self.banned: Set[str] = set()
        self.tentative: Dict[int, float] = {}

    def banned_now(self) -> Set[str]:
        return set(self.banned)

    def distrust(self, peer_ids, why: str) -> None:
        self.distrusted += list(peer_ids)

    def adopted(self, first_dropped: int, step: int) -> None:
        pass


class FakeCheckpoints:
    async def restore(self) -> bool:
        return False


@dataclass
class FakeConfig:
    state_download_timeout_s: float = 5.0
    announce_period_s: float = 1.0
    poll_period_s: float = 0.05
    reinitialize: bool = False
    checkpoint_dir: Optional[str] = None


class FakePeer:
    """What Joining uses of a StagePeer: records, a runner, an averager, the step coordinator."""

    def __init__(self, records: Dict[str, PeerRecord], served, defences: bool = True):
        self.peer_id, self.stage, self.run = "joiner", 0, replace(RUN, defences=defences)
        self.config, self.records = FakeConfig(), records
        self.runner, self.averager, self.steps = StageRunner(RUN, 0), FakeAverager(served), FakeSteps()
        self.checkpoints, self.compute = FakeCheckpoints(), ComputeThread()

    async def fetch_records(self, ask: bool = False, fresh: bool = False, every_stage: bool = False) -> Dict[str, PeerRecord]:
        return self.records


class PoisonerFirst:
    def shuffle(self, peer_ids: List[str]) -> None:
        peer_ids.sort(key=lambda peer_id: peer_id != "poisoner")


def trained_runner() -> StageRunner:
    """A replica one step into the run: its state differs from a fresh replica's."""
    runner = StageRunner(RUN, 0)
    runner.freeze()
    runner.apply([torch.randn_like(p) for p in runner.params], total_samples=8)
    return runner


def lying_swarm(honest: bool = True) -> Tuple[Dict[str, PeerRecord], Dict[str, Any], StageRunner]:
    source = trained_runner()
    state = (source.state_metadata(), source.state_tensors())
    records = {"poisoner": record("poisoner", source)}
    served = {"poisoner": corrupt_state("poisoned_state", *state)}
    if honest:
        records["honest"], served["honest"] = record("honest", source), state
    return records, served, source


async def test_joiner_refuses_the_poisoned_state_and_takes_the_next(caplog):
    records, served, source = lying_swarm()
    peer = FakePeer(records, served)
    with caplog.at_level(logging.WARNING):
        assert await Joining(peer, rng=PoisonerFirst()).download_state()
    assert peer.averager.asked == ["poisoner", "honest"]
    assert peer.runner.digest == source.digest and peer.runner.step == 1
    assert peer.steps.distrusted == ["poisoner"]
    assert re.search(r"refusing the state downloaded from poisoner: its parameters hash to \w+, not to the announced",
                     caplog.text)


async def test_a_banned_replica_neither_votes_nor_serves():
    # the banned replica announces another state at a later step: were it counted, there would be no majority
    records, served, source = lying_swarm()
    other = trained_runner()
    other.freeze()
    other.apply([torch.randn_like(p) for p in other.params], total_samples=8)
    records["banned"] = record("banned", other)
    served["banned"] = (other.state_metadata(), other.state_tensors())
    records.pop("poisoner")
    peer = FakePeer(records, served)
    peer.steps.banned = {"banned"}
    assert await Joining(peer).download_state()
    assert peer.averager.asked == ["honest"] and peer.runner.digest == source.digest


async def test_without_defences_the_joiner_adopts_the_poisoned_state():
    records, served, source = lying_swarm()
    peer = FakePeer(records, served, defences=False)
    assert await Joining(peer).download_state()
    assert peer.runner.step == 1 and peer.runner.digest != source.digest
    assert max((a - b).abs().max().item() for a, b in zip(peer.runner.params, source.params)) > 1.0


async def test_a_lone_poisoner_is_refused_and_the_joiner_starts_from_initialisation_at_step_0():
    fresh = StageRunner(RUN, 0)
    state = (fresh.state_metadata(), fresh.state_tensors())
    peer = FakePeer({"poisoner": record("poisoner", fresh)}, {"poisoner": corrupt_state("poisoned_state", *state)})
    await Joining(peer).join_stage()
    assert peer.averager.asked == ["poisoner"] and peer.steps.distrusted == ["poisoner"]
    assert peer.runner.digest == fresh.digest and peer.averager.allow_state_sharing


async def test_a_lone_poisoner_past_step_0_stops_the_joiner_with_a_clear_error():
    records, served, _ = lying_swarm(honest=False)
    peer = FakePeer(records, served)
    with pytest.raises(RuntimeError, match="no live replica and no checkpoint"):
        await Joining(peer).join_stage()


# ---- a state newer than the record its source announced ----


class LaggingRecords(FakePeer):
    """Its first ``stale_reads`` reads return ``before``, every later one ``after``: records catching up."""

    def __init__(self, before: Dict[str, PeerRecord], after: Dict[str, PeerRecord], served, stale_reads: int = 1):
        super().__init__(before, served)
        self.after, self.reads, self.stale_reads = after, 0, stale_reads

    async def fetch_records(self, ask: bool = False, fresh: bool = False, every_stage: bool = False) -> Dict[str, PeerRecord]:
        self.reads += 1
        return self.records if self.reads <= self.stale_reads else self.after


def stepped(runner: StageRunner, scale: float = 1.0) -> StageRunner:
    runner.freeze()
    runner.apply([torch.full_like(p, scale) for p in runner.params], total_samples=8)
    return runner


async def test_a_state_one_step_ahead_of_its_record_is_adopted_once_the_records_name_it():
    before, after = StageRunner(RUN, 0), stepped(StageRunner(RUN, 0))
    peer = LaggingRecords({"honest": record("honest", before)}, {"honest": record("honest", after)},
                          {"honest": (after.state_metadata(), after.state_tensors())})
    assert await Joining(peer).download_state()
    assert peer.averager.asked == ["honest"], "the state was downloaded again"
    assert peer.runner.version == after.version and not peer.steps.distrusted


async def test_a_state_the_majority_stepped_differently_from_is_left_and_its_sender_not_distrusted(caplog):
    start = StageRunner(RUN, 0)
    minority, majority = stepped(StageRunner(RUN, 0), 1.0), stepped(StageRunner(RUN, 0), -1.0)
    before = {name: record(name, start) for name in ("minority", "p1", "p2")}
    after = {"minority": record("minority", minority), "p1": record("p1", majority), "p2": record("p2", majority)}
    served = {"minority": (minority.state_metadata(), minority.state_tensors()),
              **{name: (majority.state_metadata(), majority.state_tensors()) for name in ("p1", "p2")}}
    peer = LaggingRecords(before, after, served)
    with caplog.at_level(logging.INFO):
        assert await Joining(peer, rng=MinorityFirst()).download_state()
    assert peer.averager.asked[0] == "minority" and len(peer.averager.asked) == 2
    assert peer.runner.version == majority.version and not peer.steps.distrusted
    assert "the stage's replicas announce another state at its step 1" in caplog.text


async def test_a_state_the_stage_has_moved_past_is_not_adopted():
    start, one = StageRunner(RUN, 0), stepped(StageRunner(RUN, 0))
    two = stepped(stepped(StageRunner(RUN, 0)))
    peer = LaggingRecords({"honest": record("honest", start)}, {"honest": record("honest", two)},
                          {"honest": (one.state_metadata(), one.state_tensors())})
    peer.config.state_download_timeout_s = 1.0
    assert not await Joining(peer).download_state()
    assert peer.runner.step == 0 and not peer.steps.distrusted


class MinorityFirst:
    def shuffle(self, peer_ids: List[str]) -> None:
        peer_ids.sort(key=lambda peer_id: peer_id != "minority")


# ---- checkpoints never hold a non-finite value ----


class CheckpointPeer:
    def __init__(self, directory: Path):
        self.config = FakeConfig(checkpoint_dir=str(directory))
        self.run, self.stage, self.state, self.runner = RUN, 0, "online", StageRunner(RUN, 0)
        self.compute = ComputeThread()

    def shared_state(self):
        return self.runner.state_metadata(), self.runner.state_tensors()


async def test_a_non_finite_state_never_replaces_the_good_checkpoint(tmp_path, caplog):
    peer = CheckpointPeer(tmp_path)
    path = await Checkpointer(peer).save()
    good = path.read_bytes()
    with torch.no_grad():
        peer.runner.params[0][0, 0] = float("nan")
    with caplog.at_level(logging.ERROR):
        assert await Checkpointer(peer).save() is None
    assert "hold NaN or infinite values" in caplog.text and "keeping the last good checkpoint" in caplog.text
    assert path.read_bytes() == good
    metadata, tensors = load_checkpoint(path, RUN.run_id, 0)
    assert parameter_digest(tensors[:len(peer.runner.params)]) == StageRunner(RUN, 0).digest


def test_a_checkpoint_with_non_finite_values_is_refused(tmp_path):
    runner = StageRunner(RUN, 0)
    metadata, tensors = runner.state_metadata(), runner.state_tensors()
    tensors[len(runner.params)][0] = float("inf")  # an AdamW moment
    path = checkpoint_path(str(tmp_path), RUN.run_id, 0)
    with pytest.raises(ValueError):
        save_checkpoint(path, RUN.run_id, metadata, tensors)
    assert not path.exists()
    torch.save({"run_id": RUN.run_id, "metadata": metadata, "tensors": tensors}, path)  # written by something else
    with pytest.raises(ValueError, match="NaN or infinite values .*refusing to restore it"):
        load_checkpoint(path, RUN.run_id, 0)


# ---- live: a joiner meets a replica that serves poisoned state ----


@pytest.mark.parametrize("defences", [True, False], ids=["defended", "undefended"])
@pytest.mark.long
async def test_joiner_meets_a_poisoned_state_server(launcher, probe, defences: bool):
    """The poisoner is the stage's only replica, so the joiner's download goes to it whatever the order.

    What the poisoner holds is read before the joiner starts: without defences the poisoner, finding its digest
    differs from the joiner's, may resynchronise from the joiner and so take the poisoned state on itself.
    """
    run = [] if defences else ["--defences", "false"]
    poisoner = launcher.peer(0, extra=["--fault", "poisoned_state", *run], name="poisoner")
    poisoner_id = poisoner.wait_event("peer_ready", timeout=1)["peer_id"]
    before = await probe.wait_for(lambda r: len(online(r, 0)) == 1, 15, "the poisoner online")
    truth = await probe.call(poisoner_id, "parameters", {})  # what it holds, not what it serves
    joiner = launcher.peer(0, extra=run, name="joiner")
    joiner_id = joiner.wait_event("peer_ready", timeout=1)["peer_id"]
    records = await probe.wait_for(lambda r: joiner_id in {x.peer_id for x in online(r, 0)}, 15, "the joiner online")
    joined = await probe.call(joiner_id, "parameters", {})
    assert all(bool(torch.isfinite(p).all()) for p in joined["parameters"]) and joined["step"] == truth["step"] == 0
    distance = max((a - b).abs().max().item() for a, b in zip(joined["parameters"], truth["parameters"]))
    log = joiner.log_tail(400)
    if defences:
        assert records[joiner_id].digest == before[poisoner_id].digest and distance == 0.0
        assert f"refusing the state downloaded from {poisoner_id}: its parameters hash to" in log
    else:  # the harm: the joiner serves the poisoned parameters, and its digest no longer matches
        assert records[joiner_id].digest != before[poisoner_id].digest and distance > 1.0
        assert "refusing the state" not in log
