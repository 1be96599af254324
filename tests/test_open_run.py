"""Live: participants that lie in the DHT, steal micro-batch ids or send bad replies cannot stop the run."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.dht.store import store_record
from swarm.dht.records import PeerRecord, stage_key
from swarm.net.rpc import RemoteError
from tests.utils.probe import Probe, online

TARGET = 64
SEQ, HIDDEN = 16, 32


def fake_record(peer_id: str, stage: int, **fields) -> PeerRecord:
    values = dict(version=PROTOCOL_VERSION, peer_id=peer_id, stage=stage, state="online", throughput=1e9,
                  queue_length=0, step=0, accum_step=0, samples_pending=0, samples_applied=0)
    return PeerRecord(**{**values, **fields})


async def keep_announcing(probe: Probe, record: PeerRecord, stop: asyncio.Event) -> None:
    while not stop.is_set():
        assert await store_record(probe.dht, stage_key(probe.run_id, record.stage), record, expiration_s=5.0)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


@pytest.mark.long
async def test_fake_replicas_do_not_stop_lone_replicas_from_stepping(launcher, probe):
    """A fake 'online' replica of the last stage claims a huge pending batch in the DHT and never averages; a
    fake replica of stage 0 claims a step far ahead. Both real replicas still step, on full batches."""
    launcher.peer(0, target_batch_size=TARGET, name="s0")
    last = launcher.peer(1, target_batch_size=TARGET, name="s1")
    records = await probe.wait_for(lambda r: online(r, 0) and online(r, 1), 30, "both stages online")
    run_hash = online(records, 0)[0].run_hash  # the liars announce the run's settings, as a real attacker would
    liar = Probe(launcher.initial_peers, launcher.run_id)
    stop = asyncio.Event()
    fakes = [asyncio.create_task(keep_announcing(probe, fake_record(probe.peer_id, 0, step=10**6, accum_step=10**6,
                                                                    run_hash=run_hash), stop)),
             asyncio.create_task(keep_announcing(liar, fake_record(liar.peer_id, 1, samples_pending=10**6,
                                                                   run_hash=run_hash), stop))]
    try:
        await probe.wait_for(lambda r: {probe.peer_id, liar.peer_id} <= set(r), 30, "the fake records")
        trainer = launcher.trainer(target_batch_size=TARGET, extra=["--max_samples", "256", "--batch_size", "8"])
        # wait off the event loop: the fake replicas keep announcing meanwhile
        done = await asyncio.get_running_loop().run_in_executor(None, trainer.wait_event, "trainer_done", 240)
        assert done["samples_sent"] == 256
        real = lambda r: [x for x in r.values() if x.peer_id not in (probe.peer_id, liar.peer_id)]
        records = await probe.wait_for(lambda r: len(real(r)) == 2 and all(x.step >= 3 for x in real(r)), 60,
                                       "both real replicas to take at least 3 global steps")
        assert {x.stage for x in real(records)} == {0, 1}
        # the fakes answer no progress call: they leave the step protocol (or, once their claims prove false,
        # are ignored); rounds that still count on one fail in one line each, never with a traceback
        log = last.log_path.read_text(errors="replace")
        assert "did not answer 3 progress calls" in log or "ignoring the claims of" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        stop.set()
        await asyncio.gather(*fakes, return_exceptions=True)
        liar.shutdown()


async def test_hijacked_micro_batch_id_is_refused(launcher, probe):
    launcher.peer(0, target_batch_size=10_000, name="s0")
    launcher.peer(1, target_batch_size=10_000, name="s1")
    records = await probe.wait_for(lambda r: online(r, 0) and online(r, 1), 30, "both stages online")
    last = online(records, 1)[0].peer_id
    thief = Probe(launcher.initial_peers, launcher.run_id)
    try:
        victim_id = f"{probe.peer_id}:7"
        request = {"stage": 1, "micro_batch_id": victim_id, "inputs": torch.randn(2, SEQ, HIDDEN),
                   "targets": torch.randint(0, 256, (2, SEQ))}
        with pytest.raises(RemoteError, match="does not belong to the caller") as error:
            await thief.call(last, "backward", request)
        assert error.value.kind == "bad_request"
        assert (await probe.call(last, "info", {}))["samples_pending"] == 0
        reply = await probe.call(last, "backward", request)  # the rightful owner's gradient is counted
        assert reply["step"] == 0
        assert (await probe.call(last, "info", {}))["samples_pending"] == 2
    finally:
        thief.shutdown()


@pytest.mark.long
async def test_bad_replies_ban_the_peer_that_sent_them_and_the_trainer_lives_on(launcher, probe):
    """Faulty replicas beside honest ones: a non-numeric loss, a NaN loss, and (at stage 0) wrongly shaped
    outputs. The trainer bans each of them, blames stage 0's output on stage 0, and trains on."""
    faulty = {"s0_wrong_shape": (0, "wrong_shape_outputs"), "s1_non_numeric": (1, "non_numeric_loss"),
              "s1_nan_loss": (1, "nan_loss")}
    good = [launcher.peer(stage, target_batch_size=TARGET, name=f"s{stage}_good", wait=False) for stage in (0, 1)]
    bad = {name: launcher.peer(stage, target_batch_size=TARGET, extra=["--fault", fault], name=name, wait=False)
           for name, (stage, fault) in faulty.items()}
    launcher.wait_ready([*good, *bad.values()])
    bad_ids = {name: peer.wait_event("peer_ready", timeout=1)["peer_id"] for name, peer in bad.items()}
    await probe.wait_for(lambda r: len(online(r, 0)) == 2 and len(online(r, 1)) == 3, 30, "five peers online")
    trainer = launcher.trainer(target_batch_size=TARGET, extra=["--max_samples", "160", "--batch_size", "8"])
    done = trainer.wait_event("trainer_done", timeout=180)
    assert done["samples_sent"] == 160
    assert trainer.proc.wait(timeout=60) == 0
    log = trainer.log_tail(1000)
    for name, peer_id in bad_ids.items():
        stage = faulty[name][0]
        assert f"banning peer {peer_id} of stage {stage}" in log, (name, log)


async def test_a_peer_with_other_run_settings_is_refused_naming_the_field(launcher, probe):
    launcher.peer(0, name="s0")
    await probe.wait_for(lambda r: online(r, 0), 30, "stage 0 online")
    other = launcher.peer(1, extra=["--hidden_size", "64"], wait=False, name="other")
    assert other.proc.wait(timeout=90) == 2
    log = other.log_tail(50)
    assert "model.hidden_size" in log and "32" in log and "64" in log and "Traceback" not in log, log
