"""The stage optimizer: which parameters are decayed, and which settings are refused."""

import pytest
import torch

from swarm.model import FullModel, ModelConfig
from swarm.optimizer import OptimizerConfig, make_optimizer

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
