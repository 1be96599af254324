"""After global steps, every replica of a stage holds identical parameters, all stages at one step."""

from __future__ import annotations

import torch

from tests.utils.probe import online

TARGET = 64


async def test_replicas_identical_and_stages_in_step(launcher, probe):
    for stage in (0, 0, 1, 1):
        launcher.peer(stage, target_batch_size=TARGET)
    await probe.wait_for(lambda r: all(len(online(r, s)) == 2 for s in (0, 1)), 30, "2 replicas per stage")
    trainers = [launcher.trainer(target_batch_size=TARGET, extra=["--max_samples", "96", "--trainer_seed", str(i),
                                                                   "--batch_size", "8"]) for i in (1, 2)]
    done = [t.wait_event("trainer_done", timeout=120) for t in trainers]
    assert sum(d["samples_sent"] for d in done) == 192

    # the last stage closes a global step once it holds at least TARGET samples (a few more when
    # micro-batches are in flight); the other stages close theirs when it does, so all stages
    # take the same number of steps
    def settled(r) -> bool:
        if len(r) != 4 or len({rec.step for rec in r.values()}) != 1 or any(rec.samples_frozen for rec in r.values()):
            return False
        if sum(rec.samples_pending for rec in online(r, 1)) >= TARGET:
            return False  # the last stage still has a step to close
        return all(max(x.samples_applied for x in online(r, s)) + sum(x.samples_pending for x in online(r, s)) == 192
                   for s in (0, 1))

    records = await probe.wait_for(settled, 60, "all replicas at one step, every stage accounting for 192 samples")
    assert next(iter(records.values())).step >= 1
    for stage in (0, 1):
        replicas = online(records, stage)
        for record in replicas:  # every step was an all-reduce of both replicas, not two local steps
            for step in range(record.step):
                members = (await probe.call(record.peer_id, "step_members", {"stage": stage, "step": step}))["members"]
                assert sorted(members) == sorted(r.peer_id for r in replicas), (stage, step, members)
                assert record.contributed_to(step) is True
        exported = [await probe.call(r.peer_id, "parameters", {}) for r in replicas]
        assert exported[0]["step"] == exported[1]["step"]
        for a, b in zip(exported[0]["parameters"], exported[1]["parameters"]):
            assert torch.equal(a, b), f"stage {stage} replicas differ"
