"""StageRunner state transfer: a short or misshapen state (a truncated download) is refused untouched."""

import pytest
import torch

from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
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


def test_the_step_and_digest_readers_take_are_never_torn_by_a_step_or_a_loaded_state():
    """While a step is applied or a state loaded, `version` names the old (step, digest) or the new one,
    never the new step beside the old parameters' digest (what reading `step` and `digest` one after the
    other could give, as the digest is computed after the step moves)."""
    runner = StageRunner(RUN, 0)
    existed = {runner.version}
    seen = []
    sample = lambda *args, **kwargs: seen.append((runner.step, runner.version))  # noqa: E731
    invalidate, digest = runner.forward_cache.invalidate, runner._digest
    runner.forward_cache.invalidate = lambda: (sample(), invalidate())[1]  # the step has moved by now
    runner._digest = lambda: (sample(), digest())[1]  # the parameters have changed by now
    for _ in range(2):
        runner.freeze()
        runner.apply([torch.full_like(p, 0.5) for p in runner.params], RUN.target_batch_size)
        existed.add((runner.step, parameter_digest(runner.params)))
    source = StageRunner(RUN, 0)
    runner.load_state(source.state_metadata(), source.state_tensors())
    existed.add((runner.step, parameter_digest(runner.params)))
    assert runner.version == (runner.step, runner.digest) == (0, parameter_digest(source.params))
    assert any(step != pair[0] for step, pair in seen), "no sample fell where the step had moved"
    assert all(pair in existed for _, pair in seen), f"torn pairs: {[p for _, p in seen if p not in existed]}"
