"""The optimizer every stage of a run uses: AdamW with per-stage gradient clipping.

Stage peers (:mod:`swarm.server.runner`) and single-process training
(:mod:`swarm.training.single_process`) build and step it through the same two functions, so the swarm
and its single-process baseline apply the same update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["OptimizerConfig", "batch_share", "make_optimizer", "optimizer_step"]


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters, shared by every stage of a run."""

    lr: float = 1e-3  # learning rate
    betas: tuple[float, float] = (0.9, 0.95)  # Adam moment decay rates
    weight_decay: float = 0.0  # decoupled weight decay, applied to matrices only
    max_grad_norm: Optional[float] = None  # clip each stage's gradient L2 norm to this; None = off

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))  # YAML gives lists; keep a tuple
        if not (
            isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0
        ):
            raise ValueError(f"weight_decay must be a non-negative finite number, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and not (
            isinstance(self.max_grad_norm, (int, float))
            and math.isfinite(self.max_grad_norm)
            and self.max_grad_norm > 0
        ):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {self.max_grad_norm!r}")


def make_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over ``params``; with weight decay, only matrices (ndim >= 2) are decayed.

    Decaying LayerNorm gains and biases pulls them towards zero for no benefit, as in GPT-2.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("params: no trainable parameters")
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def batch_share(samples: int, target_batch_size: int) -> float:
    """The learning-rate scale of a step that applies ``samples`` of a ``target_batch_size`` global batch:
    its share of the batch, at most 1.

    A stage closes its step when the last stage does, with whatever it has accumulated by then; a stage
    whose averaging rounds take longer than the last stage's steps falls behind and closes its late steps
    one after another, the first with several batches and the rest with a handful of samples. Applied at
    the full learning rate, a step of 8 samples moves the parameters as far as one of 256 (Adam normalises
    the gradient's size away) in a direction that is mostly noise. Scaled by its share, it moves them as
    far as its evidence warrants. A step with more than the batch is not scaled up: Adam's step does not
    grow less noisy in proportion to its batch, so a larger rate would only add risk."""
    if target_batch_size <= 0:
        raise ValueError(f"target_batch_size must be positive, got {target_batch_size!r}")
    return min(1.0, max(0, samples) / target_batch_size)


def optimizer_step(
    params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer, config: OptimizerConfig, lr_scale: float = 1.0
) -> None:
    """Clip (if configured), step at ``lr_scale`` times the configured rate, and zero the gradients of one
    stage's parameters."""
    if config.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = config.lr * lr_scale
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
