"""The stage optimizer: which parameters are decayed, how far a step short of the global batch moves them,
and which settings are refused."""

import pytest
import torch

from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from swarm.training.optimizer import OptimizerConfig, batch_share, make_optimizer, optimizer_step
from swarm.server.runner import StageRunner

TINY = ModelConfig(vocab_size=256, seq_len=32, num_layers=2, hidden_size=32, num_heads=2)


def test_make_optimizer_decays_only_matrices():
    model = FullModel(TINY, 1, seed=0)
    optimizer = make_optimizer(model.parameters(), OptimizerConfig(weight_decay=0.1))
    assert isinstance(optimizer, torch.optim.AdamW)
    decay = {g["weight_decay"]: g["params"] for g in optimizer.param_groups}
    assert all(p.ndim >= 2 for p in decay[0.1]) and all(p.ndim < 2 for p in decay[0.0])
    assert sum(len(ps) for ps in decay.values()) == len(list(model.parameters()))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"lr": 0.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"weight_decay": -1.0}, "weight_decay"), ({"max_grad_norm": 0}, "max_grad_norm")],
)
def test_optimizer_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**kwargs)


def test_batch_share_is_the_steps_share_of_the_batch_at_most_one():
    assert batch_share(64, 256) == 0.25
    assert batch_share(0, 256) == 0.0
    assert batch_share(256, 256) == 1.0
    assert batch_share(576, 256) == 1.0, "a step with more than the batch is not made larger"
    with pytest.raises(ValueError, match="target_batch_size"):
        batch_share(8, 0)


def _stepped(lr: float, lr_scale: float) -> list:
    model = FullModel(TINY, 1, seed=0)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    optimizer_step(params, make_optimizer(params, OptimizerConfig(lr=lr)), OptimizerConfig(lr=lr), lr_scale=lr_scale)
    return [p.detach() for p in params]


def test_a_scaled_step_is_the_step_at_the_scaled_rate():
    scaled, slower = _stepped(0.01, 0.25), _stepped(0.0025, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(scaled, slower))


def test_a_stage_step_with_a_few_samples_moves_the_parameters_by_their_share():
    """A replica that closes a step with an eighth of the global batch moves its parameters an eighth as far
    as a step of the full batch with the same mean gradient (a first Adam step moves each value by lr)."""
    run = RunConfig(num_stages=2, target_batch_size=64, optimizer=OptimizerConfig(lr=0.01),
                    model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16))
    moved = {}
    for samples in (64, 8):
        runner = StageRunner(run, 0)
        before = [p.detach().clone() for p in runner.params]
        runner.freeze()
        runner.apply([torch.ones_like(p) for p in runner.params], total_samples=samples)
        moved[samples] = max((p.detach() - b).abs().max().item() for p, b in zip(runner.params, before))
    assert moved[64] == pytest.approx(0.01, rel=1e-3)
    assert moved[8] == pytest.approx(moved[64] / 8, rel=1e-3)
