"""StageRunner state transfer: a short or misshapen state (a truncated download) is refused untouched."""

import pytest
import torch

from swarm.config import RunConfig
from swarm.model import ModelConfig
from swarm.policy.steps import keeps_missed_gradients
from swarm.server.runner import StageRunner

RUN = RunConfig(num_stages=2, target_batch_size=8,
                model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16))


def _source_and_target():
    source, target = StageRunner(RUN, 0), StageRunner(RUN, 0)
    with torch.no_grad():
        for p in source.params:
            p.add_(1.0)
    return source, target


def test_state_round_trip():
    source, target = _source_and_target()
    target.load_state(source.state_metadata(), source.state_tensors())
    assert target.digest == source._digest()


@pytest.mark.parametrize("damage", ["truncated", "misshapen", "other_stage"])
def test_bad_state_is_refused_and_nothing_changes(damage):
    source, target = _source_and_target()
    metadata, tensors = source.state_metadata(), source.state_tensors()
    if damage == "truncated":  # what hivemind returns when its stream ends early without an error
        tensors = tensors[:-2]
    elif damage == "misshapen":
        num = len(source.params)
        tensors[num + 2 * (num - 1)] = torch.zeros(3)  # the last exp_avg: checked after every parameter
    else:
        metadata = dict(metadata, stage=1)
    before = [p.detach().clone() for p in target.params]
    with pytest.raises(ValueError):
        target.load_state(metadata, tensors)
    assert all(torch.equal(a, b) for a, b in zip(before, target.params))


# ---- a frozen step the stage applied without this replica ----

PLAIN = RunConfig(num_stages=2, target_batch_size=8, model=RUN.model, defences=False)


def _adopt(target: StageRunner, adopted_step: int) -> None:
    source = StageRunner(PLAIN, 0)
    source.step = adopted_step
    target.load_state(source.state_metadata(), source.state_tensors())


def _frozen_then_adopting(adopted_step: int, missed: bool):
    """A replica that froze step 0 with one micro-batch of 4 samples, and adopts a state at ``adopted_step``."""
    target = StageRunner(PLAIN, 0)
    grads = [torch.ones_like(p) for p in target.params]
    target._accumulate("t/mb1", 4, grads)
    target.freeze()
    if missed:
        target.missed()
    _adopt(target, adopted_step)
    return target, grads


def test_a_step_the_stage_applied_without_this_replica_is_kept_for_the_adopted_next_one():
    target, grads = _frozen_then_adopting(1, missed=True)
    assert target.step == target.accum_step == 1 and target.frozen is None
    assert target.samples_pending == 4 and target.pending_ids == {"t/mb1"}
    assert all(torch.equal(acc, 4 * g) for acc, g in zip(target.grad_sum, grads))
    assert target.resets == 1 and target.reset_from == 0  # trainers still learn that step 0 did not take it
    assert target._accumulate("t/mb1", 4, grads) == 1 and target.samples_pending == 4  # its re-send counts once


@pytest.mark.parametrize("adopted_step, missed", [(1, False), (2, True)], ids=["not_missed", "two_steps_on"])
def test_other_adoptions_drop_what_the_replica_held(adopted_step, missed):
    target, _ = _frozen_then_adopting(adopted_step, missed)
    assert target.step == adopted_step and target.samples_pending == 0 and not target.pending_ids
    assert all(not acc.any() for acc in target.grad_sum)


def test_kept_gradients_are_not_kept_a_second_time():
    target, grads = _frozen_then_adopting(1, missed=True)
    target._accumulate("t/mb2", 2, grads)
    assert target.freeze().samples == 6
    target.missed()
    _adopt(target, 2)  # the step holding the kept gradients is missed too: all of it goes
    assert target.samples_pending == 0 and not target.pending_ids and not target.carried


def test_the_rule_for_keeping_a_missed_step():
    assert keeps_missed_gradients(5, missed=True, carried=False, adopted_step=6)
    assert not keeps_missed_gradients(5, missed=False, carried=False, adopted_step=6)  # others may hold them
    assert not keeps_missed_gradients(5, missed=True, carried=True, adopted_step=6)  # would be two steps stale
    assert not keeps_missed_gradients(5, missed=True, carried=False, adopted_step=7)
    assert not keeps_missed_gradients(5, missed=True, carried=False, adopted_step=5)
