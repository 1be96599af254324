"""A poisoning trainer: its micro-batches are clipped, weigh no more than its share, and shuffled targets are
down-weighted on the last stage; honest micro-batches pass untouched. Defences on and off."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from swarm.client.attacks import GRAD_OUTPUT_SCALE, TrainerAttack
from swarm.config.settings import RunConfig, TrainerConfig
from swarm.model.gpt import ModelConfig
from swarm.training.optimizer import OptimizerConfig
from swarm.policy.poisoning import (
    ContributionGuard, PoisoningConfig, clip_bound, clip_factor, clip_reference, loss_outliers, lower_median,
    share_bound, trainer_of, warmup_done,
)
from swarm.server.runner import StageRunner
from tests.utils.probe import online
from tests.utils.processes import wait_for_log_lines

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)
BATCH = 8


# ---- pure decisions ----

def test_lower_median_sides_with_the_smaller_of_two():
    assert lower_median([3.0, 1.0]) == 1.0
    assert lower_median([5.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        lower_median([])


def test_clip_reference_ignores_an_inflating_trainer_with_two_and_a_deflating_one_with_three():
    honest = [1.0, 1.2, 0.9, 1.1]
    assert clip_reference({"honest": honest, "liar": [1000.0] * 50}) == pytest.approx(1.05)
    assert clip_reference({"a": honest, "b": [2.0, 2.2], "liar": [1e-30] * 50}) == pytest.approx(1.05)
    assert clip_reference({"a": honest, "b": [2.0, 2.2], "liar": [1e30] * 50}) == pytest.approx(2.1)
    assert clip_reference({}) is None and clip_reference({"a": []}) is None


def test_clip_bound_and_factor():
    config = PoisoningConfig(clip_multiplier=4.0)
    assert clip_bound({}, config) is None
    assert clip_bound({"a": [1.0, 3.0, 2.0]}, config) == pytest.approx(8.0)
    assert clip_bound({"a": [1.0]}, PoisoningConfig(max_grad_norm=0.5)) == 0.5
    assert clip_factor(3.0, 8.0) == 1.0 and clip_factor(16.0, 8.0) == 0.5 and clip_factor(1e9, None) == 1.0


def test_share_bound_is_the_trainers_sample_fraction_times_the_bound():
    samples = {"a": 24, "b": 8}
    assert share_bound(samples, "b", 2.0) == pytest.approx(0.5)
    assert share_bound(samples, "a", 2.0) == pytest.approx(1.5)
    assert share_bound(samples, "c", 2.0) == 0.0 and share_bound({}, "a", 2.0) == 0.0


def test_trainer_of_reads_the_peer_id_prefix():
    assert trainer_of("12D3KooWabc:17") == "12D3KooWabc"
    assert trainer_of("no-colon") == "no-colon"


def test_loss_outliers_needs_an_absolute_and_a_relative_excess():
    config = PoisoningConfig(min_excess_count=4, excess_window=8, excess_margin=0.1, excess_gap=0.25)
    honest, liar = [-0.05, 0.0, -0.1, 0.02], [0.6, 0.4, 0.5, 0.7]
    assert loss_outliers({"h": honest, "l": liar}, config) == {"l"}
    assert loss_outliers({"h1": honest, "h2": [-0.1, 0.05, 0.0, -0.02]}, config) == set()
    assert loss_outliers({"l": liar}, config) == set()  # alone it is its own reference
    assert loss_outliers({"h": honest, "l": liar[:3]}, config) == set()  # too few micro-batches to judge
    # a model miscalibrated for everyone down-weights nobody
    assert loss_outliers({"a": [0.5] * 4, "b": [0.6] * 4}, config) == set()
    # a liar that makes its own excess very negative cannot push a calibrated honest trainer out
    assert loss_outliers({"h": honest, "l": [-3.0] * 4}, config) == set()
    # once down-weighted, a trainer stays so until it is clearly back: no flapping at the margins
    near = {"h": honest, "l": [0.2] * 4}
    assert loss_outliers(near, config) == set() and loss_outliers(near, config, current={"l"}) == {"l"}
    assert loss_outliers({"h": honest, "l": [0.0] * 4}, config, current={"l"}) == set()


def test_warmup_needs_two_trainers_or_twice_the_micro_batches():
    config = PoisoningConfig(warmup_micro_batches=4)
    assert not warmup_done(3, {"a": [1.0], "b": [1.0, 1.0]}, config)
    assert warmup_done(4, {"a": [1.0], "b": [1.0, 1.0, 1.0]}, config)
    assert not warmup_done(7, {"a": [1.0] * 7, "b": []}, config)  # one trainer alone
    assert warmup_done(8, {"a": [1.0] * 8}, config)


def test_guard_forgets_gone_trainers_ignores_zero_norms_and_reports_new_offenders():
    guard = ContributionGuard(PoisoningConfig(trainer_memory_steps=2, clip_multiplier=2.0))
    assert guard.bound is None
    guard.record_norm("a", 1.0)
    guard.record_norm("b", 0.0)  # a micro-batch down-weighted to nothing
    assert guard.bound is None  # warming up
    guard.settle()
    assert guard.bound == pytest.approx(2.0) and "b" not in guard.norms
    assert guard.clip_factor("b", 20.0) == pytest.approx(0.1)
    clips, new = guard.start_step(1)
    assert clips == {"b": pytest.approx(10.0)} and new == {"b"}
    guard.clip_factor("b", 20.0)
    assert guard.start_step(2)[1] == set()  # already reported
    guard.start_step(5)
    assert guard.norms == {} and guard.bound is None


@pytest.mark.parametrize("field, value", [("clip_multiplier", 0.5), ("max_grad_norm", 0.0), ("history_size", 0),
                                          ("excess_gap", -1.0), ("outlier_weight", 1.5), ("min_excess_count", 64)])
def test_poisoning_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        PoisoningConfig(**{field: value})


def test_trainer_config_attack_is_validated():
    assert TrainerConfig(attack="shuffled_targets").attack == "shuffled_targets"
    with pytest.raises(ValueError, match="attack"):
        TrainerConfig(attack="flip_signs")


def test_attacks_shuffle_targets_and_scale_gradients():
    targets = torch.arange(64).reshape(4, 16)
    shuffled = TrainerAttack("shuffled_targets", seed=0).targets(targets)
    assert shuffled.shape == targets.shape and not torch.equal(shuffled, targets)
    assert torch.equal(shuffled.flatten().sort().values, targets.flatten())
    grad = torch.randn(2, 3)
    assert torch.equal(TrainerAttack("scaled_grad_outputs").last_grad_inputs(grad), grad * GRAD_OUTPUT_SCALE)
    honest = TrainerAttack()
    assert honest.targets(targets) is targets and honest.last_grad_inputs(grad) is grad


# ---- one replica of stage 0, fed realistic grad_outputs by a replica of stage 1 ----

def _micro_batches(count: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, grad_outputs) pairs: what honest trainers send stage 0."""
    run = RunConfig(num_stages=2, target_batch_size=10_000, model=MODEL, defences=False)
    first, last = StageRunner(run, 0), StageRunner(run, 1)
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for index in range(count):
        tokens = torch.randint(0, 256, (BATCH, MODEL.seq_len), generator=generator)
        targets = torch.randint(0, 256, (BATCH, MODEL.seq_len), generator=generator)
        grad_outputs, _, _ = last.backward(f"setup:{index}", first.forward(tokens), None, targets)
        pairs.append((tokens, grad_outputs))
    return pairs


@pytest.fixture(scope="module")
def honest_pairs():
    return _micro_batches(9, seed=0)


def _accumulate(defences: bool, sends: List[Tuple[str, torch.Tensor, torch.Tensor]]) -> Tuple[StageRunner, torch.Tensor]:
    runner = StageRunner(RunConfig(num_stages=2, target_batch_size=10_000, model=MODEL, defences=defences), 0)
    for index, (trainer, tokens, grad_outputs) in enumerate(sends):
        runner.backward(f"{trainer}:{index}", tokens, grad_outputs)
    exported = runner.export(with_gradients=True)
    mean = torch.cat([g.flatten() for g in exported["gradients"]])
    return runner, mean * exported["samples_pending"]  # the accumulated sum


def _honest_sends(pairs) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
    return [(("alice", "bob")[i % 2], tokens, grad) for i, (tokens, grad) in enumerate(pairs)]


def test_honest_micro_batches_are_not_clipped_and_accumulate_exactly(honest_pairs):
    guarded, with_defences = _accumulate(True, _honest_sends(honest_pairs))
    _, without = _accumulate(False, _honest_sends(honest_pairs))
    assert guarded.guard.clipped == 0
    assert torch.equal(with_defences, without)


@pytest.mark.parametrize("first", [0, 3], ids=["after_warmup", "first_micro_batches"])
def test_scaled_micro_batches_move_the_gradient_enormously_only_without_defences(honest_pairs, first):
    """A trainer that sends x1000 grad_outputs: after the warm-up, or from the start (its micro-batches
    are then held back until an honest trainer's arrive, and clipped with them)."""
    honest = _honest_sends(honest_pairs[:8])
    forged = [("mallory", tokens, grad * GRAD_OUTPUT_SCALE) for tokens, grad in honest_pairs[8 - first:9]]
    sends = forged[:first] + honest + forged[first:]
    shifts: Dict[bool, float] = {}
    for defences in (False, True):
        _, clean = _accumulate(defences, honest)
        runner, attacked = _accumulate(defences, sends)
        shifts[defences] = float((attacked - clean).norm())
    clean_norm = float(clean.norm())
    assert shifts[False] > 50 * clean_norm, shifts  # a forged micro-batch outweighs the eight honest ones by far
    assert shifts[True] <= len(forged) * BATCH * runner.guard.largest_bound * (1 + 1e-4)  # what clipped ones can add
    assert shifts[True] < 0.01 * shifts[False] and shifts[True] < 2 * len(forged) * clean_norm, (shifts, clean_norm)
    assert runner.guard.clipped == len(forged)  # the forged ones only


def test_a_trainers_contribution_is_bounded_by_its_share(honest_pairs):
    honest = [("bob", tokens, grad) for tokens, grad in honest_pairs[:6]]
    forged = [("mallory", tokens, grad * GRAD_OUTPUT_SCALE) for tokens, grad in honest_pairs[6:8]]
    parts, limit = {}, 0.0
    for defences in (True, False):
        runner, both = _accumulate(defences, honest + forged)
        _, bob_alone = _accumulate(defences, honest)
        parts[defences] = float((both - bob_alone).norm()) / runner.samples_pending  # mallory's part of the mean
        if defences:
            limit = share_bound({"bob": 6 * BATCH, "mallory": 2 * BATCH}, "mallory", runner.guard.largest_bound)
    assert parts[True] <= limit * (1 + 1e-4), (parts, limit)
    assert parts[False] > 100 * limit, (parts, limit)


def test_defences_off_means_no_guard():
    runner = StageRunner(RunConfig(num_stages=2, model=MODEL, defences=False), 1)
    assert runner.guard is None and not runner.module.lm_head._forward_hooks


# ---- shuffled targets on the last stage: a one-stage model that learns a fixed token mapping ----

SYNTHETIC = ModelConfig(vocab_size=16, num_layers=1, hidden_size=32, num_heads=2, seq_len=8)


def _synthetic(generator: torch.Generator, batch: int = BATCH) -> Tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 16, (batch, 8), generator=generator)
    return tokens, (tokens * 3 + 1) % 16


def _train_with(second: str, defences: bool, steps: int = 40) -> Tuple[StageRunner, float]:
    """Trainer 'alice' is honest; the second trainer sends shuffled targets if it is called 'mallory'.
    Returns the replica and its loss on fresh honest data."""
    run = RunConfig(num_stages=1, target_batch_size=32, model=SYNTHETIC, optimizer=OptimizerConfig(lr=1e-2),
                    defences=defences)
    runner, generator = StageRunner(run, 0), torch.Generator().manual_seed(0)
    attacks = {"alice": TrainerAttack(), second: TrainerAttack("shuffled_targets" if second == "mallory" else "none", 1)}
    count = 0
    for _ in range(steps):
        for trainer in ("alice", second, "alice", second):
            tokens, targets = _synthetic(generator)
            runner.backward(f"{trainer}:{count}", tokens, None, attacks[trainer].targets(targets))
            count += 1
        frozen = runner.freeze()
        runner.apply(frozen.mean_grads, frozen.samples)
    tokens, targets = _synthetic(torch.Generator().manual_seed(99), batch=64)
    return runner, float(runner.forward(tokens, targets))


def test_shuffled_targets_hurt_without_defences_and_are_down_weighted_with_them():
    _, clean = _train_with("bob", defences=False)
    _, undefended = _train_with("mallory", defences=False)
    defended_runner, defended = _train_with("mallory", defences=True)
    assert defended_runner.guard.outliers == {"mallory"}
    assert undefended > 0.3 and undefended > 20 * clean, (clean, undefended)
    assert defended < 0.1 * undefended, (clean, undefended, defended)
    # once down-weighted, its micro-batches add nothing (and would send nothing to stages below)
    tokens, targets = _synthetic(torch.Generator().manual_seed(5))
    before = [g.clone() for g in defended_runner.grad_sum]
    defended_runner.backward("mallory:late", tokens, None, TrainerAttack("shuffled_targets", 2).targets(targets))
    assert all(torch.equal(a, b) for a, b in zip(before, defended_runner.grad_sum))
    defended_runner.backward("alice:late", tokens, None, targets)
    assert not all(torch.equal(a, b) for a, b in zip(before, defended_runner.grad_sum))


def test_honest_trainers_are_never_down_weighted():
    runner, loss = _train_with("bob", defences=True)
    assert runner.guard.outliers == frozenset() and runner.guard.down_weighted == 0
    assert set(runner.guard.excess) == {"alice", "bob"}
    _, undefended = _train_with("bob", defences=False)
    assert loss == pytest.approx(undefended, rel=0.05)


# ---- live: a trainer started with --attack is seen by the stage it attacks ----

@pytest.mark.long
async def test_live_scaled_grad_outputs_are_clipped_and_the_attacker_named(launcher, probe):
    peers = {stage: launcher.peer(stage, target_batch_size=64) for stage in (0, 1)}
    await probe.wait_for(lambda r: all(online(r, s) for s in (0, 1)), 30, "both stages online")
    common = ["--max_samples", "96", "--batch_size", str(BATCH), "--max_in_flight", "2"]
    honest = launcher.trainer(target_batch_size=64, extra=[*common, "--trainer_seed", "1"])
    honest.wait_event("trainer_ready", timeout=30)  # a replica fed by the attacker alone cannot tell it apart
    attacker = launcher.trainer(target_batch_size=64, extra=[*common, "--trainer_seed", "2",
                                                             "--attack", "scaled_grad_outputs"])
    ids = {name: t.wait_event("trainer_done", timeout=50)["trainer_id"]
           for name, t in (("honest", honest), ("attacker", attacker))}
    # a step's clips are logged when the replica freezes it, which may be a step after both trainers are done
    warned = wait_for_log_lines(peers[0], lambda line: "[WARN" in line and "clipped micro-batches" in line
                                and ids["attacker"] in line, timeout=40, what="warning naming the attacker")
    assert warned
    log = peers[0].log_path.read_text(errors="replace").splitlines()
    assert not any("[WARN" in line and "clipped micro-batches" in line and ids["honest"] in line for line in log)
    records = await probe.wait_for(lambda r: any(x.step >= 1 for x in online(r, 0)), 30, "stage 0 to take a step")
    exported = await probe.call(online(records, 0)[0].peer_id, "parameters", {})
    assert all(bool(torch.isfinite(p).all()) for p in exported["parameters"])
