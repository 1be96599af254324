"""Churn: graceful leave, rejoin with state download, restore from checkpoint, rebalancing."""

from __future__ import annotations

import pytest

import asyncio
import signal
import time

import torch

from swarm.server.checkpoints import checkpoint_path, load_checkpoint
from tests.test_failure import accounted
from tests.utils.probe import online

TARGET = 64


@pytest.mark.long
async def test_sigterm_peer_leaves_within_bound_and_nothing_is_lost(launcher, probe):
    peers = {(stage, i): launcher.peer(stage, target_batch_size=TARGET, extra=["--leave_timeout_s", "5"],
                                       name=f"s{stage}r{i}", wait=False) for stage in (0, 1) for i in (0, 1)}
    launcher.wait_ready(list(peers.values()))
    await probe.wait_for(lambda r: all(len(online(r, s)) == 2 for s in (0, 1)), 30, "2 replicas per stage")
    trainer = launcher.trainer(target_batch_size=TARGET, extra=["--max_samples", "640", "--max_in_flight", "4"])
    trainer.wait_event("trainer_ready", timeout=60)
    await probe.wait_for(lambda r: any(rec.step >= 1 for rec in r.values()), 90, "a global step")
    leaver = peers[(1, 0)]
    started = time.monotonic()
    leaver.signal(signal.SIGTERM)
    assert leaver.proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 5 + 15, "a leaving peer must exit within its bound"
    assert leaver.wait_event("peer_stopped", timeout=5)
    done = trainer.wait_event("trainer_done", timeout=180)
    assert done["samples_sent"] == 640 and done["drained"]
    await probe.wait_for(lambda r: len(online(r, 1)) == 1 and all(accounted(r, s) == 640 for s in (0, 1)), 30,
                         "both stages to account for exactly the 640 samples sent")


@pytest.mark.long
async def test_new_replica_downloads_state_and_matches_survivor(launcher, probe):
    launcher.peer(0, target_batch_size=TARGET)
    victim = launcher.peer(1, target_batch_size=TARGET, name="victim")
    launcher.peer(1, target_batch_size=TARGET, name="survivor")
    await probe.wait_for(lambda r: online(r, 0) and len(online(r, 1)) == 2, 30, "three peers online")
    trainer = launcher.trainer(target_batch_size=TARGET, extra=["--duration_s", "60", "--max_in_flight", "2"])
    trainer.wait_event("trainer_ready", timeout=60)
    await probe.wait_for(lambda r: any(rec.step >= 2 for rec in r.values()), 90, "two global steps")
    victim.kill_group()
    records = await probe.wait_for(lambda r: len(online(r, 1)) == 1, 30, "the killed replica's record to expire")
    step_before_join = online(records, 1)[0].step
    newcomer = launcher.peer(1, target_batch_size=TARGET, name="newcomer")
    assert newcomer.wait_event("peer_ready", timeout=5)["step"] >= step_before_join  # joined with downloaded state

    def next_step_together(r) -> bool:
        replicas = online(r, 1)
        return (len(replicas) == 2 and len({x.step for x in replicas}) == 1 and replicas[0].step > step_before_join
                and not any(x.samples_frozen for x in replicas))

    records = await probe.wait_for(next_step_together, 60, "a global step with the newcomer")
    exported = [await probe.call(r.peer_id, "parameters", {}) for r in online(records, 1)]
    if exported[0]["step"] == exported[1]["step"]:  # a further step may land between the two calls
        for a, b in zip(exported[0]["parameters"], exported[1]["parameters"]):
            assert torch.equal(a, b)
    records = await probe.wait_for(lambda r: len({x.digest for x in online(r, 1)}) == 1
                                   and len({x.step for x in online(r, 1)}) == 1, 30, "identical digests")


@pytest.mark.long
async def test_stage_restored_from_checkpoint_after_losing_every_replica(launcher, probe, tmp_path):
    ckpt = ["--checkpoint_dir", str(tmp_path / "ckpt"), "--checkpoint_period_s", "1"]
    launcher.peer(0, target_batch_size=TARGET)
    victim = launcher.peer(1, target_batch_size=TARGET, extra=ckpt, name="victim")
    await probe.wait_for(lambda r: online(r, 0) and online(r, 1), 30, "both stages online")
    trainer = launcher.trainer(target_batch_size=TARGET, extra=["--duration_s", "90", "--max_in_flight", "2"])
    trainer.wait_event("trainer_ready", timeout=60)
    path = checkpoint_path(str(tmp_path / "ckpt"), launcher.run_id, 1)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        saved = load_checkpoint(path, launcher.run_id, 1) if path.exists() else None
        if saved is not None and saved[0]["step"] >= 2:
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError("no checkpoint at step >= 2 was written")
    victim.kill_group()
    saved_step = load_checkpoint(path, launcher.run_id, 1)[0]["step"]
    await probe.wait_for(lambda r: not online(r, 1), 30, "stage 1 to have no replica")

    stranger = launcher.peer(1, target_batch_size=TARGET, wait=False, name="no_checkpoint")
    assert stranger.proc.wait(timeout=90) == 1
    assert "no live replica and no checkpoint" in stranger.log_tail(), stranger.log_tail()

    restored = launcher.peer(1, target_batch_size=TARGET, extra=ckpt, name="restored")
    assert restored.wait_event("peer_ready", timeout=5)["step"] == saved_step
    await probe.wait_for(lambda r: online(r, 1) and online(r, 1)[0].step > saved_step, 60,
                         "training to continue past the checkpoint's step")


async def stage_rate(probe, stage: int, window_s: float) -> tuple:
    """Samples per second processed by a stage over a window, and the replica count seen at its end."""
    first = sum(r.samples_processed for r in online(await probe.records(), stage))
    await asyncio.sleep(window_s)
    records = await probe.records()
    return (sum(r.samples_processed for r in online(records, stage)) - first) / window_s, len(online(records, stage))


@pytest.mark.long
async def test_imbalanced_swarm_rebalances_and_throughput_rises(launcher, probe):
    period_s = 20.0
    # every peer emulates the same slow device (a fixed sleep per sample of backward work, which each
    # stage does once per micro-batch), so the stages cost alike and 3+1 -> 2+2 doubles the bottleneck
    model: list = []
    slow = ["--delay_per_sample_s", "0.04", "--rebalance", "true", "--period_s", str(period_s),
            "--period_jitter", "0.1", "--min_gain", "0.05", "--max_movers_per_period", "1"]
    launcher.wait_ready([launcher.peer(stage, target_batch_size=100_000, extra=slow, wait=False)
                         for stage in (1, 0, 0, 0)])
    await probe.wait_for(lambda r: len(online(r, 0)) == 3 and len(online(r, 1)) == 1, 30, "a 3+1 swarm")
    # enough trainers that the peers, not the trainers, limit throughput
    trainers = [launcher.trainer(target_batch_size=100_000, extra=[*model, "--duration_s", "300", "--max_in_flight",
                                                                   "16", "--trainer_seed", str(seed)])
                for seed in (1, 2)]
    await probe.wait_for(lambda r: sum(x.samples_processed for x in online(r, 1)) > 0, 60, "training to start")
    before, replicas = await stage_rate(probe, 1, 6.0)
    assert replicas == 1, "the swarm rebalanced before the baseline was measured"
    started = time.monotonic()
    await probe.wait_for(lambda r: len(online(r, 0)) == 2 and len(online(r, 1)) == 2, 2.2 * period_s + 30,
                         "the swarm to become 2+2 within two rebalancing periods")
    moved_after = time.monotonic() - started
    await asyncio.sleep(2.0)
    after, replicas = await stage_rate(probe, 1, 6.0)
    capacities = {s: [round(x.throughput, 1) for x in online(await probe.records(), s)] for s in (0, 1)}
    print(f"measured peer throughputs by stage {capacities}")
    print(f"stage 1 throughput before {before:.1f} samples/s, after {after:.1f} samples/s; moved after {moved_after:.1f}s")
    assert replicas == 2 and after > 1.25 * before
    records = await probe.records()
    assert sorted(len(online(records, s)) for s in (0, 1)) == [2, 2], "the swarm must not flap back"
    for trainer in trainers:  # a stopping trainer would wait for seconds of queued work on these slow peers
        trainer.kill_group()
