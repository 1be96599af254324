"""StageRunner state transfer: a short or misshapen state (a truncated download) is refused untouched."""

import pytest
import torch

from swarm.config import RunConfig
from swarm.model import ModelConfig
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
