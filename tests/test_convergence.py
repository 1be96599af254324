"""2 stages x 2 replicas with 2 trainers reach, after the same number of samples, a validation
loss within 5% of single-process training of the same model from the same initialisation; a second
swarm with activations, their gradients and the stage all-reduce compressed to int8 ends within 1%
of where the uncompressed swarm ends, each against its own single-process baseline (what compression
costs, apart from what training in a swarm costs)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Sequence, Tuple

import torch

from swarm.training.data import load_corpus, validation_batches
from swarm.training.single_process import evaluate, train_single_process
from swarm.model.gpt import FullModel, ModelConfig
from swarm.training.optimizer import OptimizerConfig
from tests.utils.probe import Probe, online
from tests.utils.processes import Launcher

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)
TARGET, PER_TRAINER, LR = 64, 640, 0.003


async def train_and_compare(launcher, probe, extra: Sequence[str] = ()) -> Tuple[float, float]:
    """Train the swarm (every role given ``extra``), then the baseline on as many samples in as many
    steps, uncompressed in one process; returns (swarm loss, baseline loss) on the same validation batches."""
    args = ["--lr", str(LR), *extra]
    launcher.wait_ready([launcher.peer(stage, target_batch_size=TARGET, extra=args, wait=False)
                         for stage in (0, 0, 1, 1)])
    await probe.wait_for(lambda r: all(len(online(r, s)) == 2 for s in (0, 1)), 30, "2 replicas per stage")
    trainers = [launcher.trainer(target_batch_size=TARGET, extra=[*args, "--max_samples", str(PER_TRAINER),
                                                                   "--trainer_seed", str(i), "--max_in_flight", "2"])
                for i in (1, 2)]
    total = sum(t.wait_event("trainer_done", timeout=240)["samples_sent"] for t in trainers)
    assert total == 2 * PER_TRAINER

    def settled(r) -> bool:
        return (len(r) == 4 and len({x.step for x in r.values()}) == 1 and not any(x.samples_frozen for x in r.values())
                and sum(x.samples_pending for x in online(r, 1)) < TARGET)

    records = await probe.wait_for(settled, 60, "the swarm to finish its last global step")
    model = FullModel(MODEL, num_stages=2, seed=0)
    for stage in (0, 1):
        exported = await probe.call(online(records, stage)[0].peer_id, "parameters", {})
        with torch.no_grad():
            for param, value in zip(model.stages[stage].parameters(), exported["parameters"]):
                param.copy_(value)

    corpus = load_corpus(None, max_bytes=2 * 2**20)
    batches = validation_batches(corpus.validation, MODEL.seq_len, batch_size=32, num_batches=8)
    initial = evaluate(FullModel(MODEL, num_stages=2, seed=0), batches)
    swarm_loss = evaluate(model, batches)
    # a global step closes once the stage holds *at least* TARGET samples, so with micro-batches in
    # flight steps run a little larger; the baseline takes the same samples in the same number of steps
    steps = next(iter(records.values())).step
    applied = max(r.samples_applied for r in online(records, 1))
    local, _ = train_single_process(MODEL, 2, 0, OptimizerConfig(lr=LR), batch_size=round(applied / steps),
                                    num_steps=steps, sampler_seed=7, corpus=corpus)
    local_loss = evaluate(local, batches)
    print(f"validation loss {' '.join(extra) or '(uncompressed)'}: initial {initial:.4f}, swarm {swarm_loss:.4f}, "
          f"single process {local_loss:.4f} ({(swarm_loss - local_loss) / local_loss:+.2%}); "
          f"{steps} global steps of {applied / steps:.1f} samples on average (target {TARGET})")
    assert applied >= steps * TARGET and applied <= total
    assert initial - local_loss > 0.5, "the baseline must learn something for the comparison to mean anything"
    return swarm_loss, local_loss


async def test_swarm_matches_single_process_and_int8_matches_the_uncompressed_swarm(launcher, probe, tmp_path):
    swarm_loss, local_loss = await train_and_compare(launcher, probe)
    assert abs(swarm_loss - local_loss) <= 0.05 * local_loss
    launcher.close()  # the uncompressed swarm's processes: the int8 swarm gets the cores to itself
    compressed = Launcher(_empty(tmp_path / "int8"), run_id=f"t{uuid.uuid4().hex[:8]}")
    try:
        compressed.bootstrap()
        compressed_probe = Probe(compressed.initial_peers, compressed.run_id)
        try:
            int8_loss, int8_local_loss = await train_and_compare(compressed, compressed_probe, ["--compression", "int8"])
        finally:
            compressed_probe.shutdown()
    finally:
        compressed.close()
    # two swarm runs close different numbers of global steps (steps run past the target by what is in
    # flight), so each is compared with its own baseline, and compression's cost is the difference
    excess, int8_excess = (swarm_loss - local_loss) / local_loss, (int8_loss - int8_local_loss) / int8_local_loss
    print(f"loss over single process: uncompressed {excess:+.2%}, int8 {int8_excess:+.2%}")
    assert abs(int8_excess - excess) <= 0.01


def _empty(path: Path) -> Path:
    path.mkdir()
    return path
