"""SIGKILL a replica mid-training: its work is retried elsewhere, no sample lost or counted twice.

Run twice: with the forward cache off (every backward recomputes its forward), and with it on while the
victim serves stage 0, so that it dies holding the graphs of forwards whose backward must then be
recomputed by the surviving replica."""

from __future__ import annotations

import pytest

from tests.utils.probe import online

TARGET = 64


def accounted(records, stage: int) -> int:
    """Samples a stage's optimizers account: inside applied global steps, plus pending and frozen."""
    replicas = online(records, stage)
    return max(r.samples_applied for r in replicas) + sum(r.samples_pending + r.samples_frozen for r in replicas)


@pytest.mark.parametrize("victim_stage, cache_mb", [(1, "0"), (0, "512")], ids=["recomputed", "cache_hits"])
@pytest.mark.long
async def test_sigkill_replica_mid_training(launcher, probe, victim_stage, cache_mb):
    peers = {(stage, i): launcher.peer(stage, target_batch_size=TARGET, name=f"s{stage}r{i}",
                                       extra=["--forward_cache_mb", cache_mb], wait=False)
             for stage in (0, 1) for i in (0, 1)}
    launcher.wait_ready(list(peers.values()))
    await probe.wait_for(lambda r: all(len(online(r, s)) == 2 for s in (0, 1)), 30, "2 replicas per stage")
    trainer = launcher.trainer(target_batch_size=TARGET, extra=["--max_samples", "640", "--batch_size", "8",
                                                                "--max_in_flight", "4"])
    trainer.wait_event("trainer_ready", timeout=60)
    before = await probe.wait_for(lambda r: any(rec.step >= 1 for rec in r.values()), 90, "a global step")
    step_at_kill = max(rec.step for rec in before.values())
    victim = peers[(victim_stage, 0)]
    victim.kill_group()  # SIGKILL the replica, its p2pd and its helpers

    done = trainer.wait_event("trainer_done", timeout=180)
    assert done["samples_sent"] == 640
    assert done["drained"], "trainer could not settle its contributions"
    assert done["resent"] > 0 or done["failed"] == 0
    records = await probe.wait_for(
        lambda r: len(online(r, victim_stage)) == 1 and all(accounted(r, s) == 640 for s in (0, 1)), 30,
        "every stage to account for exactly the 640 samples sent")
    steps = {r.step for r in records.values()}
    assert min(steps) > step_at_kill, f"no global step after the kill (steps {steps}, {step_at_kill} at the kill)"
    survivor = online(records, 0)[0]  # stage 0 has a forward cache (the last stage's forward is its backward)
    compute = (await probe.call(survivor.peer_id, "info", {}))["compute"]
    if cache_mb == "0":
        assert compute["forward_cache"]["stored"] == 0 and compute["recomputed"] > 0
    else:
        assert compute["forward_cache"]["hits"] > 0, compute
