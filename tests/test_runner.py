"""StageRunner state transfer: a short or misshapen state (a truncated download) is refused untouched."""

import pytest
import torch

from swarm.config import RunConfig
from swarm.model import ModelConfig
from swarm.server.runner import StageRunner, parameter_digest

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


def test_a_step_applied_while_the_state_is_read_waits_for_the_read():
    """A state served while another thread applies a step is that of one step, whole: its parameters hash to
    the digest of the step its metadata names (a joiner checks exactly that against the announced digest)."""
    import threading

    runner = StageRunner(RUN, 0)
    digest_by_step = {runner.step: runner.digest}
    runner.freeze()
    mean = [torch.full_like(p, 0.5) for p in runner.params]
    copy_tensors = runner.state_tensors
    applier = threading.Thread(target=runner.apply, args=(mean, RUN.target_batch_size))

    def tensors_copied_while_a_step_is_applied():
        applier.start()
        applier.join(timeout=1.0)  # the step goes through now unless the reader holds the lock
        return copy_tensors()

    runner.state_tensors = tensors_copied_while_a_step_is_applied
    metadata, tensors = runner.state()
    applier.join(timeout=10)
    assert not applier.is_alive()
    digest_by_step[runner.step] = runner.digest
    assert runner.step == metadata["step"] + 1, "the step was applied after the read"
    assert parameter_digest(tensors[:len(runner.params)]) == digest_by_step[metadata["step"]]
