"""Single-process training of the staged model: the baseline the swarm is measured against.

It mirrors what the swarm does as closely as one process can: the model is the same chain
of :class:`~swarm.model.gpt.StageModule` built from the same seed, each stage has its own
optimizer made by :func:`~swarm.training.optimizer.make_optimizer` (the function the stage peers use), and gradient
clipping, when enabled, is per stage, because a stage peer only sees its own gradients.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

from swarm.training.data import Corpus
from swarm.training.tokenized import TokenizedCorpus, make_sampler
from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from swarm.training.optimizer import OptimizerConfig, make_optimizer, optimizer_step

__all__ = ["evaluate", "train_single_process"]


@torch.no_grad()
def evaluate(model: FullModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over ``batches`` (an unweighted mean of batch means; batches are equal-sized)."""
    losses = [float(model(inputs, targets)) for inputs, targets in batches]
    if not losses:
        raise ValueError("batches: need at least one batch to evaluate")
    return sum(losses) / len(losses)


def train_single_process(
    model_config: ModelConfig,
    num_stages: int,
    seed: int,
    optimizer_config: OptimizerConfig,
    batch_size: int,
    num_steps: int,
    sampler_seed: int,
    corpus: Union[Corpus, TokenizedCorpus],
) -> tuple[FullModel, list[float]]:
    """Train from the swarm's initialisation for ``num_steps`` steps of ``batch_size`` samples (byte windows of a
    :class:`Corpus` drawn with ``sampler_seed``, or the samples of a :class:`TokenizedCorpus`, seeded when made).

    Returns the model and the training loss of every step (measured before that step's update).
    """
    for name, value in (("batch_size", batch_size), ("num_steps", num_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    model = FullModel(model_config, num_stages, seed)
    stage_params = [list(stage.parameters()) for stage in model.stages]
    optimizers = [make_optimizer(params, optimizer_config) for params in stage_params]
    sampler = make_sampler(corpus, model_config.seq_len, batch_size, sampler_seed)
    losses = []
    for _ in range(num_steps):
        inputs, targets = sampler.sample()
        loss = model(inputs, targets)
        loss.backward()
        for params, optimizer in zip(stage_params, optimizers):
            optimizer_step(params, optimizer, optimizer_config)
        losses.append(loss.item())
    return model, losses
