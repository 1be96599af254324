"""The dashboard's sampler without a network: when it samples, what a failed sample shows, its settings, and
the poller keeping the run's settings from a manifest it finds (the live sample is in tests/test_dashboard.py)."""

from __future__ import annotations

import asyncio
from typing import Dict, List, Optional

import pytest

from peers.dashboard import DashboardConfig
from swarm.config.settings import RunConfig
from swarm.dashboard import poller as poller_module
from swarm.dashboard.history import History
from swarm.dashboard.join import JoinInfo
from swarm.dashboard.poller import DashboardPoller
from swarm.dashboard.sample import DashboardSampler, SampleSettings, sample_wait_reason, stages_without_replica
from swarm.dashboard.server import StateBox
from swarm.dashboard.state import Sample, Snapshot, build_state
from swarm.dht.identity import load_or_create_identity
from swarm.dht.manifest import RunManifest, run_hash
from swarm.dht.records import PeerRecord
from swarm.model.gpt import ModelConfig
from swarm.training.tokenizer import find_cached, train_tokenizer
from tests.test_tokenizer import make_texts, serving

TINY_MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)


def tiny_run(**changes) -> RunConfig:
    return RunConfig(**{"run_id": "sample_test", "num_stages": 2, "model": TINY_MODEL, **changes})


def peer(peer_id: str, stage: int, state: str = "online", step: int = 3, hash_: str = "") -> PeerRecord:
    return PeerRecord(version=1, peer_id=peer_id, stage=stage, state=state, throughput=1.0, queue_length=0, step=step,
                      accum_step=step, samples_pending=0, samples_applied=0, run_hash=hash_)


def records(*peers: PeerRecord) -> Dict[str, PeerRecord]:
    return {p.peer_id: p for p in peers}


def test_a_sample_is_due_once_the_run_is_known_and_every_stage_is_served():
    run, both = tiny_run(), records(peer("a", 0), peer("b", 1))
    assert sample_wait_reason(180.0, run, both, last_sample_end=None, now=5.0) is None  # the first: at once
    assert sample_wait_reason(180.0, run, both, last_sample_end=100.0, now=280.0) is None  # a period after the last
    assert sample_wait_reason(0.0, run, both, None, 5.0) == "sampling is off"
    assert sample_wait_reason(180.0, None, both, None, 5.0) == "the run's settings are not known yet"
    assert sample_wait_reason(180.0, run, both, last_sample_end=100.0, now=279.0) == "the next sample is due in 1.0 s"
    # a stage served only by a joining or leaving replica cannot answer a forward
    assert sample_wait_reason(180.0, run, records(peer("a", 0), peer("b", 1, state="joining")), None, 5.0) == \
        "stage 1 has no online replica"
    assert sample_wait_reason(180.0, run, records(peer("b", 1)), None, 5.0) == "stage 0 has no online replica"
    assert stages_without_replica(records(peer("b", 1, state="leaving")), 3) == [0, 1, 2]
    assert stages_without_replica(records(peer("a", 0), peer("c", 2)), 3) == [1]


def test_settings_are_checked():
    for bad in (dict(period_s=-1.0), dict(period_s=float("inf")), dict(prompt=""), dict(num_tokens=0),
                dict(num_tokens=True), dict(timeout_s=0.0)):
        with pytest.raises(ValueError):
            SampleSettings(**bad)
    with pytest.raises(ValueError, match="sample period"):
        DashboardConfig(sample_period_s=-5)
    with pytest.raises(ValueError, match="at least one token"):
        DashboardConfig(sample_tokens=0)
    assert DashboardConfig(sample_period_s=0).sample_settings().period_s == 0  # off is allowed
    defaults = DashboardConfig().sample_settings()
    assert defaults.period_s == 180.0 and defaults.num_tokens == 48 and defaults.prompt == "The"


def test_state_carries_the_latest_sample():
    join = JoinInfo("run", 1)
    assert build_state(Snapshot(), History(2), join, 0.0)["sample"] is None
    sample = Sample("The", " cat", num_tokens=4, step=12, tokens_per_s=3.14159, sampled_at=1000.5)
    assert build_state(Snapshot(), History(2), join, 0.0, sample)["sample"] == {
        "prompt": "The", "text": " cat", "num_tokens": 4, "step": 12, "tokens_per_s": 3.142, "sampled_at": 1000.5,
        "error": None}
    failed = Sample("The", "", 0, None, None, 1001.0, error="stage 0 has no replica")
    assert build_state(Snapshot(), History(2), join, 0.0, failed)["sample"]["error"] == "stage 0 has no replica"


def sampler_of(run: Optional[RunConfig], peers: Dict[str, PeerRecord], seen: List[Sample],
               **settings) -> DashboardSampler:
    async def no_p2p():
        raise AssertionError("this sample must not reach the network")

    return DashboardSampler(SampleSettings(**settings), no_p2p, lambda: JoinInfo("sample_test", 2, run=run),
                            lambda: peers, on_sample=seen.append)


async def test_a_run_whose_tokenizer_the_dashboard_lacks_shows_why(tmp_path):
    run = tiny_run(tokenizer_sha256="ab" * 32)
    seen: List[Sample] = []
    sampler = sampler_of(run, records(peer("a", 0, hash_=run_hash(run)), peer("b", 1, step=7, hash_=run_hash(run))),
                         seen, tokenizer_cache_dir=str(tmp_path))
    sample = await sampler.step()
    assert sample is not None and seen == [sample] and sampler.latest == sample
    assert "--tokenizer PATH" in sample.error and "ab" * 32 in sample.error
    assert sample.text == "" and sample.step == 7 and sample.tokens_per_s is None and sample.num_tokens == 0
    assert await sampler.step() is None and len(seen) == 1  # the next try waits a period
    # a file that is not the run's tokenizer is named in the error
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    sample = await sampler_of(run, sampler.peers(), seen, tokenizer=str(bad)).step()
    assert sample is not None and str(bad) in sample.error


async def test_peers_of_other_settings_do_not_count_and_nothing_happens_without_a_run():
    run, seen = tiny_run(), []
    stranger = tiny_run(target_batch_size=7)
    sampler = sampler_of(run, records(peer("a", 0, hash_=run_hash(run)), peer("b", 1, hash_=run_hash(stranger))), seen)
    assert await sampler.step() is None and sampler.latest is None
    assert await sampler_of(None, {}, seen).step() is None and seen == []
    stop = asyncio.Event()
    await asyncio.wait_for(sampler_of(run, {}, seen, period_s=0.0).run(stop), 1.0)  # off: returns at once


async def test_the_tokenizer_of_a_run_with_a_manifest_comes_from_the_organiser_and_is_cached(tmp_path):
    from hivemind.p2p import P2P

    (tmp_path / "text").mkdir()
    for index, text in enumerate(make_texts(12)):
        (tmp_path / "text" / f"doc{index}.txt").write_text(text)
    tokenizer = train_tokenizer([tmp_path / "text"], vocab_size=300, out_path=tmp_path / "tokenizer.json")
    run = tiny_run(tokenizer_sha256=tokenizer.sha256,
                   model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16,
                                     vocab_size=tokenizer.vocab_size))
    cache = tmp_path / "cache"
    organiser, address, _ = await serving((tmp_path / "tokenizer.json").read_bytes())
    client = None
    try:
        client = await P2P.create(initial_peers=[address])

        async def p2p():
            return client

        # no replica answers: the sample times out after the tokenizer arrived, and says so
        sampler = DashboardSampler(SampleSettings(timeout_s=0.5, tokenizer_cache_dir=str(cache)), p2p,
                                   lambda: JoinInfo("sample_test", 2, manifest_address=address, run=run), dict)
        sample = await sampler.take(run, {}, address)
        assert sample.error == "no sample within 0.5 s (sample_timeout_s)", sample.error
        assert find_cached(tokenizer.sha256, cache) is not None
        # a sampler without the organiser finds it in the cache
        again = await DashboardSampler(SampleSettings(timeout_s=0.5, tokenizer_cache_dir=str(cache)), p2p,
                                       lambda: JoinInfo("sample_test", 2, run=run), dict).take(run, {}, None)
        assert again.error == "no sample within 0.5 s (sample_timeout_s)", again.error
    finally:
        if client is not None:
            await client.shutdown()
        await organiser.shutdown()


class SlowSampler(DashboardSampler):
    """Generates two tokens, then hangs like a stage that never answers."""

    async def _generate(self, run, tokenizer, pieces):
        pieces += ["a", "b"]
        await asyncio.sleep(60)


async def test_a_sample_that_takes_too_long_is_given_up_with_what_it_had():
    run = tiny_run()
    sampler = SlowSampler(SampleSettings(timeout_s=0.2), None, lambda: JoinInfo("sample_test", 2, run=run),
                          lambda: records(peer("a", 0, hash_=run_hash(run)), peer("b", 1, hash_=run_hash(run))))
    sample = await asyncio.wait_for(sampler.step(), 5.0)
    assert sample.error == "no sample within 0.2 s (sample_timeout_s)"
    assert sample.text == "ab" and sample.num_tokens == 2 and sample.step == 3 and sample.tokens_per_s is None


async def test_the_poller_keeps_the_run_settings_of_a_manifest_it_finds(monkeypatch):
    organiser = load_or_create_identity(None)
    address = f"/ip4/127.0.0.1/tcp/4000/p2p/{organiser.peer_id}"
    run = tiny_run()

    async def fetch_manifest(dht, run_id, organiser_peer_id, timeout):
        assert run_id == "sample_test" and organiser_peer_id == organiser.peer_id
        return RunManifest(run=run, organiser=organiser_peer_id, revision=1, issued_at=0.0)

    monkeypatch.setattr(poller_module, "fetch_manifest", fetch_manifest)
    join = JoinInfo("sample_test", 2, (address,))
    poller = DashboardPoller(None, join, StateBox({}), History(2), 1.0)
    await poller.learn_join({})
    assert poller.join.manifest_address == address and poller.join.run == run
    # a manifest of another number of stages gives the address, but not settings this dashboard cannot read
    poller = DashboardPoller(None, JoinInfo("sample_test", 3, (address,)), StateBox({}), History(2), 1.0)
    await poller.learn_join({})
    assert poller.join.manifest_address == address and poller.join.run is None
